"""scripts/gpu-check.py, as far as a CPU allows: the dry run finds every problem with the
carried files and commands, and the stages keep to the time budget."""
import hashlib
import importlib.util
import json
import os
import sys
import time
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
             "wheels/pycparser-3.12-py3-none-any.whl": b"pycparser",
             "wheels/datasets-5.2.0-py3-none-any.whl": b"datasets", "wheels/dill-0.4.1-py3-none-any.whl": b"dill",
             "wheels/multiprocess-0.70.19-py312-none-any.whl": b"multiprocess"}
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


def test_beside_stages_run_meanwhile_on_cores_of_their_own(gpu_check, tmp_path):
    py = sys.executable
    cores = "import os, time; print(sorted(os.sched_getaffinity(0))); time.sleep({})"
    beside = [gpu_check.Stage("first", [py, "-c", cores.format(0)], 30, 1),
              gpu_check.Stage("second", [py, "-c", cores.format(0)], 30, 1)]
    main = gpu_check.Stage("main", [py, "-c", cores.format(1)], 30, 1, beside=beside)
    runner = gpu_check.Runner(tmp_path, tmp_path, budget=30.0, env={})
    started = time.monotonic()
    runner.run(main, reserve=0.5)
    assert time.monotonic() - started < 6
    results = json.loads((tmp_path / "summary.json").read_text())
    assert [results[n]["status"] for n in ("main", "first", "second")] == ["ok"] * 3
    if len(os.sched_getaffinity(0)) > 2:  # (a 2-core machine has no cores left for the main stage)
        assert results["first"]["last_line"] == "[0, 1]"


def test_figures_are_read_from_what_the_stages_printed_and_wrote(gpu_check, tmp_path):
    side = {"side": "hvdtrain compiled", "median_tokens_per_s": 500000.0, "median_sequences_per_s": 488.3,
            "mfu": 0.5, "peak_memory_bytes": 2**33, "error": None}
    compare = {"device_name": "NVIDIA H200", "global_batch": 16, "seq_len": 1024, "peak_tflops": 989.0,
               "sides": [side, dict(side, side="plain compiled", median_tokens_per_s=None, error="OOM")],
               "ratios": [{"side": "hvdtrain compiled", "reference": "plain compiled", "ratio": 1.25}]}
    output = "\n".join([json.dumps(dict(compare, complete=False)), "a warning", json.dumps(dict(compare, complete=True))])
    stage = gpu_check.Stage("compare-gpt2", [], 1, 1, "compare")
    assert gpu_check.parse(stage, output) == {"result": dict(compare, complete=True)}
    cut = gpu_check.parse(stage, output.rsplit("\n", 1)[0])  # killed before its last line
    assert cut["result"]["complete"] is False

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    records = [{"step": 10, "tokens_per_s": 100.0, "mfu": 0.1, "time_forward": 0.5},
               {"step": 20, "tokens_per_s": 400.0, "mfu": 0.4, "time_forward": 0.2},
               {"step": 20, "eval_loss": 7.5},
               {"step": 30, "tokens_per_s": 600.0, "mfu": 0.6, "time_forward": 0.1}]
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    train = gpu_check.Stage("train-gpt2", [], 1, 1, "train", {"run_dir": run_dir, "copy_to": tmp_path / "m.jsonl"})
    figures = gpu_check.parse(train, "")
    assert figures == {"records": 3, "steps": 30, "evals": [{"step": 20, "eval_loss": 7.5}],
                       "mean": {"tokens_per_s": 500.0, "mfu": 0.5, "time_forward": pytest.approx(0.15)}}
    assert (tmp_path / "m.jsonl").read_text() == (run_dir / "metrics.jsonl").read_text()

    table = "\n".join(gpu_check.summary_table({"compare-gpt2": {"status": "timeout", "seconds": 300, **cut},
                                                "train-gpt2": {"status": "ok", "seconds": 60, **figures}}))
    assert "(cut short: the windows it finished)" in table
    assert "500,000 tok/s" in table and "MFU  50.0%" in table and "failed: OOM" in table
    assert "ratio hvdtrain compiled / plain compiled: 1.250" in table
    assert "30 steps, mean after the first interval: 500 tok/s, MFU 50.0%" in table
