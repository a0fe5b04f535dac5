"""Elastic jobs with real horovodrun workers on one machine (Gloo): each worker has a host name
of its own in the discovery output (`localhost` and `127.0.0.1`, as Horovod blacklists per host).
A lost worker or an added one does not stop the run, and the losses and parameters equal a
one-worker run with the same global batch (the last record of a redone step wins)."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import psutil

from helpers import (BIN, REPO, WORKERS, assert_same_losses, assert_same_params, discovery, hvdtrain,
                     load_params, read_metrics, run_cmd, start_cmd, step_losses, steps_logged, train_workers,
                     assert_workers_stop_when_killed)
from hvdtrain.checkpointing import checkpoint
from hvdtrain.launching.relay import LEAVING
from hvdtrain.observe.metrics import FILE_NAME, read_records

pytestmark = pytest.mark.workers
STEPS = 8
ELASTIC = {"train": {"global_batch_size": 8, "max_steps": STEPS}, "elastic": {"commit_every": 2}}
# What a reset's record says of the gradients from then on (hvdtrain.parallel.elastic.gradient_sums)
BITWISE = "summed as the 2 workers did (bitwise the undisturbed run)"
WITHIN_ROUNDING = "summed in another order: equal to the undisturbed run within rounding"


def elastic_run(np: int, tmp_path, config, out, env: dict, *overrides, min_np=1, max_np=2, hosts=None):
    cmd = [BIN / "horovodrun", "-np", np, "--min-np", min_np, "--max-np", max_np, "--host-discovery-script",
           discovery(tmp_path, hosts or ["localhost:1", "127.0.0.1:1"][:np]), "--network-interface", "lo",
           sys.executable, WORKERS / "elastic_worker.py", config, f"out_dir={out}", *overrides]
    proc = run_cmd(cmd, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def start_elastic_launch(tmp_path, config, out, *options, new_session: bool = False) -> subprocess.Popen:
    """`hvdtrain launch --elastic` of 2 workers (one on each discovered host; down to 1 unless
    `options` say otherwise), started (`new_session`: in a process group of its own)."""
    return start_cmd([BIN / "hvdtrain", "launch", "-np", "2", "--elastic", "--min-np", "1", "--max-np", "2",
                      "--host-discovery-script",
                      discovery(tmp_path, ["localhost:1", "127.0.0.1:1"]), "--network-interface", "lo", *options,
                      config, f"out_dir={out}"], new_session=new_session)


def events(out) -> list[dict]:
    return [r for r in read_records(out / FILE_NAME) if "event" in r]


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory):
    from helpers import write_config
    folder = tmp_path_factory.mktemp("one")
    config = write_config(folder / "config.yaml", ELASTIC)
    train_workers(1, config, f"out_dir={folder / 'run'}")
    return config, folder / "run"


@pytest.mark.parametrize("lost", ["127.0.0.1", pytest.param("localhost", marks=pytest.mark.deep)])  # one is rank 0
def test_a_lost_worker_leaves_one_that_finishes_like_a_single_worker(tmp_path, one_worker, lost):
    config, reference = one_worker
    out = tmp_path / "run"
    elastic_run(2, tmp_path, config, out, {"HVDTRAIN_TEST_KILL": f"{lost}:5"})
    assert_same_losses(step_losses(reference), step_losses(out), min_steps=STEPS)
    assert_same_params(load_params(reference, 0), load_params(out, 0), atol=1e-5)
    [reset] = events(out)
    assert reset["event"] == "reset" and reset["old_world_size"] == 2 and reset["world_size"] == 1
    assert reset["step"] == 4 and reset["steps_rolled_back"] == 1  # step 5 done, back to the commit of step 4
    assert [r["world_size"] for r in read_metrics(out)[0]] == [2] * 4 + [1] * 4
    assert checkpoint.newest_intact_checkpoint(out).name == f"step_{STEPS:08d}"  # written by the new rank 0


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """The undisturbed 2-worker run of a step of 4 micro batches: 2 on each worker."""
    from helpers import write_config
    folder = tmp_path_factory.mktemp("two")
    config = write_config(folder / "config.yaml", {**ELASTIC, "train": {"global_batch_size": 16, "max_steps": STEPS}})
    train_workers(2, config, f"out_dir={folder / 'run'}")
    return config, folder / "run"


@pytest.mark.deep
def test_a_job_of_two_that_lost_one_is_bitwise_the_undisturbed_two_worker_run(tmp_path, two_workers):
    """The worker left runs both workers' micro batches, each pair into a gradient of its own,
    and adds the two as their allreduce did: (g0 + g1) + (g2 + g3), not ((g0 + g1) + g2) + g3.
    Bitwise, as it is the same computation: every micro batch's kernels at the same shapes on one
    thread (helpers.OFFLINE sets OMP_NUM_THREADS=1 for both runs), and the same additions."""
    config, reference = two_workers
    out = tmp_path / "run"
    elastic_run(2, tmp_path, config, out, {"HVDTRAIN_TEST_KILL": "127.0.0.1:5"})
    assert [r["world_size"] for r in read_metrics(out)[0]] == [2] * 4 + [1] * 4
    assert step_losses(out) == step_losses(reference)
    assert_same_params(load_params(reference, 0), load_params(out, 0))  # bitwise
    [reset] = events(out)
    assert reset["gradients"] == BITWISE


STAND_IN_CASES = [  # (world, largest world, global batch, micro batch, stands in, the reset's gradients)
    (1, 2, 16, 4, True, BITWISE),  # 2 x 2 micro batches of 4, then 4 on one worker
    (1, 2, 12, 8, True, BITWISE),  # one micro batch of 6 on each of two, two of 6 on one
    # odd: the two took shares of 5 and 4
    (1, 2, 9, 4, False, f"{WITHIN_ROUNDING} (the worker left cannot sum as the 2 did: the global batch 9 is odd)"),
    # 2 micro batches of 6 on each of two, 3 of 8 on one
    (1, 2, 24, 8, False, f"{WITHIN_ROUNDING} (the worker left cannot sum as the 2 did: one worker accumulates 3 "
                         "micro batches where each of two accumulated 2 (train.global_batch_size=24, "
                         "train.micro_batch_size=8))"),
    (2, 2, 16, 4, False, f"{WITHIN_ROUNDING} (a world of 2 sums in another order)"),  # not down to one
    (1, 3, 16, 4, False, f"{WITHIN_ROUNDING} (a world of 1 sums in another order)"),  # had 3: no one order to keep
]


@pytest.mark.parametrize("world, largest, global_batch, micro, stands_in, gradients", STAND_IN_CASES,
                         ids=[f"{c[0]}-of-{c[1]}-{c[2]}-by-{c[3]}" for c in STAND_IN_CASES])
def test_one_worker_stands_in_for_two_only_when_its_micro_batches_are_theirs(tmp_path, world, largest, global_batch,
                                                                            micro, stands_in, gradients):
    """The decision, and what a reset's record and log line say of it (the real runs: the
    bitwise test above, 3 -> 2 workers below)."""
    from hvdtrain.config import load_config
    from hvdtrain.parallel.elastic import gradient_sums, stands_in_for_two
    from helpers import write_config
    cfg = load_config(str(write_config(tmp_path / "c.yaml", {"train": {"global_batch_size": global_batch,
                                                                        "micro_batch_size": micro}})))
    assert stands_in_for_two(cfg, world, largest) is stands_in
    assert gradient_sums(cfg, world, largest) == gradients


@pytest.mark.deep
def test_an_elastic_job_on_this_machine_alone_runs_without_naming_an_interface(tmp_path, tiny_config):
    """Horovod Elastic finds the network interface by testing between two hosts: a job on this
    machine alone waited silently for a second until --elastic-timeout (600 s), unless given
    --network-interface lo. `hvdtrain launch` gives it the loopback interface."""
    out = tmp_path / "run"
    proc = hvdtrain("launch", "--elastic", "-np", "1", "--min-np", "1", "--max-np", "1", "--host-discovery-script",
                    discovery(tmp_path, ["localhost:1"]), tiny_config({"train": {"global_batch_size": 4}}),
                    f"out_dir={out}", "train.max_steps=2", timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert steps_logged(out) == 2


@pytest.mark.deep
def test_a_host_added_to_a_gpt_tiny_run_joins(tmp_path):
    """recipes/gpt-tiny.yaml, 1 worker and then 2: with Horovod's response cache on, the joining
    worker aborted in its first fused allreduce (Gloo: "op.preamble.length <= op.nbytes") at
    every join, so the job never grew. Elastic jobs run without the cache."""
    import os

    import yaml
    from helpers import write_config
    recipe = yaml.safe_load((REPO / "recipes" / "gpt-tiny.yaml").read_text())
    config = write_config(tmp_path / "config.yaml", {
        "data": {"cache_dir": str(tmp_path / "cache")}, "eval": {"every": 0}, "log": {"every": 1, "progress": False},
        "checkpoint": {"every": 0}, "elastic": {"commit_every": 2},
        "train": {"max_steps": 16, "slow_ranks": [0], "slow_seconds": 0.4}}, base=recipe)
    out = tmp_path / "run"
    env = {"HVDTRAIN_TEST_ADD_HOST": f"1:{tmp_path / 'hosts.txt'}:127.0.0.1:1",
           **{k: v for k, v in os.environ.items() if k == "HOROVOD_CACHE_CAPACITY"}}
    proc = elastic_run(1, tmp_path, config, out, env)
    assert "EnforceNotMet" not in proc.stdout + proc.stderr
    assert [(e["old_world_size"], e["world_size"]) for e in events(out)] == [(1, 2)]
    assert sorted(step_losses(out)) == list(range(1, 17))


def test_an_added_host_joins_and_the_run_equals_a_single_worker(tmp_path, one_worker):
    config, reference = one_worker
    out = tmp_path / "run"
    # Slow steps, so that the run is still going when the new worker has started.
    elastic_run(1, tmp_path, config, out, {"HVDTRAIN_TEST_ADD_HOST": f"1:{tmp_path / 'hosts.txt'}:127.0.0.1:1"},
                "train.max_steps=12", "train.slow_ranks=[0]", "train.slow_seconds=0.4")
    losses = step_losses(out)
    assert sorted(losses) == list(range(1, 13))
    sizes = [r["world_size"] for r in read_metrics(out)[0]]
    assert sizes[0] == 1 and sizes[-1] == 2
    [reset] = events(out)
    assert reset["reason"] == "the hosts changed" and (reset["old_world_size"], reset["world_size"]) == (1, 2)
    straight = tmp_path / "straight"
    train_workers(1, config, f"out_dir={straight}", "train.max_steps=12")
    assert_same_losses(step_losses(straight), losses, min_steps=12)
    assert_same_params(load_params(straight, 0), load_params(out, 0), atol=1e-5)


@pytest.mark.deep
def test_a_host_added_before_the_runs_last_commit_leaves_its_checkpoint_and_pause(tmp_path, one_worker):
    """A host appears while a run paused at train.stop_at_step=6 takes its last steps (commits
    only at checkpoints): the checkpoint of step 6 is written and the run stops there, with no
    reset. (The commit's host check used to come first and raise: no checkpoint of step 6, and
    the re-entered run went on to train.max_steps.)"""
    config, _ = one_worker
    out = tmp_path / "run"
    elastic_run(1, tmp_path, config, out, {"HVDTRAIN_TEST_ADD_HOST": f"1:{tmp_path / 'hosts.txt'}:127.0.0.1:1"},
                "train.stop_at_step=6", "elastic.commit_every=100", "train.slow_ranks=[0]", "train.slow_seconds=0.4")
    assert "127.0.0.1:1" in (tmp_path / "hosts.txt").read_text()
    assert [p.name for p in checkpoint.list_checkpoints(out)] == ["step_00000006"]
    assert sorted(step_losses(out)) == list(range(1, 7)) and not events(out)


@pytest.mark.deep
def test_a_host_added_before_a_checkpoints_commit_leaves_the_checkpoint(tmp_path, one_worker):
    """Commits only at the checkpoint of step 4: the host appears before it, so the commit after
    the checkpoint raises and the run goes on with 2 workers; the checkpoint is there."""
    config, reference = one_worker
    out = tmp_path / "run"
    elastic_run(1, tmp_path, config, out, {"HVDTRAIN_TEST_ADD_HOST": f"1:{tmp_path / 'hosts.txt'}:127.0.0.1:1"},
                "checkpoint.every=4", "elastic.commit_every=100", "train.slow_ranks=[0]", "train.slow_seconds=0.4")
    assert [p.name for p in checkpoint.list_checkpoints(out)] == ["step_00000004", f"step_{STEPS:08d}"]
    [reset] = events(out)
    assert (reset["step"], reset["reason"], reset["world_size"]) == (4, "the hosts changed", 2)
    assert_same_losses(step_losses(reference), step_losses(out), min_steps=STEPS)


@pytest.mark.deep
def test_an_elastic_job_resumes_from_its_checkpoint_like_a_plain_run(tmp_path, one_worker):
    config, reference = one_worker
    out = tmp_path / "run"
    elastic_run(2, tmp_path, config, out, {}, "train.stop_at_step=4")
    assert "resuming at step 4" in elastic_run(2, tmp_path, config, out, {}).stdout
    assert_same_losses(step_losses(reference), step_losses(out), min_steps=STEPS)
    assert_same_params(load_params(reference, 0), load_params(out, 0), atol=1e-5)


@pytest.mark.deep
def test_a_lost_worker_whose_world_does_not_divide_the_global_batch_goes_on(tmp_path, tiny_config):
    """3 -> 2 workers at global batch 9, micro batch 3: shares of 5 and 4 samples in 2 micro
    batches each (3 + 3 + 3 before); the losses equal a one-worker run (3 micro batches of 3)."""
    config = tiny_config({**ELASTIC, "train": {**ELASTIC["train"], "global_batch_size": 9,
                                               "micro_batch_size": 3}})
    reference, out = tmp_path / "one", tmp_path / "run"
    train_workers(1, config, f"out_dir={reference}")
    proc = elastic_run(3, tmp_path, config, out, {"HVDTRAIN_TEST_KILL": "127.0.0.1:5"}, max_np=3,
                       hosts=["localhost:2", "127.0.0.1:1"])
    assert_same_losses(step_losses(reference), step_losses(out), min_steps=STEPS)
    # 1e-4: the key bias's gradient is rounding noise, scaled up by Adam (see test_uneven_batch.py)
    assert_same_params(load_params(reference, 0), load_params(out, 0), atol=1e-4)
    [reset] = events(out)
    assert (reset["old_world_size"], reset["world_size"]) == (3, 2)
    assert reset["gradients"] == f"{WITHIN_ROUNDING} (a world of 2 sums in another order)"
    assert f"gradients {WITHIN_ROUNDING} (a world of 2 sums in another order))" in proc.stdout + proc.stderr  # the log
    assert [(r["world_size"], r["grad_accum"]) for r in read_metrics(out)[0]] == [(3, 1)] * 4 + [(2, 2)] * 4
    assert ("2 data-parallel workers x 5 or 4 samples in 2 micro batches of at most 3 (uneven: 9 is not a multiple "
            "of micro batch 3 x 2 workers) = global batch 9") in proc.stdout


@pytest.mark.deep
def test_below_min_np_too_long_stops_clearly_and_the_checkpoint_resumes(tmp_path, tiny_config):
    """`hvdtrain launch --elastic` with --min-np 2: one worker is SIGKILLed from outside; after
    --elastic-timeout the job stops with a clear line, and the same command resumes."""
    config = tiny_config({**ELASTIC, "train": {**ELASTIC["train"], "max_steps": 40, "slow_ranks": [0, 1],
                                               "slow_seconds": 0.2}, "checkpoint": {"every": 2}})
    out = tmp_path / "run"
    proc = start_elastic_launch(tmp_path, config, out, "--min-np", "2", "--elastic-timeout", "5")
    deadline = time.time() + 120
    while time.time() < deadline and not checkpoint.list_checkpoints(out):
        time.sleep(0.5)
    assert checkpoint.list_checkpoints(out), "no checkpoint within 2 minutes"
    signal_worker_on_host(out, "127.0.0.1", signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "fewer than --min-np 2 workers for longer than --elastic-timeout (5 s)" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr
    newest = checkpoint.newest_intact_checkpoint(out)
    assert newest is not None and checkpoint.find_problem(newest) is None
    done = checkpoint.read_state(newest)["step"]
    resumed = hvdtrain("launch", "-np", "1", config, f"out_dir={out}", "train.slow_ranks=[]", timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming at step {done}" in resumed.stdout
    assert checkpoint.newest_intact_checkpoint(out).name == "step_00000040"


def signal_worker_on_host(out_dir, host: str, signum: int) -> int:
    """Send `signum` to the worker of this run that horovodrun started for `host`
    (HOROVOD_HOSTNAME); its pid."""
    for pid in os.listdir("/proc"):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().decode()
            environ = open(f"/proc/{pid}/environ", "rb").read().decode().split("\0")
        except (OSError, ValueError):
            continue
        if f"out_dir={out_dir}" in cmdline and "hvdtrain.cli\0train" in cmdline and f"HOROVOD_HOSTNAME={host}" in environ:
            os.kill(int(pid), signum)
            return int(pid)
    raise AssertionError(f"no worker on {host} found")


# ---------------------------------------------------------------- stalled workers

STALL_TIMEOUT = 4  # seconds: a tiny step takes milliseconds


@pytest.mark.deep
def test_a_stopped_worker_is_named_and_removed_and_the_other_finishes(tmp_path, tiny_config):
    """SIGSTOP to the worker on 127.0.0.1 mid-run: once it has been stopped for the stall
    timeout, its stop sentinel names it (rank and host) in one line and ends it; Horovod's
    driver blacklists the host, and the other worker resets to its last commit and finishes
    alone. (Before, an elastic job had no stall watchdog: the other worker waited for ever.)"""
    config = tiny_config({**ELASTIC, "train": {**ELASTIC["train"], "max_steps": 30, "slow_ranks": [0, 1],
                                               "slow_seconds": 0.1}, "horovod": {"stall_timeout_s": STALL_TIMEOUT}})
    out = tmp_path / "run"
    launch = start_elastic_launch(tmp_path, config, out)
    stopped = None
    try:
        deadline = time.monotonic() + 120
        while steps_logged(out) < 4:
            assert launch.poll() is None and time.monotonic() < deadline, launch.communicate()
            time.sleep(0.2)
        stopped = signal_worker_on_host(out, "127.0.0.1", signal.SIGSTOP)
        stdout, stderr = launch.communicate(timeout=180)
    finally:
        launch.kill()
        if stopped is not None and psutil.pid_exists(stopped):
            os.kill(stopped, signal.SIGKILL)
    assert launch.returncode == 0, stderr[-3000:]
    [line] = [line for line in stdout.splitlines() + stderr.splitlines() if LEAVING in line]
    assert re.search(rf"{LEAVING}rank [01] on host 127\.0\.0\.1 is stopped: it did not run for [4-9] s "
                     rf"\(horovod\.stall_timeout_s={STALL_TIMEOUT}\); ended, the others go on without it$", line), line
    [reset] = events(out)
    assert (reset["old_world_size"], reset["world_size"]) == (2, 1)
    assert sorted(step_losses(out)) == list(range(1, 31))
    assert checkpoint.newest_intact_checkpoint(out).name == "step_00000030"


@pytest.mark.deep
def test_a_stuck_worker_says_where_and_leaves_and_the_other_finishes_like_a_single_worker(tmp_path, one_worker):
    """train.slow_ranks makes rank 1 sleep in its first step (3x the stall timeout): its watchdog
    says where it is stuck, naming its rank and host, and it exits; rank 0, which waited for it
    in a collective, goes on waiting until Horovod resets it, and finishes alone."""
    config, reference = one_worker
    out = tmp_path / "run"
    proc = elastic_run(2, tmp_path, config, out, {}, "train.slow_ranks=[1]", "train.slow_seconds=600",
                       f"horovod.stall_timeout_s={STALL_TIMEOUT}")
    said = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines() if LEAVING in line]
    assert len(said) == 1, proc.stderr[-3000:]
    assert re.search(rf"{LEAVING}rank 1 on host \S+ is stuck: no step finished in {3 * STALL_TIMEOUT} s after step 0 "
                     rf"\(horovod\.stall_timeout_s={STALL_TIMEOUT}\); in run_steps \(hvdtrain/training/train\.py:\d+\)$",
                     said[0]), said[0]
    [reset] = events(out)
    assert (reset["old_world_size"], reset["world_size"], reset["step"]) == (2, 1, 0)
    assert_same_losses(step_losses(reference), step_losses(out), min_steps=STEPS)
    assert_same_params(load_params(reference, 0), load_params(out, 0), atol=1e-5)


@pytest.mark.deep
@pytest.mark.workers
def test_the_workers_of_an_elastic_launch_killed_with_its_process_group_stop_by_themselves(tmp_path, tiny_config):
    """`kill -9` of the launcher's process group (the fault campaign's finding: the guard died
    with it, and the elastic workers trained on to the end, exporting into the run folder). The
    guard's TERM reaches the workers through horovodrun's elastic driver and the middleman process
    of each worker, which kills it 5 s later: well within the minute allowed on a loaded machine."""
    out = tmp_path / "run"
    config = tiny_config({**ELASTIC, "train": {**ELASTIC["train"], "max_steps": 500, "slow_ranks": [0, 1],
                                               "slow_seconds": 0.2}})
    launcher = start_elastic_launch(tmp_path, config, out, new_session=True)
    assert_workers_stop_when_killed(launcher, out, group=True, within_s=60)
