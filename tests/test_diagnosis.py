"""Diagnosis with real workers: per-rank profiler traces with the named step phases, the
Horovod timeline, a step-time breakdown that adds up, and a straggler named by the warning."""
import json

import pytest

from helpers import read_metrics, train_workers
from hvdtrain.observe.metrics import PHASES

pytestmark = pytest.mark.workers

PROFILED_STEPS = 4  # wait 1 + warmup 1 + active 2


def test_profiled_run_with_a_slow_rank(tmp_path, tiny_config):
    config = tiny_config({"train": {"max_steps": 10, "slow_ranks": [1], "slow_seconds": 0.15},
                          "profile": {"enabled": True, "ranks": [0, 1], "wait": 1, "warmup": 1, "active": 2},
                          "log": {"every": 2}})
    proc = train_workers(2, config, f"out_dir={tmp_path}")

    # traces per profiled rank, with our named ranges, and the operator table
    for rank in (0, 1):
        trace = json.loads((tmp_path / "profile" / f"trace_rank{rank}.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        step_phases = set(PHASES) - {"pipeline"}  # the phases of a step without pipeline stages
        assert step_phases <= names, step_phases - names
        table = (tmp_path / "profile" / f"ops_rank{rank}.txt").read_text()
        assert "Self CPU" in table and "aten::" in table
    timeline = (tmp_path / "profile" / "horovod_timeline.json").read_text()
    assert "ALLREDUCE" in timeline
    assert "Self CPU" in proc.stdout  # rank 0 prints the table

    # the straggler is named
    assert "warning: rank 1 is slow" in proc.stdout
    records = read_metrics(tmp_path)[0]
    assert all(r["slowest_rank"] == 1 for r in records)
    # rank 1's sleep shows as its data time, and as allreduce waiting time on rank 0
    last = records[-1]
    assert last["ranks"]["data"][1] > 0.14 and last["ranks"]["data"][0] < 0.05
    assert last["ranks"]["allreduce"][0] > 0.1

    # after profiling: the phases add up to the measured step time within 5%, on every rank
    for r in (r for r in records if r["step"] > PROFILED_STEPS):
        for rank in (0, 1):
            phases = sum(r["ranks"][p][rank] for p in PHASES)
            assert phases == pytest.approx(r["ranks"]["step"][rank], rel=0.05), (r["step"], rank)
        assert sum(r[f"time_{p}"] for p in PHASES) == pytest.approx(r["time_step"], rel=0.05)
