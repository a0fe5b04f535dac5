"""`hvdtrain tune` (hvdtrain/tools/tune.py): real trials of gpt-tiny on 2 Gloo workers, kept within
the budget, interrupted and continued; the winner written as a recipe that `hvdtrain launch` runs;
a trial that fails recorded as such; bad input one line and nothing written."""
import json
import signal
import subprocess
import time

import yaml

import pytest

from helpers import BIN, TINY, hvdtrain, start_cmd, write_config

from hvdtrain.config import load_config
from hvdtrain.tools import tune

RECIPE = "recipes/gpt-tiny.yaml"


def records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()[1:]]


def worker_processes(marker: str) -> str:
    return subprocess.run(["pgrep", "-af", f"_tune-worker.*{marker}"], capture_output=True, text=True).stdout


@pytest.mark.workers
def test_an_interrupted_tune_continues_keeps_its_budget_and_writes_a_recipe_launch_runs(tmp_path):
    """Interrupted (Ctrl-C) during its second trial: exit 130, the first trial recorded and no
    worker left running. The same command continues after it and ends within the budget, with the
    table, every layout tried once, the recipe's own layout first; the predictions after the
    first trial follow the measured speed (the first, at the plan's assumed H100 MFU, is off by
    orders of magnitude on a CPU); the winner is at least as fast as the recipe's own layout and
    its recipe runs."""
    out = tmp_path / "tune"
    args = [BIN / "hvdtrain", "tune", RECIPE, "--gpus", "2", "--budget", "1.2", "--steps", "3", "--out", out]
    first = start_cmd(args)
    deadline = time.monotonic() + 240
    while not (out / "trials.jsonl").is_file() or len(records(out)) < 1:
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.2)
    time.sleep(2)  # into the second trial
    first.send_signal(signal.SIGINT)
    _, err = first.communicate(timeout=60)
    assert first.returncode == 130, err[-3000:]
    assert "tune interrupted: 1 trials recorded" in err
    assert worker_processes(str(out)) == ""
    recorded = records(out)
    assert len(recorded) == 1 and recorded[0]["status"] == "ok"

    started = time.monotonic()
    second = hvdtrain(*args[1:], timeout=300)
    took = time.monotonic() - started
    assert second.returncode == 0, second.stderr[-3000:]
    assert "continuing after the 1 trials recorded" in second.stdout
    trials = records(out)
    assert trials[0] == recorded[0] and len(trials) >= 3
    assert all(t["status"] == "ok" for t in trials), trials
    assert len({json.dumps(t["layout"]) for t in trials}) == len(trials)
    # The budget counts both runs' trials: the second run keeps to what the first left.
    assert sum(t["seconds"] for t in trials) <= 1.2 * 60 + 5 and took <= 1.2 * 60 - recorded[0]["seconds"] + 15
    own = tune.layout_of(load_config(RECIPE))
    assert trials[0]["layout"] == own
    assert trials[0]["predicted_s"] < trials[0]["step_s"] / 100
    for t in trials[1:]:
        assert 1 / 3 < t["predicted_s"] / t["step_s"] < 3, t
    table = second.stdout.split("Ranked by measured tokens/s", 1)[1]
    assert "(recipe)" in table and "fastest:" in table

    best = yaml.safe_load((out / "best.yaml").read_text())
    winner = max(trials, key=lambda t: t["tokens_per_s"])
    assert winner["tokens_per_s"] >= trials[0]["tokens_per_s"]
    cfg = load_config(str(out / "best.yaml"))
    assert tune.layout_of(cfg) == winner["layout"] and best["base"].endswith("recipes/gpt-tiny.yaml")
    run = hvdtrain("launch", "-np", "2", out / "best.yaml", "train.max_steps=2", f"out_dir={tmp_path / 'run'}",
                   "eval.every=0", "checkpoint.every=0", timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


def tune_where_rank_one(tmp_path, shard: str, action: str, *options) -> tuple[list[dict], str, object]:
    """`hvdtrain tune` of gpt-tiny with parallel.shard=`shard` (0.8 minutes, 2 steps), whose own
    layout (that level at micro batch 8) runs the Python statement `action` on rank 1 in place of
    its training (a sitecustomize on the workers' path wraps tune's train_sampling): the trials,
    tune's output and its folder. The budget leaves a second trial (expected to take tune's
    TRIAL_START_S, 20 s) room after a first that takes up to 28 s: 7 s on a quiet 2-core machine,
    where 0.6 minutes, leaving 16 s, once left no room in CI."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os, time\n"
        "if os.environ.get('HOROVOD_RANK') == '1':\n"
        "    import torch\n"
        "    from hvdtrain.tools import tune\n"
        "    original = tune.train_sampling\n"
        "    def sampling(cfg, sample):\n"
        f"        if cfg.parallel.shard == {shard!r} and cfg.train.micro_batch_size == 8:\n"
        f"            {action}\n"
        "        return original(cfg, sample)\n"
        "    tune.train_sampling = sampling\n")
    out = tmp_path / "tune"
    proc = hvdtrain("tune", RECIPE, f"parallel.shard={shard}", "--gpus", "2", "--budget", "0.8", "--steps", "2",
                    "--out", out, *options, env={"PYTHONPATH": str(tmp_path)}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return records(out), proc.stdout, out


@pytest.mark.deep
@pytest.mark.workers
def test_a_trial_that_runs_out_of_memory_is_recorded_and_tune_goes_on(tmp_path):
    """The recipe's own layout runs out of memory on rank 1 (torch's OutOfMemoryError): recorded as
    out of memory with its error, nothing of it left running; the other trials run, and the
    winner's recipe has no comparison with the recipe's layout, which gave no figures."""
    trials, stdout, out = tune_where_rank_one(
        tmp_path, "optimizer", "raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')")
    assert trials[0]["status"] == "out of memory", trials[0]
    assert "CUDA out of memory" in trials[0]["error"]
    assert len(trials) >= 2 and all(t["status"] == "ok" for t in trials[1:])
    assert worker_processes(str(out)) == ""
    assert "out of memory: torch.OutOfMemoryError: CUDA out of memory" in stdout
    assert "the recipe's own layout" not in (out / "best.yaml").read_text()


@pytest.mark.deep
@pytest.mark.workers
def test_a_trial_that_stalls_is_ended_at_its_limit_and_recorded(tmp_path):
    """The recipe's own layout never reaches its first step on rank 1: ended at --trial-limit as
    stalled, nothing of it left running, and the next trial runs. (A healthy trial takes 10-11 s
    on a quiet 2-core machine: the limit leaves it room on a slower one, the budget room for it.)"""
    trials, _, out = tune_where_rank_one(tmp_path, "gradients", "time.sleep(3600)", "--trial-limit", "25",
                                         "--budget", "1.0")
    assert trials[0]["status"] == "stalled" and trials[0]["error"] == "no result within its limit of 25 s"
    assert 25 <= trials[0]["seconds"] < 45
    assert len(trials) >= 2 and trials[1]["status"] == "ok"
    assert worker_processes(str(out)) == ""


def test_a_budget_too_small_for_one_trial_is_one_line_and_nothing_is_written(tmp_path):
    out = tmp_path / "tune"
    proc = hvdtrain("tune", RECIPE, "--gpus", "2", "--budget", "0.1", "--out", out)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"hvdtrain: error: --budget: 0.1 minutes is less than one trial is expected to take "
        f"({tune.TRIAL_START_S:.0f} s); give at least 1"], proc.stderr
    assert not out.exists()


def test_no_layout_that_fits_is_one_line_and_nothing_is_written(tmp_path):
    out = tmp_path / "tune"
    proc = hvdtrain("tune", "recipes/llama-8b.yaml", "--gpus", "2", "--gpu-memory", "20", "--out", out)
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("hvdtrain: error: --gpus 2: no layout of recipes/llama-8b.yaml fits 20 GiB per GPU")
    assert not out.exists()


def test_the_records_of_another_tune_are_not_touched(tmp_path):
    out = tmp_path / "tune"
    out.mkdir()
    (out / "trials.jsonl").write_text(json.dumps({"tune": {"config": "other.yaml"}}) + "\n")
    proc = hvdtrain("tune", write_config(tmp_path / "c.yaml", TINY), "--gpus", "2", "--out", out)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "records another tune" in proc.stderr
    assert (out / "trials.jsonl").read_text() == json.dumps({"tune": {"config": "other.yaml"}}) + "\n"


def test_the_candidates_are_the_layouts_the_plan_lets_fit_the_recipe_s_own_first():
    """gpt-tiny (2 layers, 4 heads) on 2 workers: 1 stage x 2 copies at every sharding level, 2
    stages (gpipe or 1f1b, even or auto; interleaving needs 4 layers) without sharding, and the
    layers split over both (t=2, one copy: unsharded); micro batch 4, 8, 16; checkpointing off
    and on; every one distinct and accepted by the config."""
    machine = tune.Machine(2, "H100", 0.9 * 80 * 2 ** 30, 100.0, 989.0)
    found = tune.fitting(RECIPE, [], machine)
    assert found[0].layout == tune.layout_of(load_config(RECIPE))
    assert len(found) == 3 * 2 * (4 + 2 * 2 + 1) and all(c.fits for c in found)
    split = [c.layout for c in found if c.layout["parallel.tensor_parallel"] == 2]
    assert len(split) == 3 * 2 and {(s["parallel.pipeline_stages"], s["parallel.shard"]) for s in split} == {(1, "none")}
    assert tune.layout_name(split[0]).startswith("t=2, 1 stage, micro")
    assert {c.layout["parallel.schedule"] for c in found if c.stages == 2} == {"gpipe", "1f1b"}
    assert {c.layout["parallel.shard"] for c in found if c.stages == 2} == {"none"}
    assert {c.layout["parallel.expert_parallel"] for c in found} == {1}


def test_a_mixture_of_experts_is_also_tried_with_its_experts_split_over_the_copies():
    """mixtral-tiny (4 experts, 2 layers) on 2 workers: the layouts above at e=1, and at e=2 one
    stage over the two copies at every sharding level, each named with its e."""
    machine = tune.Machine(2, "H100", 0.9 * 80 * 2 ** 30, 100.0, 989.0)
    found = tune.fitting("recipes/mixtral-tiny.yaml", [], machine)
    split = [c.layout for c in found if c.layout["parallel.expert_parallel"] == 2]
    assert len(found) == 3 * 2 * (4 + 2 * 2) + len(split) and all(c.fits for c in found)
    assert len(split) == 3 * 2 * 4 and {(s["parallel.pipeline_stages"], s["parallel.shard"]) for s in split} == {
        (1, "none"), (1, "optimizer"), (1, "gradients"), (1, "full")}
    assert tune.layout_name(split[0]).startswith("e=2, 1 stage, micro")


