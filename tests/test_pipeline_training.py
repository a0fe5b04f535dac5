"""Pipeline stages x Horovod data parallelism through the real training loop (`hvdtrain
train` under horovodrun, Gloo, fp32, no dropout): the same maths as the unsplit model, tied
copies equal, checkpoints that any layout resumes, and one line for each impossible layout."""
import time

import pytest
import torch

from helpers import (assert_same_losses, hvdtrain, inject, load_params, read_metrics, step_losses, train_workers)
from hvdtrain.checkpointing import checkpoint

pytestmark = pytest.mark.workers

# 4 layers, so 2 stages hold 2 each with embedding and head counted as a layer: [0, 2, 4].
# A global batch of 8 = micro batch 2 x 4 micro batches (the schedule's m) x copies.
PIPE = {"model": {"n_layer": 4}, "train": {"micro_batch_size": 2, "global_batch_size": 8, "lr": 1e-3,
                                           "max_steps": 4, "grad_clip": 0.5}}
# The models compared, and the names of their tied embedding and output matrix (None: untied)
MODELS = {"gpt2": ({"arch": "gpt2"}, ("transformer.wte.weight", "lm_head.weight")),
          "bert": ({"arch": "bert"}, ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight")),
          # the rotary embedding on both stages; grouped-query attention
          "llama": ({"arch": "llama", "n_kv_head": 1}, ("model.embed_tokens.weight", "lm_head.weight")),
          "llama-untied": ({"arch": "llama", "tie_embeddings": False}, None),
          # local layers (1 and 2 of 4) attend to 8 of the 16 positions
          "modernbert": ({"arch": "modernbert", "local_attention": 8},
                         ("model.embeddings.tok_embeddings.weight", "decoder.weight"))}


def whole_model(out_dir, ranks) -> dict:
    """The union of the stages' parameters (each rank dumped its stage's, by the model's names)."""
    params = {}
    for rank in ranks:
        params.update(load_params(out_dir, rank))
    return params


def assert_close_params(reference: dict, params: dict, atol=1e-5):
    assert set(reference) <= set(params), set(reference) - set(params)
    for name, value in reference.items():
        assert torch.allclose(value, params[name], rtol=0, atol=atol), (name, (value - params[name]).abs().max())


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory):
    """The unsplit reference run of one of MODELS, run when a test first asks for it."""
    from helpers import write_config
    runs = {}

    def reference(name):
        if name not in runs:
            folder = tmp_path_factory.mktemp(f"one-{name}")
            config = write_config(folder / "config.yaml", {**PIPE, "model": {**MODELS[name][0], "n_layer": 4}})
            train_workers(1, config, f"out_dir={folder / 'run'}")
            runs[name] = (config, folder / "run")
        return runs[name]
    return reference


DEEP = pytest.mark.deep


@pytest.mark.parametrize("arch,schedule", [pytest.param("gpt2", "gpipe", marks=DEEP), ("gpt2", "1f1b"), pytest.param("bert", "1f1b", marks=DEEP),
                                           pytest.param("bert", "gpipe", marks=DEEP), pytest.param("llama", "1f1b", marks=DEEP),
                                           pytest.param("llama-untied", "gpipe", marks=DEEP), pytest.param("modernbert", "1f1b", marks=DEEP)])
def test_two_stages_equal_one_worker(tmp_path, one_worker, arch, schedule):
    config, reference = one_worker(arch)
    out = tmp_path / "pp2"
    train_workers(2, config, f"out_dir={out}", "parallel.pipeline_stages=2", f"parallel.schedule={schedule}")
    assert_same_losses(step_losses(reference), step_losses(out), min_steps=4)
    # The clipped norm is the whole model's (a tied weight counted once).
    for a, b in zip(read_metrics(reference)[0], read_metrics(out)[0]):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    stages = whole_model(out, [0, 1])
    assert_close_params(load_params(reference, 0), stages)
    ties = MODELS[arch][1]
    if ties:
        embedding, head = ties
        assert torch.equal(load_params(out, 0)[embedding], load_params(out, 1)[head])  # tied copies bitwise equal
    else:  # each matrix on its own stage only
        assert "lm_head.weight" not in load_params(out, 0) and "model.embed_tokens.weight" not in load_params(out, 1)


