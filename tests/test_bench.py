"""`hvdtrain bench`: each benchmark runs for real on a tiny model and reports sane numbers.

The targets (hvdtrain/plain ratio >= 0.97, step breakdown on/off >= 0.99, scaling efficiency
>= 0.85) are benchmark results on a given machine, not properties the code can guarantee; here
only their presence and ranges."""
import json

import pytest

from helpers import hvdtrain, png_size

pytestmark = pytest.mark.workers


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_allreduce_bandwidth_per_size():
    proc = hvdtrain("bench", "allreduce", "-np", "2", "--gloo", "--sizes", "1K,64K", "--repeats", "10", "--json",
                    timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = last_json(proc.stdout)
    assert result["np"] == 2 and result["backend"].startswith("Gloo")
    assert [r["bytes"] for r in result["rows"]] == [1024, 65536]
    for r in result["rows"]:
        assert r["time_s"] > 0 and r["algbw_gbs"] > 0
        assert r["algbw_gbs"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9)
        assert r["busbw_gbs"] == pytest.approx(r["algbw_gbs"])  # 2(N-1)/N = 1 for N = 2


def test_allreduce_rejects_a_bad_size():
    proc = hvdtrain("bench", "allreduce", "--sizes", "1K,6", timeout=60)
    assert proc.returncode == 2 and "--sizes: '6'" in proc.stderr


@pytest.mark.deep
def test_scaling_table(tmp_path, tiny_config):
    out = tmp_path / "bench"
    proc = hvdtrain("bench", "scaling", tiny_config(), "--np", "1,2", "--steps", "6", "--log-every", "2",
                    "--repeats", "1", "--out", out, timeout=240)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["workers", "tokens/s"])
    rows = {int(line.split()[0]): line.split() for line in lines[header + 1:header + 3]}
    assert sorted(rows) == [1, 2]
    assert float(rows[1][3]) == 1.0  # efficiency is relative to the single worker
    assert 0 < float(rows[2][3]) < 1.5
    for cells in rows.values():
        assert float(cells[1].replace(",", "")) > 0
    width, height = png_size(out / "scaling.png")
    assert width > 300 and height > 200


def sides_by_label(result: dict) -> dict:
    return {r["side"]: r for r in result["sides"]}


def test_compare_hvdtrain_with_the_plain_loop(tiny_config):
    """Both loops on the same model and batches, alternating windows; tokens/s, sequences/s,
    MFU (against a given peak: a CPU has none), peak memory and the ratio of the medians."""
    proc = hvdtrain("bench", "compare", tiny_config(), "log.peak_tflops=0.5", "--steps", "3", "--windows", "2",
                    "--json", timeout=240)
    assert proc.returncode == 0, proc.stderr
    result = last_json(proc.stdout)
    assert result["complete"]
    # After each window a line with the results so far: a run stopped by a time limit keeps them.
    partial = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")][:-1]
    assert [p["complete"] for p in partial] == [False] * 4
    assert [len(p["sides"][0]["tokens_per_s"]) for p in partial] == [1, 1, 1, 2]  # hvdtrain, plain; plain, hvdtrain
    sides = sides_by_label(result)
    assert list(sides) == ["hvdtrain eager", "plain eager"]  # a CPU compares eager only by default
    for side in sides.values():
        assert len(side["tokens_per_s"]) == 2 and min(side["tokens_per_s"]) > 0
        assert side["median_sequences_per_s"] == pytest.approx(side["median_tokens_per_s"] / 16)
        assert side["mfu"] == pytest.approx(side["median_tokens_per_s"] * result["flops_per_token"] / 0.5e12)
        assert side["peak_memory_bytes"] >= 0
    assert result["peak_source"] == "log.peak_tflops" and result["flops_per_token"] > 0
    assert set(sides["hvdtrain eager"]["breakdown"]) >= {"time_data", "time_forward", "time_step"}
    [ratio] = result["ratios"]
    assert (ratio["side"], ratio["reference"]) == ("hvdtrain eager", "plain eager")
    assert ratio["ratio"] == pytest.approx(sides["hvdtrain eager"]["median_tokens_per_s"] /
                                           sides["plain eager"]["median_tokens_per_s"])
    assert len(ratio["pair_ratios"]) == 2


@pytest.mark.deep
def test_compare_variations_of_hvdtrain_bert(tiny_config):
    """--vary adds hvdtrain sides (a config key, an environment switch); each is compared with
    hvdtrain as configured: for log.step_breakdown=false that ratio is the breakdown's cost."""
    proc = hvdtrain("bench", "compare", tiny_config({"model": {"arch": "bert"}}), "--loops", "hvdtrain",
                    "--vary", "log.step_breakdown=false", "--vary", "env:HVDTRAIN_LOSS=logits",
                    "--steps", "2", "--windows", "1", "--json", timeout=240)
    assert proc.returncode == 0, proc.stderr
    result = last_json(proc.stdout)
    sides = sides_by_label(result)
    assert list(sides) == ["hvdtrain eager", "hvdtrain eager log.step_breakdown=false",
                           "hvdtrain eager env:HVDTRAIN_LOSS=logits"]
    assert sides["hvdtrain eager log.step_breakdown=false"]["breakdown"] == {}  # none logged with it off
    assert sides["hvdtrain eager"]["breakdown"]["time_forward"] > 0
    assert result["peak_tflops"] is None and all(s["mfu"] is None for s in sides.values())
    assert [(r["side"], r["reference"]) for r in result["ratios"]] == [
        ("hvdtrain eager", "hvdtrain eager log.step_breakdown=false"),
        ("hvdtrain eager", "hvdtrain eager env:HVDTRAIN_LOSS=logits")]


def test_compare_reports_a_failing_side_and_measures_the_others(tiny_config):
    proc = hvdtrain("bench", "compare", tiny_config(), "--loops", "hvdtrain", "--vary", "data.synthetic_samples=2",
                    "--steps", "2", "--windows", "1", "--json", timeout=180)
    assert proc.returncode == 1
    sides = sides_by_label(last_json(proc.stdout))
    assert sides["hvdtrain eager"]["error"] is None and sides["hvdtrain eager"]["median_tokens_per_s"] > 0
    failed = sides["hvdtrain eager data.synthetic_samples=2"]
    assert failed["tokens_per_s"] == [] and failed["error"].startswith("UserError: the global batch")
    assert "hvdtrain eager data.synthetic_samples=2 failed: UserError" in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--vary", "train.nope=1"], "unknown config key 'train.nope'"),
    (["--vary", "env:HVDTRAIN_LOSS=fast"], "HVDTRAIN_LOSS takes chunked, compiled, logits"),
    (["--loops", "plain", "--vary", "log.step_breakdown=false"], "--vary changes the hvdtrain loop"),
    (["--compile", "maybe"], "--compile: expected off, on or off,on"),
])
def test_compare_rejects_bad_arguments_in_one_line(tiny_config, args, message):
    proc = hvdtrain("bench", "compare", tiny_config(), *args, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.deep
def test_overhead_is_compare_of_the_eager_loops(tiny_config):
    proc = hvdtrain("bench", "overhead", tiny_config(), "--steps", "3", "--windows", "1", timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "ratio hvdtrain eager / plain eager: " in proc.stdout
