"""A run stops early on purpose, with real workers: a preemption signal to one rank makes all
of them checkpoint and exit (then the same command resumes exactly); non-finite steps are
skipped and counted, and too many in a row stop the run; a stalled worker ends the job, named."""
import math
import os
import signal
import time

import psutil
import pytest

from helpers import (BIN, WORKERS, assert_same_losses, assert_same_params, horovodrun, hvdtrain, load_params,
                     read_metrics, start_cmd, step_losses, steps_logged, train_workers)
from hvdtrain.checkpointing import checkpoint

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


@pytest.mark.parametrize("library", ["torch/lib/libtorch", "horovod/torch/mpi_lib"], ids=["torch", "horovod"])
def test_a_stop_signal_during_the_set_up_stops_the_run_after_its_first_step(tmp_path, tiny_config, library):
    """A scheduler may preempt a job that is still starting. The signal here comes once the
    worker has loaded PyTorch's library (its import has seconds to go) or Horovod's (before its
    init, data and model): the run still stops as a preempted one, after step 1 with its
    checkpoint and exit 75 (before, the signal's default action ended it with 143 and nothing
    to resume)."""
    config = tiny_config({"train": {"max_steps": STEPS}, "checkpoint": {"every": 100}})
    out = tmp_path / "run"
    proc = start_cmd([BIN / "hvdtrain", "train", config, f"out_dir={out}"])
    maps, deadline = f"/proc/{proc.pid}/maps", time.monotonic() + 120
    while library not in open(maps).read():
        assert proc.poll() is None and time.monotonic() < deadline, f"the worker never loaded {library}"
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 75, stdout[-2000:] + stderr[-2000:]
    assert "stopped: preempted at step 1" in stderr
    assert checkpoint.newest_intact_checkpoint(out).name == "step_00000001"


