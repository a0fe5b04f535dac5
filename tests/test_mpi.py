"""The key multi-worker guarantees under the MPI controller too (the other tests use Gloo):
`hvdtrain launch --mpi` (horovodrun starting mpirun) and plain `mpirun ... hvdtrain train`,
the way Slurm and the Kubeflow MPI Operator start workers."""
import re
import shutil
import sys

import pytest

from helpers import (WORKERS, assert_same_losses, assert_same_params, hvdtrain, load_params, mpirun, run_cmd,
                     step_losses, train_workers)
from hvdtrain.checkpointing import checkpoint

pytestmark = [pytest.mark.workers,
              pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI is not installed (mpirun)")]

STEPS, HALF = 8, 4


def test_launch_mpi_two_workers_equal_one_worker(tmp_path, tiny_config):
    config = tiny_config({"train": {"global_batch_size": 8}})
    one, two = tmp_path / "np1", tmp_path / "np2"
    assert hvdtrain("train", config, f"out_dir={one}").returncode == 0
    proc = hvdtrain("launch", "--mpi", "-np", "2", config, f"out_dir={two}", "log.progress=true")
    assert proc.returncode == 0, proc.stderr
    # No terminal: rank 0's lines without mpirun's tags, its progress one plain line per log point.
    assert "<stdout>" not in proc.stdout and "\r" not in proc.stdout
    progress = [line.split(":")[0] for line in proc.stdout.splitlines() if re.match(r"step \d+/", line)]
    assert progress == [f"step {step}/6" for step in range(1, 7)], proc.stdout
    assert_same_losses(step_losses(one), step_losses(two))


@pytest.mark.deep
def test_plain_mpirun_stop_and_resume_equals_straight_run(tmp_path, tiny_config):
    """Stopped at step 4 and resumed, 2 workers under plain mpirun; the straight run is one
    process without a launcher (the global batch is fixed, so it is the same run)."""
    config = tiny_config({"train": {"max_steps": STEPS, "global_batch_size": 8},
                          "checkpoint": {"every": 2, "keep": 2}})
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    proc = run_cmd([sys.executable, WORKERS / "train_and_dump.py", config, f"out_dir={straight}"])
    assert proc.returncode == 0, proc.stderr
    train_workers(2, config, f"out_dir={resumed}", f"train.stop_at_step={HALF}", launcher="mpirun")
    assert [p.name for p in checkpoint.list_checkpoints(resumed)] == ["step_00000002", "step_00000004"]
    proc = train_workers(2, config, f"out_dir={resumed}", launcher="mpirun")
    assert "resuming at step 4" in proc.stdout
    assert_same_losses(step_losses(straight), step_losses(resumed), min_steps=STEPS)
    assert_same_params(load_params(resumed, 0), load_params(resumed, 1))
    assert_same_params(load_params(straight, 0), load_params(resumed, 0), atol=1e-5)


@pytest.mark.deep
def test_bad_input_from_a_worker_under_mpi(tmp_path, tiny_config):
    """Only the workers can see it (the data is smaller than one global batch)."""
    out, words = tmp_path / "run", "is larger than the training set"
    proc = hvdtrain("launch", "--mpi", "-np", "2", tiny_config(), f"out_dir={out}", "train.micro_batch_size=200")
    assert proc.returncode == 2
    assert proc.stderr.startswith("hvdtrain: error: ") and words in proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stdout + proc.stderr
    # Plain mpirun: each worker that hit it says so in one line (mpirun may stop the second first).
    proc = mpirun(2, ["-m", "hvdtrain.cli", "train", tiny_config(), f"out_dir={out}", "train.micro_batch_size=200"])
    lines = proc.stderr.splitlines()
    errors = [line for line in lines if line.startswith("hvdtrain: error: ")]
    assert proc.returncode == 2 and 1 <= len(errors) <= 2 and all(words in line for line in errors)
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not out.exists()