@DEEP
def test_two_stages_times_two_copies_equal_two_copies(tmp_path, tiny_config):
    config = tiny_config(PIPE)
    dp2, grid = tmp_path / "dp2", tmp_path / "pp2dp2"
    train_workers(2, config, f"out_dir={dp2}")
    train_workers(4, config, f"out_dir={grid}", "parallel.pipeline_stages=2", "parallel.reduce_gradients=after",
                  timeout=400)
    assert_same_losses(step_losses(dp2), step_losses(grid), min_steps=4)
    # rank = stage x 2 + copy: ranks 0, 1 hold stage 0, ranks 2, 3 stage 1; copies are identical.
    for a, b in ((0, 1), (2, 3)):
        pa, pb = load_params(grid, a), load_params(grid, b)
        assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
    assert_close_params(load_params(dp2, 0), whole_model(grid, [0, 2]))


@pytest.mark.parametrize("shard", ["none", pytest.param("optimizer", marks=DEEP)])
def test_fp16_stages_train_as_one_worker(tmp_path, tiny_config, shard):
    """train.precision fp16 (the run's own GradScaler): the schedule's backward runs the loss
    scaled by the scaler's scale, made on the first step (before, unscale_ found none: every
    fp16 run with stages failed at its first step). 4 workers, 2 stages x 2 copies, plain or
    sharded: one worker's losses and gradient norms, no step skipped."""
    config = tiny_config({**PIPE, "train": {**PIPE["train"], "precision": "fp16"}})
    one, grid = tmp_path / "one", tmp_path / "grid"
    train_workers(1, config, f"out_dir={one}")
    train_workers(4, config, f"out_dir={grid}", "parallel.pipeline_stages=2", f"parallel.shard={shard}", timeout=400)
    assert_same_losses(step_losses(one), step_losses(grid), min_steps=4)
    for a, b in zip(read_metrics(one)[0], read_metrics(grid)[0]):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["skipped_steps"] == b["skipped_steps"] == 0


@DEEP
def test_the_start_up_line_gives_the_interleaved_bubble(tmp_path, tiny_config):
    """2 ranks x 2 stages each, 4 micro batches: (p-1)/(v·m+p-1) = 1/9, not 1F1B's 1/5."""
    proc = hvdtrain("launch", "-np", "2", tiny_config(PIPE), f"out_dir={tmp_path / 'run'}", "train.max_steps=1",
                    "parallel.pipeline_stages=2", "parallel.schedule=interleaved1f1b", "parallel.stages_per_rank=2")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "on stage 0 of 2 (interleaved1f1b, 4 micro batches per run, ideal bubble 11%," in proc.stdout, proc.stdout


@DEEP
def test_the_reduction_after_the_pipeline_takes_horovod_compression(tmp_path, tiny_config):
    """parallel.reduce_gradients=after with horovod.compression=fp16: the gradients travel as
    fp16, so the run differs from the uncompressed one, within fp16's rounding."""
    config = tiny_config(PIPE)
    params = {}
    for compression in ("none", "fp16"):
        out = tmp_path / compression
        train_workers(2, config, f"out_dir={out}", "parallel.pipeline_stages=2", "parallel.reduce_gradients=after",
                      f"horovod.compression={compression}")
        params[compression] = whole_model(out, [0, 1])
    assert any(not torch.equal(params["none"][k], params["fp16"][k]) for k in params["none"])
    assert_close_params(params["none"], params["fp16"], atol=1e-3)