@pytest.mark.parametrize("precision", [pytest.param("fp32", marks=pytest.mark.deep), "fp16"])  # fp16: the grad scaler skips it, the guard counts it
def test_a_non_finite_step_is_skipped_and_counted(tmp_path, tiny_config, precision):
    config = tiny_config({"train": {"max_steps": 6, "precision": precision}})
    out = tmp_path / "run"
    proc = horovodrun(2, [WORKERS / "inject_faults.py", config, f"out_dir={out}"],
                      env={"HVDTRAIN_TEST_NAN_STEPS": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(out)[0]
    assert [r["skipped_steps"] for r in records] == [0, 0, 1, 0, 0, 0]
    assert math.isnan(records[2]["loss"]) and not math.isfinite(records[2]["grad_norm"])
    assert all(math.isfinite(r["loss"]) for i, r in enumerate(records) if i != 2)
    assert checkpoint.find_problem(checkpoint.newest_intact_checkpoint(out)) is None


@pytest.mark.parametrize("precision", ["fp32", pytest.param("fp16", marks=pytest.mark.deep)])
def test_too_many_non_finite_steps_in_a_row_stop_the_run(tmp_path, tiny_config, precision):
    config = tiny_config({"train": {"max_steps": 8, "max_bad_steps": 3, "precision": precision},
                          "checkpoint": {"every": 1}})
    out = tmp_path / "run"
    proc = horovodrun(2, [WORKERS / "inject_faults.py", config, f"out_dir={out}"],
                      env={"HVDTRAIN_TEST_NAN_STEPS": "2,3,4,5,6,7"})
    assert proc.returncode != 0
    assert "not finite in the last 3 steps up to step 5" in proc.stdout + proc.stderr
    # Checkpoints were written only from finite weights (the bad steps were skipped).
    for path in checkpoint.list_checkpoints(out):
        from safetensors.torch import load_file
        assert all(bool(t.isfinite().all()) for t in load_file(str(path / "model.safetensors")).values())


@pytest.mark.deep
def test_a_streak_between_two_log_points_stops_the_run_where_it_reaches_the_limit(tmp_path, tiny_config):
    """Steps 3, 4, 5 are not finite, step 6 is again: with log points at 4 and 8 neither sees 3
    in a row, yet the run stops after step 5 on every rank (a rank that went on would hang in
    the next collective until the stall watchdog)."""
    config = tiny_config({"train": {"max_steps": 10, "max_bad_steps": 3}, "log": {"every": 4},
                          "horovod": {"stall_timeout_s": 30}})
    out = tmp_path / "run"
    proc = horovodrun(2, [WORKERS / "inject_faults.py", config, f"out_dir={out}"],
                      env={"HVDTRAIN_TEST_NAN_STEPS": "2,3,4"}, timeout=200)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert proc.stderr.count("hvdtrain: stopped: the gradients were not finite in the last 3 steps up to step 5 "
                             "(train.max_bad_steps=3)") == 1, proc.stderr[-3000:]
    assert "stalled" not in proc.stderr
    assert [r["step"] for r in read_metrics(out)[0]] == [4]  # stopped before the log point of step 8
    assert checkpoint.list_checkpoints(out) == []  # nor the final checkpoint


# ---------------------------------------------------------------- stalled workers

STALL_TIMEOUT = 6  # seconds: a tiny step takes milliseconds, the first evaluation well under a second


def test_a_stuck_worker_ends_the_job_with_one_line_saying_where(tmp_path, tiny_config):
    """The test aid train.slow_ranks makes rank 1 sleep in its step: it is stuck, rank 0 waits.
    It is the first step, which may take 3x the stall timeout."""
    config = tiny_config({"train": {"max_steps": 50, "slow_ranks": [1], "slow_seconds": 600},
                          "horovod": {"stall_timeout_s": STALL_TIMEOUT}})
    start = time.monotonic()
    proc = hvdtrain("launch", "--gloo", "-np", "2", config, f"out_dir={tmp_path / 'run'}", timeout=120)
    assert time.monotonic() - start < 3 * STALL_TIMEOUT + 40
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert proc.stderr.startswith(f"hvdtrain: error: worker 1 stalled: no step finished in {3 * STALL_TIMEOUT} s after "
                                  f"step 0 (horovod.stall_timeout_s={STALL_TIMEOUT}); in run_steps (hvdtrain/training/train.py:")
    assert proc.stderr.count("\n") == 1, proc.stderr


def worker_pid(rank: int, out_dir) -> int:
    """The pid of the worker of this rank (under horovodrun --gloo or --mpi) training into out_dir."""
    for p in psutil.process_iter(["cmdline"]):
        try:
            env = p.environ()
        except (psutil.AccessDenied, psutil.NoSuchProcess):
            continue
        if f"out_dir={out_dir}" in (p.info["cmdline"] or []) and str(rank) in (
                env.get("HOROVOD_RANK"), env.get("OMPI_COMM_WORLD_RANK")) and "hvdtrain.cli" in p.info["cmdline"]:
            return p.pid
    raise AssertionError(f"no worker of rank {rank} training into {out_dir}")


@pytest.mark.parametrize("controller", ["gloo", pytest.param("mpi", marks=pytest.mark.deep)])
def test_a_worker_stopped_from_outside_ends_the_job_naming_its_rank(tmp_path, tiny_config, controller):
    """SIGSTOP to rank 1 mid-run: rank 0 waits in a collective that never completes (under MPI
    for ever, under Gloo until its timeout, which hvdtrain sets past the stall timeout)."""
    config = tiny_config({"train": {"max_steps": 100_000}, "horovod": {"stall_timeout_s": STALL_TIMEOUT}})
    out = tmp_path / "run"
    launch = start_cmd([BIN / "hvdtrain", "launch", f"--{controller}", "-np", "2", config, f"out_dir={out}"])
    stopped = None
    try:
        deadline = time.monotonic() + 120
        while steps_logged(out) < 3:
            assert launch.poll() is None and time.monotonic() < deadline, launch.communicate()
            time.sleep(0.2)
        stopped = worker_pid(1, out)
        os.kill(stopped, signal.SIGSTOP)
        start = time.monotonic()
        _, stderr = launch.communicate(timeout=STALL_TIMEOUT + 60)
        assert time.monotonic() - start < STALL_TIMEOUT + 40
        assert launch.returncode == 4, stderr[-3000:]
        # Named by rank 0, which waited for it; under MPI rank 1 may say it itself: mpirun sends
        # SIGCONT before it ends a job, and the watchdog then finds that it did not run.
        said = ("the other workers waited for it in a collective operation, no step finished in "
                f"{STALL_TIMEOUT} s after step ", "no step finished in ")
        assert stderr.startswith(tuple(f"hvdtrain: error: worker 1 stalled: {s}" for s in said)), stderr
        assert "did not run" in stderr or said[0] in stderr, stderr
        assert stderr.count("\n") == 1, stderr
    finally:
        launch.kill()
        if stopped is not None and psutil.pid_exists(stopped):
            os.kill(stopped, signal.SIGKILL)
