"""The soak benchmark (scripts/bench_soak.py), short: a run of 2 real workers with evaluations and
checkpoints leaves no process, temporary entry or half-written folder behind, and opens no file
it does not close. (RSS growth needs its thousands of steps: see docs/benchmarks.md.)"""
import json
import sys

import pytest

from helpers import REPO, run_cmd

pytestmark = pytest.mark.workers


@pytest.mark.deep
def test_a_short_soak_leaves_nothing_behind():
    proc = run_cmd([sys.executable, REPO / "scripts" / "bench_soak.py", "--steps", "200", "--every", "50", "--json"],
                   timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    left = {key: result[key] for key in ("workers_alive_after", "temporary_entries_left", "run_folder_leftovers")}
    assert left == {key: [] for key in left}, left
    assert [row["worker"] for row in result["summary"]] == [0, 1]
    assert all(row["fds_end"] == row["fds_warm"] for row in result["summary"]), result["summary"]
