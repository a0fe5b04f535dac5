"""parallel.shard_optimizer (hvdtrain.parallel.sharded_optimizer) through the real training loop
(`hvdtrain train` under horovodrun, Gloo, fp32, no dropout): the same maths as the unsharded
run, step by step; every rank agrees to skip a step whose gradients only one rank's slices
show to be non-finite; checkpoints whose slices any layout resumes; one line for what it
does not support."""
import json
import math

import pytest
import torch

from helpers import (WORKERS, assert_same_losses, hvdtrain, horovodrun, load_params, read_metrics, step_losses,
                     train_workers)
from hvdtrain.checkpointing import checkpoint
from hvdtrain.parallel.sharded_optimizer import shard_range

SHARD = "parallel.shard=optimizer"
# A clip low enough to act in every step (the norms are ~1): the norm is the whole model's.
CLIPPED = {"train": {"global_batch_size": 8, "max_steps": 10, "grad_clip": 0.05}}
PIPE = {"model": {"n_layer": 4}, "train": {"micro_batch_size": 2, "global_batch_size": 8, "lr": 1e-3,
                                           "max_steps": 10, "grad_clip": 0.5}}


def assert_close_params(reference: dict, params: dict, atol=1e-5):
    assert set(reference) <= set(params), set(reference) - set(params)
    for name, value in reference.items():
        assert torch.allclose(value, params[name], rtol=0, atol=atol), (name, (value - params[name]).abs().max())


def whole_model(out_dir, ranks) -> dict:
    params = {}
    for rank in ranks:
        params.update(load_params(out_dir, rank))
    return params


def test_the_shards_are_horovods_reduce_scatter_split():
    """numel // size each, one more for the first numel % size ranks; together the whole tensor."""
    assert [shard_range(7, r, 3) for r in range(3)] == [(0, 3), (3, 5), (5, 7)]
    assert [shard_range(1, r, 2) for r in range(2)] == [(0, 1), (1, 1)]


@pytest.mark.workers
@pytest.mark.parametrize("optimizer,model", [
    ("adamw", {}), pytest.param("lamb", {}, marks=pytest.mark.deep),
    # the other families under deep (to make room for test_shard_levels; each level's families are there)
    pytest.param("adamw", {"arch": "llama", "n_kv_head": 1}, marks=pytest.mark.deep),
    pytest.param("adamw", {"arch": "modernbert", "local_attention": 8}, marks=pytest.mark.deep)],
    ids=["adamw", "lamb", "llama", "modernbert"])
def test_sharded_equals_unsharded_and_one_worker(tmp_path, tiny_config, optimizer, model):
    config = tiny_config({**CLIPPED, "model": model, "train": {**CLIPPED["train"], "optimizer": optimizer}})
    one, two, sharded = tmp_path / "np1", tmp_path / "np2", tmp_path / "sharded"
    train_workers(1, config, f"out_dir={one}")
    train_workers(2, config, f"out_dir={two}")
    train_workers(2, config, f"out_dir={sharded}", SHARD)
    assert all(r["grad_norm"] > 0.05 for r in read_metrics(sharded)[0])  # clipping acts in every step
    for reference in (one, two):
        assert_same_losses(step_losses(reference), step_losses(sharded), min_steps=10)
        for a, b in zip(read_metrics(reference)[0], read_metrics(sharded)[0]):
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert_close_params(load_params(reference, 0), load_params(sharded, 0))
    # The allgather leaves every rank with the same weights.
    assert all(torch.equal(v, load_params(sharded, 1)[k]) for k, v in load_params(sharded, 0).items())


@pytest.mark.workers
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.deep)])
def test_a_full_gradient_is_freed_once_its_reduce_scatter_is_done_during_backward(tmp_path, tiny_config, dtype):
    """The reduced slices take the full gradients' place (8 + 8/d bytes per parameter, bf16
    6 + 12/d), not beside them until backward ends."""
    proc = horovodrun(2, [WORKERS / "sharded_freeing.py", tiny_config(), dtype], timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines() if "RESULT " in line]
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert all(r["freed"] and r["taken"] and r["complete"] for r in results), results


