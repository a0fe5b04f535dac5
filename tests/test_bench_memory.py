"""`hvdtrain bench memory` (hvdtrain/tools/bench_memory.py): one real run at the smallest sizes, whose
optimizer state is the plan's to the byte, halved by sharding over 2 workers; full sharding's
peak below the unsharded one; a tensor-parallel group's workers keep their slices' state."""
import json
import os

import pytest

from helpers import TINY, hvdtrain, write_config


@pytest.mark.workers
def test_sharding_over_two_workers_halves_the_optimizer_state_and_full_sharding_lowers_the_peak(tmp_path):
    """A GPT of 4 x 256 (3.2M parameters) whose weights and optimizer state dominate its memory:
    per rank, the optimizer level keeps half the optimizer state, the plan's to the byte, and
    full sharding's measured peak is below the unsharded one."""
    config = write_config(tmp_path / "config.yaml", {"model": {"n_layer": 4, "d_model": 256, "n_head": 4}})
    proc = hvdtrain("bench", "memory", config, "--copies", "2", "--levels", "none,optimizer,full", "--steps", "1",
                    "--json", timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["level"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])["rows"]}
    for row in rows.values():
        assert row["copies"] == 2 and row["optimizer_bytes"] == pytest.approx(row["predicted"]["optimizer_bytes"],
                                                                              rel=0.01)
        assert row["peak_bytes"] > row["optimizer_bytes"]
    assert rows["optimizer"]["optimizer_bytes"] == pytest.approx(rows["none"]["optimizer_bytes"] / 2, rel=0.01)
    assert rows["full"]["peak_bytes"] < rows["none"]["peak_bytes"]


@pytest.mark.workers
def test_two_tensor_parallel_ranks_each_keep_their_slices_state_as_the_plan_counts(tmp_path):
    """The same GPT at parallel.tensor_parallel=2, one copy (2 workers): each rank's optimizer
    state is its slices' (the DTensor moments' local tensors, not the whole weights'), the plan's
    to 1%, and about half of the unsplit model's (the embeddings stay whole on both)."""
    from hvdtrain.config import load_config
    from hvdtrain.tools import bench_memory
    config = write_config(tmp_path / "config.yaml", {"model": {"n_layer": 4, "d_model": 256, "n_head": 4}})
    proc = hvdtrain("bench", "memory", config, "parallel.tensor_parallel=2", "--copies", "1", "--levels", "none",
                    "--steps", "1", "--json", timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [row] = json.loads(proc.stdout.strip().splitlines()[-1])["rows"]
    assert (row["copies"], row["tensor_parallel"]) == (1, 2)
    assert row["optimizer_bytes"] == pytest.approx(row["predicted"]["optimizer_bytes"], rel=0.01)
    unsplit = bench_memory.predicted(load_config(str(config), []), 1, "cpu")["optimizer_bytes"]
    assert 0.5 * unsplit < row["optimizer_bytes"] < 0.55 * unsplit


def test_pipeline_stages_are_one_line_naming_bench_pipeline(tmp_path):
    proc = hvdtrain("bench", "memory", write_config(tmp_path / "c.yaml", TINY), "parallel.pipeline_stages=2")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "hvdtrain: error: parallel.pipeline_stages: expected 1 for bench memory (got 2); `hvdtrain bench pipeline` "
        "measures each stage's memory"], proc.stderr


@pytest.mark.deep
@pytest.mark.workers
def test_a_failing_worker_shows_its_own_error_once(tmp_path):
    """Rank 1 raises at its first log point (a sitecustomize on the workers' path, which wraps the
    benchmark's sampling), where rank 0 then fails on the collective rank 1 left: the user sees
    rank 1's error, as `hvdtrain launch` shows it, and not rank 0's echo of it."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('HOROVOD_RANK') == '1':\n"
        "    from hvdtrain.tools import bench_common\n"
        "    original = bench_common.train_sampling\n"
        "    def fail(setup, peak_bytes, interval):\n"
        "        raise RuntimeError('rank one fails here')\n"
        "    bench_common.train_sampling = lambda cfg, sample: original(cfg, fail)\n")
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = hvdtrain("bench", "memory", write_config(tmp_path / "c.yaml", TINY), "--copies", "2", "--levels", "none",
                    "--steps", "1", env=env, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    shown = proc.stderr.split("\n", 1)[1]  # below the horovodrun command it prints
    assert shown.startswith("hvdtrain: worker 1 failed:\nTraceback"), shown[-3000:]
    assert shown.count("RuntimeError: rank one fails here") == 1, shown[-3000:]
    assert "[0]" not in shown and "worker 0" not in shown, shown[-3000:]


def test_bad_copies_are_one_line(tmp_path):
    proc = hvdtrain("bench", "memory", write_config(tmp_path / "c.yaml", TINY), "--copies", "0")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "hvdtrain: error: --copies: expected comma-separated integers >= 1, got '0'"], proc.stderr


@pytest.mark.deep
@pytest.mark.workers
def test_every_level_s_peak_at_one_two_and_four_copies_is_the_plan_s():
    """The measurement docs/memory.md reports, on bench memory's default model (GPT-2 small's 12 x
    768 with a short context and an 8192 vocabulary: 92M parameters, whose weights and optimizer
    state dominate): per rank, at d = 1, 2 and 4 and every level, the optimizer state the plan's
    and the peak within 10% of it; at d = 4 full sharding holds at most half the unsharded peak."""
    proc = hvdtrain("bench", "memory", "--copies", "1,2,4", "--steps", "2", "--json", timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {(r["copies"], r["level"]): r for r in json.loads(proc.stdout.strip().splitlines()[-1])["rows"]}
    assert len(rows) == 12
    for key, row in rows.items():
        assert row["optimizer_bytes"] == pytest.approx(row["predicted"]["optimizer_bytes"], rel=0.01), key
        assert row["peak_bytes"] == pytest.approx(row["predicted"]["peak_bytes"], rel=0.10), (key, row)
    assert rows[4, "full"]["peak_bytes"] <= 0.5 * rows[4, "none"]["peak_bytes"]


def test_the_plan_it_compares_with_leaves_out_the_cuda_context_that_neither_measure_sees(tmp_path):
    """A GPU's max_memory_allocated counts PyTorch's tensors only, a CPU's RSS has no CUDA: the
    compared plan is memory_bytes less its CUDA context, on either device."""
    from hvdtrain.config import load_config
    from hvdtrain.tools import bench_memory, plan

    cfg = load_config(write_config(tmp_path / "config.yaml", {}), [])
    parts = plan.memory_bytes(cfg, cfg.train.micro_batch_size, cfg.model.activation_checkpointing, copies=1)["parts"]
    on_gpu = bench_memory.predicted(cfg, 1, "cuda")["peak_bytes"]
    assert on_gpu == sum(parts.values()) - parts["CUDA context and workspaces"]
    assert bench_memory.predicted(cfg, 1, "cpu")["peak_bytes"] <= on_gpu