@DEEP
def test_resume_with_another_layout_equals_a_straight_run(tmp_path, tiny_config):
    """Stop at step 4 with 2 stages, go on to 6 with one worker, then to 8 with 2 stages again."""
    config = tiny_config({**PIPE, "train": {**PIPE["train"], "max_steps": 8}, "checkpoint": {"every": 2}})
    straight, moved = tmp_path / "straight", tmp_path / "moved"
    train_workers(1, config, f"out_dir={straight}")
    train_workers(2, config, f"out_dir={moved}", "parallel.pipeline_stages=2", "train.stop_at_step=4")
    assert {p.name for p in checkpoint.newest_intact_checkpoint(moved).iterdir()} >= {
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    train_workers(1, config, f"out_dir={moved}", "train.stop_at_step=6")
    train_workers(2, config, f"out_dir={moved}", "parallel.pipeline_stages=2")
    assert_same_losses(step_losses(straight), step_losses(moved), min_steps=8)
    assert_close_params(load_params(straight, 0), whole_model(moved, [0, 1]))
    # The run's Hugging Face folder is the whole model, rebuilt from the stages' parts.
    from transformers import AutoModelForCausalLM
    exported = AutoModelForCausalLM.from_pretrained(moved / "hf").state_dict()
    assert_close_params({k: v for k, v in load_params(straight, 0).items() if k in exported}, exported)


def test_a_failing_stage_ends_the_job_at_once_with_its_error(tmp_path, tiny_config):
    """Rank 1 (the last stage) raises in its third backward; rank 0 waits for it inside the step.
    The failing rank's clean-up must not wait for the others (Horovod's process sets are removed
    collectively), or the job hangs until the stall watchdog names the wrong cause."""
    start = time.monotonic()
    proc = hvdtrain("launch", "--gloo", "-np", "2", tiny_config(PIPE), f"out_dir={tmp_path / 'run'}",
                    "parallel.pipeline_stages=2", "horovod.stall_timeout_s=20", env=inject("error"), timeout=180)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith("hvdtrain: worker 1 failed:\nTraceback (most recent call last):\n"), proc.stderr
    assert proc.stderr.count("RuntimeError: injected failure in the middle of training") == 1, proc.stderr
    assert "stalled" not in proc.stderr
    assert elapsed < 40, elapsed  # the stall watchdog would have ended it after 3 x 20 s


@pytest.mark.parametrize("overrides,words", [
    (["parallel.pipeline_stages=3"], ["'parallel.pipeline_stages'", "does not divide the 2 workers"]),
    (["parallel.pipeline_stages=2", "train.global_batch_size=4", "train.micro_batch_size=4"],
     ["parallel.microbatches=1", "at least parallel.pipeline_stages=2"]),
    pytest.param(["parallel.pipeline_stages=2", "parallel.microbatches=3"], ["'parallel.microbatches'", "does not divide"],
                 marks=DEEP),
    (["parallel.pipeline_stages=2", "parallel.schedule=zigzag"], ["'parallel.schedule'", "'1f1b'"]),
    pytest.param(["parallel.pipeline_stages=2", "parallel.layer_boundaries=[0,1,2]"], ["parallel.layer_boundaries"],
                 marks=DEEP),
])
def test_impossible_layouts_are_one_line(tmp_path, tiny_config, overrides, words):
    out = tmp_path / "run"
    proc = hvdtrain("launch", "-np", "2", tiny_config(PIPE), f"out_dir={out}", *overrides)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), proc.stderr
    assert not out.exists()


def test_more_stages_than_layers_is_refused_before_any_worker_starts(tmp_path, tiny_config):
    proc = hvdtrain("train", tiny_config(), f"out_dir={tmp_path / 'run'}", "parallel.pipeline_stages=4")
    assert proc.returncode == 2 and "'parallel.pipeline_stages'" in proc.stderr and "model.n_layer=2" in proc.stderr


def test_each_stage_checksums_its_own_part_and_a_damaged_part_is_found_at_resume(tmp_path, tiny_config):
    """With 2 stages rank 1 writes, fsyncs and checksums stage 2's part; rank 0 writes the
    manifest from the checksums it is sent, reading no byte of that part. A part damaged later
    is set aside at resume, which continues from the checkpoint before."""
    config = tiny_config({**PIPE, "train": {**PIPE["train"], "max_steps": 6}, "checkpoint": {"every": 2, "keep": 3}})
    out = tmp_path / "run"
    train_workers(2, config, f"out_dir={out}", "parallel.pipeline_stages=2", "train.stop_at_step=4",
                  worker="count_checksums.py")
    second = {"model-00002-of-00002.safetensors", "optimizer-00002-of-00002.safetensors"}
    first = {"model-00001-of-00002.safetensors", "optimizer-00001-of-00002.safetensors"}
    by_rank = [(out / f"checksummed_rank{r}.txt").read_text().split() for r in (0, 1)]
    assert not second & set(by_rank[0]) and first <= set(by_rank[0])
    assert sorted(by_rank[1]) == sorted([*second, *second])  # its part of steps 2 and 4, nothing else
    newest = checkpoint.newest_intact_checkpoint(out)
    assert newest.name == "step_00000004" and checkpoint.find_problem(newest) is None  # the manifest is right
    assert second <= {p.name for p in newest.iterdir()}
    damaged = newest / "model-00002-of-00002.safetensors"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))
    proc = train_workers(2, config, f"out_dir={out}", "parallel.pipeline_stages=2")
    assert "model-00002-of-00002.safetensors does not match its checksum" in proc.stdout + proc.stderr
    assert "resuming at step 2" in proc.stdout
    assert (checkpoint.checkpoint_dir(out) / "damaged-step_00000004").is_dir()
    assert sorted(step_losses(out)) == list(range(1, 7))
