"""`hvdtrain bench memory` (hvdtrain/tools/bench_memory.py): one real run at the smallest sizes, whose
optimizer state is the plan's to the byte, halved by sharding over 2 workers."""
import json

import pytest

from helpers import TINY, hvdtrain, write_config


@pytest.mark.workers
def test_sharding_over_two_workers_halves_the_optimizer_state_the_plan_counts(tmp_path):
    config = write_config(tmp_path / "config.yaml", {"model": {"d_model": 64}})
    proc = hvdtrain("bench", "memory", config, "--copies", "2", "--steps", "1", "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["sharded"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])["rows"]}
    for row in rows.values():
        assert row["copies"] == 2 and row["optimizer_bytes"] == pytest.approx(row["predicted"]["optimizer_bytes"],
                                                                              rel=0.01)
        assert row["peak_bytes"] > row["optimizer_bytes"]
    assert rows[True]["optimizer_bytes"] == pytest.approx(rows[False]["optimizer_bytes"] / 2, rel=0.01)


def test_bad_copies_are_one_line(tmp_path):
    proc = hvdtrain("bench", "memory", write_config(tmp_path / "c.yaml", TINY), "--copies", "0")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "hvdtrain: error: --copies: expected comma-separated integers >= 1, got '0'"], proc.stderr
