"""`hvdtrain bench`: each benchmark runs for real on a tiny model and reports sane numbers.

The targets (overhead ratio >= 0.97, scaling efficiency >= 0.85) are benchmark results on a
given machine, not properties the code can guarantee; here only their presence and ranges."""
import json

import pytest

from helpers import hvdtrain, png_size

pytestmark = pytest.mark.workers


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_allreduce_bandwidth_per_size():
    proc = hvdtrain("bench", "allreduce", "-np", "2", "--sizes", "1K,64K", "--repeats", "10", "--json", timeout=120)
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


def test_overhead_ratio(tiny_config):
    proc = hvdtrain("bench", "overhead", tiny_config(), "--steps", "4", "--windows", "2", "--json", timeout=180)
    assert proc.returncode == 0, proc.stderr
    result = last_json(proc.stdout)
    assert len(result["bare_tokens_per_s"]) == len(result["hvdtrain_tokens_per_s"]) == 2
    assert min(result["bare_tokens_per_s"] + result["hvdtrain_tokens_per_s"]) > 0
    assert result["ratio"] == pytest.approx(result["hvdtrain_median"] / result["bare_median"])
    assert result["ratio"] > 0
