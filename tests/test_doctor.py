"""`hvdtrain doctor` reports this installation: torch, Horovod built with Gloo, a verdict."""
import pytest

from helpers import hvdtrain, run_cmd

pytestmark = pytest.mark.workers


def test_doctor_reports_a_ready_cpu_installation():
    proc = hvdtrain("doctor")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "torch       2." in proc.stdout
    assert "controllers Gloo" in proc.stdout
    assert "Gloo" in proc.stdout.split("tensor ops")[1]
    assert proc.stdout.strip().splitlines()[-1].startswith("verdict: READY")


def test_doctor_fails_when_horovod_is_missing(tmp_path):
    """Hide horovod from a fresh interpreter: doctor says so and how to rebuild, exit non-zero."""
    hide = tmp_path / "sitecustomize.py"
    hide.write_text("import sys\nsys.modules['horovod'] = None\n")
    proc = run_cmd(["hvdtrain", "doctor"], env={"PYTHONPATH": str(tmp_path),
                                                "PATH": f"{__import__('sys').executable.rsplit('/', 1)[0]}:/usr/bin:/bin"})
    assert proc.returncode == 1
    assert "NOT READY" in proc.stdout and "make setup" in proc.stdout
