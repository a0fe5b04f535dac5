"""scripts/gpu-check.py, as far as a CPU allows: the dry run finds every problem with the
carried files and commands, and the stages keep to the time budget."""
import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from helpers import REPO, run_cmd

SCRIPT = REPO / "scripts" / "gpu-check.py"


@pytest.fixture
def gpu_check():
    spec = importlib.util.spec_from_file_location("hvdtrain_gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_carry(gpu_check, carry: Path) -> str:
    """A complete carry folder of stand-in files; returns the stand-in sdist's sha256."""
    files = {gpu_check.HOROVOD_SDIST: b"sdist", gpu_check.HF_BASELINE: b"print('baseline')",
             "wheels/cffi-2.1.1-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl": b"cffi",
             "wheels/pycparser-3.12-py3-none-any.whl": b"pycparser"}
    for name, data in files.items():
        (carry / name).parent.mkdir(parents=True, exist_ok=True)
        (carry / name).write_bytes(data)
    manifest = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    (carry / gpu_check.MANIFEST).write_text(json.dumps(manifest))
    return manifest[gpu_check.HOROVOD_SDIST]


def test_dry_run_accepts_a_complete_carry_and_names_each_problem(gpu_check, tmp_path):
    pin = fake_carry(gpu_check, tmp_path)
    assert gpu_check.dry_run(tmp_path, pinned_sha256=pin) == []
    # The sdist must be the one scripts/install.py pins, or install.py would try to download it.
    assert gpu_check.dry_run(tmp_path, pinned_sha256="0" * 64) == [
        f"{tmp_path / gpu_check.HOROVOD_SDIST}: sha256 is not the one scripts/install.py pins (it would try to download)"]
    (tmp_path / "wheels/pycparser-3.12-py3-none-any.whl").unlink()
    (tmp_path / gpu_check.HF_BASELINE).write_text("changed")
    problems = gpu_check.dry_run(tmp_path, pinned_sha256=pin)
    assert f"{tmp_path / 'wheels/pycparser-3.12-py3-none-any.whl'}: missing" in problems
    assert f"{tmp_path / gpu_check.HF_BASELINE}: sha256 differs from manifest.json (damaged or replaced)" in problems
    assert len(problems) == 2


def test_wheels_must_install_on_cpython_312_x86_64(gpu_check):
    ok = ["cffi-2.1.1-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", "pycparser-3.12-py3-none-any.whl",
          "pkg-1.0-cp39-abi3-manylinux_2_28_x86_64.whl"]
    bad = ["cffi-2.1.1-cp311-cp311-manylinux2014_x86_64.whl", "cffi-2.1.1-cp312-cp312-manylinux2014_aarch64.whl",
           "cffi-2.1.1-cp312-cp312-macosx_11_0_x86_64.whl"]
    assert [gpu_check.wheel_file_ok(n) for n in ok + bad] == [True] * 3 + [False] * 3


def test_the_commands_of_the_call_parse_and_their_recipes_load(gpu_check):
    assert gpu_check.check_commands(gpu_check.CARRY) == []


def test_dry_run_command_line_without_a_carry(tmp_path):
    proc = run_cmd([sys.executable, SCRIPT, "--dry-run", "--carry", tmp_path / "none"], timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"gpu-check: {tmp_path / 'none' / 'manifest.json'}: missing (run: python3 " \
                                  "scripts/gpu-check.py --prepare)"


def test_stages_keep_to_the_budget(gpu_check, tmp_path):
    """Each stage gets what is left (up to its own limit); a stage that overruns is killed; one
    that needs more than is left is skipped; the summary is written after every stage."""
    py = sys.executable
    stages = [gpu_check.Stage("quick", [py, "-c", "print('hello')"], 30, 1),
              gpu_check.Stage("slow", [py, "-c", "import time; time.sleep(60)"], 60, 1),
              gpu_check.Stage("late", [py, "-c", "print('never')"], 30, 5)]
    runner = gpu_check.Runner(tmp_path, tmp_path, budget=4.0, env={})
    for stage in stages:
        runner.run(stage, reserve=0.5)
    results = json.loads((tmp_path / "summary.json").read_text())
    assert results["quick"]["status"] == "ok" and results["quick"]["last_line"] == "hello"
    assert results["slow"]["status"] == "timeout" and results["slow"]["seconds"] < 6
    assert results["late"]["status"].startswith("skipped")
    assert "hello" in (tmp_path / "log.txt").read_text()
    table = "\n".join(gpu_check.summary_table(results))
    assert "slow             timeout" in table and "-- quick: hello" in table
