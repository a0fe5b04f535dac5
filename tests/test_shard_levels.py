"""parallel.shard = gradients (ZeRO-2) and full (ZeRO-3; hvdtrain.parallel.sharded_weights) through
the real training loop (`hvdtrain train` under horovodrun, Gloo, fp32, no dropout): the same
maths as the unsharded run and one worker, step by step, with gradient accumulation and
clipping; checkpoints that another level and world size resume; less memory per rank. The
"optimizer" level's own tests are in test_sharded_optimizer.py; the wider grids are deep."""
import math

import pytest
import torch
from safetensors.torch import load_file

from helpers import WORKERS, assert_same_losses, horovodrun, load_params, read_metrics, step_losses, train_workers
from test_sharded_optimizer import CLIPPED, PIPE, assert_close_params, whole_model

# 16 samples of micro batch 4: 2 micro batches per step on each of 2 workers, 4 on one. 3
# validation batches: 2 on rank 0, 1 on rank 1 (with "full" both must gather each unit alike).
ACCUMULATED = {"train": {**CLIPPED["train"], "global_batch_size": 16}, "checkpoint": {"every": 5},
               "eval": {"every": 5, "batches": 3}}


def exported(out_dir) -> dict:
    """The weights of the Hugging Face folder rank 0 wrote at the run's end (with "full" the
    model object holds none after the run)."""
    return load_file(str(out_dir / "hf" / "model.safetensors"))


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One worker and two unsharded workers, the runs every level is compared with."""
    from helpers import write_config
    base = tmp_path_factory.mktemp("references")
    config = write_config(base / "config.yaml", ACCUMULATED)
    one, two = base / "np1", base / "np2"
    train_workers(1, config, f"out_dir={one}")
    train_workers(2, config, f"out_dir={two}")
    return config, one, two


def assert_same_run(reference, run, params: dict):
    assert_same_losses(step_losses(reference), step_losses(run), min_steps=10)
    for a, b in zip(read_metrics(reference)[0], read_metrics(run)[0]):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    evaluations = [(r["step"], r["eval_loss"]) for r in read_metrics(reference)[1]]
    assert len(evaluations) == 3 and [r["step"] for r in read_metrics(run)[1]] == [s for s, _ in evaluations]
    for (_, a), b in zip(evaluations, read_metrics(run)[1]):
        assert b["eval_loss"] == pytest.approx(a, rel=1e-5)
    reference_params = load_params(reference, 0)
    assert_close_params({k: v for k, v in reference_params.items() if k in params}, params)
    # all, but the tied output matrix (and BERT's tied decoder bias) that an export leaves out
    assert all(n.endswith(("lm_head.weight", "decoder.weight", "decoder.bias")) for n in set(reference_params) - set(params))


@pytest.mark.workers
@pytest.mark.parametrize("level", ["gradients", "full"])
def test_a_level_equals_unsharded_and_one_worker(tmp_path, references, level):
    config, one, two = references
    run = tmp_path / level
    train_workers(2, config, f"out_dir={run}", f"parallel.shard={level}")
    assert all(r["grad_norm"] > 0.05 for r in read_metrics(run)[0])  # clipping acts in every step
    params = exported(run) if level == "full" else load_params(run, 0)
    for reference in (one, two):
        assert_same_run(reference, run, params)
    if level == "gradients":  # the allgather leaves every rank with the same weights
        assert all(torch.equal(v, load_params(run, 1)[k]) for k, v in params.items())


@pytest.mark.deep
@pytest.mark.workers
def test_full_sharding_resumed_by_the_optimizer_level_on_one_worker_equals_a_straight_run(tmp_path, references):
    """Each of 2 ranks writes its slices at step 5; one worker reads them all (parallel.shard=
    optimizer over 1 copy) and goes on to step 10."""
    config, one, _ = references
    moved = tmp_path / "moved"
    train_workers(2, config, f"out_dir={moved}", "parallel.shard=full", "train.stop_at_step=5")
    train_workers(1, config, f"out_dir={moved}", "parallel.shard=optimizer")
    assert_same_losses(step_losses(one), step_losses(moved), min_steps=10)
    assert_close_params(load_params(one, 0), load_params(moved, 0))


# ---------------------------------------------------------------- deep: the wider grids

@pytest.mark.deep
@pytest.mark.workers
def test_resume_into_each_level_across_world_sizes_equals_a_straight_run(tmp_path, tiny_config):
    """none on one worker to step 4, full over 2 to 6, gradients over 4 to 8, full over 4 to 10."""
    config = tiny_config({**ACCUMULATED, "checkpoint": {"every": 2}})
    straight, moved = tmp_path / "straight", tmp_path / "moved"
    train_workers(1, config, f"out_dir={straight}")
    train_workers(1, config, f"out_dir={moved}", "train.stop_at_step=4")
    train_workers(2, config, f"out_dir={moved}", "parallel.shard=full", "train.stop_at_step=6")
    train_workers(4, config, f"out_dir={moved}", "parallel.shard=gradients", "train.stop_at_step=8", timeout=400)
    train_workers(4, config, f"out_dir={moved}", "parallel.shard=full", timeout=400)
    assert_same_losses(step_losses(straight), step_losses(moved), min_steps=10)
    reference = load_params(straight, 0)
    assert_close_params({k: v for k, v in reference.items() if k in exported(moved)}, exported(moved))


@pytest.mark.deep
@pytest.mark.workers
@pytest.mark.parametrize("level", ["gradients", "full"])
def test_two_stages_times_two_sharded_copies_equal_the_unsharded_grid(tmp_path, tiny_config, level):
    """p=2 x d=2, the stage's copies reducing during the pipeline's backward and after each run."""
    config = tiny_config({**PIPE, "train": {**PIPE["train"], "global_batch_size": 16}})
    grid = tmp_path / "grid"
    train_workers(4, config, f"out_dir={grid}", "parallel.pipeline_stages=2", timeout=400)
    for when in ("during", "after"):
        run = tmp_path / when
        train_workers(4, config, f"out_dir={run}", "parallel.pipeline_stages=2", f"parallel.reduce_gradients={when}",
                      f"parallel.shard={level}", timeout=400)
        assert_same_losses(step_losses(grid), step_losses(run), min_steps=10)
        for a, b in zip(read_metrics(grid)[0], read_metrics(run)[0]):
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        params = exported(run) if level == "full" else whole_model(run, [0, 2])
        assert_close_params({k: v for k, v in whole_model(grid, [0, 2]).items() if k in params}, params)


@pytest.mark.deep
@pytest.mark.workers
@pytest.mark.parametrize("np,overrides", [
    (2, {"train": {"optimizer": "lamb"}}),
    (2, {"model": {"activation_checkpointing": True}}),
    (4, {}),
    (2, {"model": {"arch": "llama", "n_kv_head": 1}}),
    (2, {"model": {"arch": "llama", "tie_embeddings": False}}),
    (2, {"model": {"arch": "modernbert", "local_attention": 8}}),
    (2, {"model": {"arch": "bert"}}),
], ids=["lamb", "checkpointing", "d4", "llama", "llama-untied", "modernbert", "bert"])
def test_full_sharding_equals_one_worker(tmp_path, tiny_config, np, overrides):
    config = tiny_config({**ACCUMULATED, "model": overrides.get("model", {}),
                          "train": {**ACCUMULATED["train"], **overrides.get("train", {})}})
    one, run = tmp_path / "np1", tmp_path / "full"
    train_workers(1, config, f"out_dir={one}")
    train_workers(np, config, f"out_dir={run}", "parallel.shard=full", timeout=400)
    assert_same_run(one, run, exported(run))


@pytest.mark.deep
@pytest.mark.workers
@pytest.mark.parametrize("level,precision", [("gradients", "fp16"), ("full", "fp16"), ("full", "fp32")])
def test_a_step_only_one_ranks_slices_find_non_finite_is_skipped_on_every_rank(tmp_path, tiny_config, level,
                                                                                precision):
    config = tiny_config({"train": {"global_batch_size": 16, "max_steps": 6, "precision": precision}})
    out = tmp_path / "run"
    proc = horovodrun(2, [WORKERS / "sharded_overflow.py", config, f"out_dir={out}", f"parallel.shard={level}"],
                      env={"HVDTRAIN_TEST_INF_STEP": "2"}, timeout=200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = read_metrics(out)[0]
    assert [r["skipped_steps"] for r in records] == [0, 0, 1, 0, 0, 0]
    assert all(math.isfinite(r["loss"]) for r in records)
