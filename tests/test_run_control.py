"""A run stops early on purpose, with real workers: a preemption signal to one rank makes all
of them checkpoint and exit (then the same command resumes exactly); non-finite steps are
skipped and counted, and too many in a row stop the run."""
import math

import pytest

from helpers import (WORKERS, assert_same_losses, assert_same_params, horovodrun, load_params, read_metrics,
                     step_losses, train_workers)
from hvdtrain import checkpoint

pytestmark = pytest.mark.workers
STEPS = 8


def test_a_signal_to_rank_1_checkpoints_every_rank_and_the_rerun_equals_a_straight_run(tmp_path, tiny_config):
    config = tiny_config({"train": {"max_steps": STEPS}, "checkpoint": {"every": 100}})
    straight, preempted = tmp_path / "straight", tmp_path / "preempted"
    train_workers(2, config, f"out_dir={straight}")
    marker = tmp_path / "preempted"
    proc = horovodrun(2, [WORKERS / "inject_faults.py", config, f"out_dir={preempted}"],
                      env={"HVDTRAIN_TEST_SIGNAL": "1:3", "HVDTRAIN_PREEMPTED_FILE": str(marker)})
    assert proc.returncode != 0
    assert "stopped: preempted at step 4" in proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert marker.exists()  # what a job script checks to requeue (docker/slurm/hvdtrain.sbatch)
    # Every rank stopped after step 4 (the signal came in step 4, index 3), with a checkpoint.
    assert checkpoint.newest_intact_checkpoint(preempted).name == "step_00000004"
    assert sorted(step_losses(preempted)) == [1, 2, 3, 4]
    train_workers(2, config, f"out_dir={preempted}")
    assert_same_losses(step_losses(straight), step_losses(preempted), min_steps=STEPS)
    assert_same_params(load_params(straight, 0), load_params(preempted, 0))


def test_a_non_finite_step_is_skipped_and_counted(tmp_path, tiny_config):
    config = tiny_config({"train": {"max_steps": 6}})
    out = tmp_path / "run"
    proc = horovodrun(2, [WORKERS / "inject_faults.py", config, f"out_dir={out}"],
                      env={"HVDTRAIN_TEST_NAN_STEPS": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(out)[0]
    assert [r["skipped_steps"] for r in records] == [0, 0, 1, 0, 0, 0]
    assert math.isnan(records[2]["loss"]) and not math.isfinite(records[2]["grad_norm"])
    assert all(math.isfinite(r["loss"]) for i, r in enumerate(records) if i != 2)
    assert checkpoint.problem(checkpoint.newest_intact_checkpoint(out)) is None


def test_too_many_non_finite_steps_in_a_row_stop_the_run(tmp_path, tiny_config):
    config = tiny_config({"train": {"max_steps": 8, "max_bad_steps": 3}, "checkpoint": {"every": 1}})
    out = tmp_path / "run"
    proc = horovodrun(2, [WORKERS / "inject_faults.py", config, f"out_dir={out}"],
                      env={"HVDTRAIN_TEST_NAN_STEPS": "2,3,4,5,6,7"})
    assert proc.returncode != 0
    assert "not finite in the last 3 steps up to step 5" in proc.stdout + proc.stderr
    # Checkpoints were written only from finite weights (the bad steps were skipped).
    for path in checkpoint.list_checkpoints(out):
        from safetensors.torch import load_file
        assert all(bool(t.isfinite().all()) for t in load_file(str(path / "model.safetensors")).values())