@pytest.mark.workers
def test_a_backward_that_outruns_its_reduce_scatters_waits_for_them(tiny_config):
    """ZeRO-2/3 keep at most one fusion buffer's worth of full gradients in flight (the plan's
    count), not a whole backward's when the reductions lag (one rank slower than the other)."""
    proc = horovodrun(2, [WORKERS / "sharded_in_flight.py", tiny_config()], timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines() if "RESULT " in line]
    assert sorted(r["rank"] for r in results) == [0, 1]
    for r in results:
        assert r["limit"] == 2 ** 19 and r["limited"] <= r["limit"], r
    fast = next(r for r in results if r["rank"] == 0)
    assert fast["unlimited"] > 2 * fast["limit"], fast  # without the limit the fast rank runs ahead


@pytest.mark.deep
@pytest.mark.workers
def test_bf16_computes_in_bf16_weights_with_fp32_masters_within_bf16_tolerance(tmp_path, tiny_config):
    """The sharded bf16 run's model holds bf16 weights (the fp32 masters are sharded), its
    checkpoint the fp32 masters' slices; its losses are today's bf16 path's within bf16 rounding.
    The weights cross the allgather as bf16 bits (sharded_optimizer.on_the_wire): each rank's
    weights are its masters rounded to bf16, bit for bit."""
    config = tiny_config({"train": {"precision": "bf16", "grad_accum": 2, "max_steps": 10}})
    today, sharded = tmp_path / "today", tmp_path / "sharded"
    train_workers(2, config, f"out_dir={today}")
    train_workers(2, config, f"out_dir={sharded}", SHARD)
    a, b = step_losses(today), step_losses(sharded)
    assert a.keys() == b.keys() and all(b[k] == pytest.approx(a[k], rel=5e-3) for k in a)
    assert {v.dtype for v in load_params(sharded, 0).values()} == {torch.bfloat16}
    from safetensors import safe_open
    part = checkpoint.newest_intact_checkpoint(sharded) / "model-00001-of-00002.safetensors"
    with safe_open(str(part), framework="pt") as f:
        assert f.get_tensor("transformer.h.0.mlp.c_fc.weight").dtype == torch.float32
    for rank in (0, 1):
        weights = load_params(sharded, rank)
        masters = checkpoint.read_weights(checkpoint.newest_intact_checkpoint(sharded), list(weights),
                                          {"lm_head.weight": ["transformer.wte.weight"]})  # tied
        assert all(torch.equal(masters[k].to(torch.bfloat16), v) for k, v in weights.items())


@pytest.mark.deep
@pytest.mark.workers
def test_two_stages_times_two_sharded_copies_equal_the_unsharded_grid(tmp_path, tiny_config):
    """4 workers: 2 pipeline stages x 2 copies, the slices taken over each stage's copies;
    the tied embedding's slices summed between the ends, its norm counted once. The sharded
    run reduces after the pipeline's run (one grouped reduce-scatter), the reference during it."""
    config = tiny_config(PIPE)
    grid, sharded = tmp_path / "grid", tmp_path / "sharded"
    train_workers(4, config, f"out_dir={grid}", "parallel.pipeline_stages=2", timeout=400)
    train_workers(4, config, f"out_dir={sharded}", "parallel.pipeline_stages=2", "parallel.reduce_gradients=after",
                  SHARD, timeout=400)
    assert_same_losses(step_losses(grid), step_losses(sharded), min_steps=10)
    for a, b in zip(read_metrics(grid)[0], read_metrics(sharded)[0]):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    for rank in range(4):
        assert_close_params(load_params(grid, rank), load_params(sharded, rank))
    assert torch.equal(load_params(sharded, 0)["transformer.wte.weight"], load_params(sharded, 2)["lm_head.weight"])


@pytest.mark.workers
@pytest.mark.parametrize("precision,optimizer", [pytest.param("fp16", "adamw", marks=pytest.mark.deep), pytest.param("fp16", "lamb", marks=pytest.mark.deep),
                                                       ("fp32", "adamw")])
