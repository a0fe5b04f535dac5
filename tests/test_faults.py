"""The fault campaign (scripts/bench_faults.py), short: a real `hvdtrain launch` hit by a handful of
faults of every kind, relaunched after each, ends like an uninterrupted run and loses nothing.
(The campaigns of docs/faults.md, 30 faults per layout, take many minutes each.)"""
import json
import sys

import pytest

from helpers import REPO, run_cmd

pytestmark = pytest.mark.workers


@pytest.mark.deep
def test_a_short_fault_campaign_loses_nothing(tmp_path):
    # The kinds of the first campaigns, whose seed 7 draws each of them (kill-in-rewrite needs two
    # checkpoints first: the README's campaigns include it).
    kinds = "kill-worker,kill-all,kill-launcher,kill-in-write,preempt,write-failure,damage"
    proc = run_cmd([sys.executable, REPO / "scripts" / "bench_faults.py", "--faults", "8", "--seed", "7",
                    "--kinds", kinds, "--keep", tmp_path, "--json"], timeout=1500)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert result["completed"] and result["findings"] == []
    assert len(result["faults_injected"]) == 7, result["faults_injected"]  # seed 7 draws every kind
    assert result["steps_lost"] == [] and result["steps_with_loss_off"] == [] and result["params_equal"]
    assert result["duplicate_step_records"] == 0 and result["partial_lines"] == 0
    assert result["temporary_folders_left"] == [] and result["workers_left"] == 0 and result["export_loads"]