def test_a_step_only_one_ranks_slices_find_non_finite_is_skipped_on_every_rank(tmp_path, tiny_config, precision,
                                                                                optimizer):
    """Rank 0's slice of one parameter gets an inf in step 3: with fp16 the grad scaler of every
    rank skips the step (the found-inf flag is the maximum over the copies; LAMB takes it as a
    flag on the device, AdamW on the CPU is not called), in fp32 the guard (the norm is global).
    A rank that stepped alone would wait in the allgather for ever."""
    config = tiny_config({"train": {"global_batch_size": 8, "max_steps": 6, "precision": precision,
                                    "optimizer": optimizer}})
    out = tmp_path / "run"
    proc = horovodrun(2, [WORKERS / "sharded_overflow.py", config, f"out_dir={out}", SHARD],
                      env={"HVDTRAIN_TEST_INF_STEP": "2"}, timeout=200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = read_metrics(out)[0]
    assert [r["skipped_steps"] for r in records] == [0, 0, 1, 0, 0, 0]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert all(torch.equal(v, load_params(out, 1)[k]) for k, v in load_params(out, 0).items())


@pytest.mark.deep
@pytest.mark.workers
def test_resume_across_layouts_equals_a_straight_run(tmp_path, tiny_config):
    """Sharded over 2 workers to step 4, on one worker unsharded to 6, sharded over 4 to 8, in 2
    pipeline stages with sharded copies to 10; then `hvdtrain export` of the sharded checkpoint."""
    config = tiny_config({**PIPE, "checkpoint": {"every": 2}})
    straight, moved = tmp_path / "straight", tmp_path / "moved"
    train_workers(1, config, f"out_dir={straight}")
    train_workers(2, config, f"out_dir={moved}", SHARD, "train.stop_at_step=4")
    parts = {p.name for p in checkpoint.newest_intact_checkpoint(moved).iterdir()}
    assert {"model-00001-of-00002.safetensors", "optimizer-00002-of-00002.safetensors"} <= parts
    train_workers(1, config, f"out_dir={moved}", "train.stop_at_step=6")
    train_workers(4, config, f"out_dir={moved}", SHARD, "train.stop_at_step=8", timeout=400)
    train_workers(4, config, f"out_dir={moved}", SHARD, "parallel.pipeline_stages=2", timeout=400)
    assert_same_losses(step_losses(straight), step_losses(moved), min_steps=10)
    assert_close_params(load_params(straight, 0), whole_model(moved, [0, 2]))
    exported = tmp_path / "exported"
    proc = hvdtrain("export", moved, exported)
    assert proc.returncode == 0, proc.stderr
    from transformers import AutoModelForCausalLM
    weights = AutoModelForCausalLM.from_pretrained(exported).state_dict()
    assert_close_params({k: v for k, v in load_params(straight, 0).items() if k in weights}, weights)


@pytest.mark.workers
@pytest.mark.parametrize("overrides,words", [
    ([SHARD, "horovod.compression=fp16"], ["'horovod.compression'", "parallel.shard='optimizer'"]),
    ([SHARD, "horovod.op=adasum"], ["'horovod.op'", "'adasum' is not supported"]),
    (["parallel.shard=full", "horovod.op=adasum"], ["'horovod.op'", "'adasum' is not supported"]),
    (["parallel.shard=gradients", "horovod.compression=fp16"], ["'horovod.compression'", "parallel.shard='gradients'"]),
    (["parallel.shard=full", "parallel.shard_optimizer=true"], ["'parallel.shard_optimizer'", "parallel.shard='full'"]),
    (["parallel.shard=zero3"], ["'parallel.shard'", "zero3"]),
    (["parallel.shard=full", "model.compile=true"], ["'model.compile'", "parallel.shard='full'"]),
])
def test_what_sharding_does_not_support_is_one_line(tmp_path, tiny_config, overrides, words):
    out = tmp_path / "run"
    proc = hvdtrain("train", tiny_config(), f"out_dir={out}", *overrides)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("level", ["optimizer", "gradients", "full"])
def test_elastic_jobs_refuse_sharding(level):
    from hvdtrain.config import load_config
    from hvdtrain.parallel.elastic import check_elastic_config
    from hvdtrain.errors import UserError
    cfg = load_config(None, ["train.global_batch_size=8", f"parallel.shard={level}"])
    with pytest.raises(UserError, match=f"'parallel.shard': elastic jobs do not support sharding .got '{level}'"):
        check_elastic_config(cfg)


def test_shard_optimizer_true_is_the_optimizer_level():
    from hvdtrain.config import load_config
    assert load_config(None, ["parallel.shard_optimizer=true"]).parallel.shard == "optimizer"
    assert load_config(None, ["parallel.shard_optimizer=false"]).parallel.shard == "none"
