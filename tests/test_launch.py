"""`hvdtrain launch`: the user sees the first real error of the first failing worker, once.

The first tests feed the relay (hvdtrain/launching/relay.py) horovodrun and mpirun output as recorded on
this machine (shortened; paths kept), so each kind of failure is checked in milliseconds. The
tests marked `workers` then make a real worker fail in a real run (tests/workers/
failure_injection), under Gloo and MPI, and start horovodrun where it cannot start workers.
"""
import io
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from helpers import (BIN, assert_one_clean_stream, assert_workers_stop_when_killed, discovery, horovodrun, hvdtrain, inject, run_on_terminal,
                     training_workers)
from hvdtrain.errors import UserError
from hvdtrain.launching import launch
from hvdtrain.launching.relay import LEAVING, Relay
from hvdtrain.observe.progress import Progress, parse_progress_line

# ---------------------------------------------------------------- recorded output

FRAMES = """\
Traceback (most recent call last):
  File "/work/main/hvdtrain/cli.py", line 94, in main
    return args.func(args)
           ^^^^^^^^^^^^^^^
  File "/work/main/hvdtrain/training/train.py", line 193, in train
    loss = torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX,
"""
REAL_ERROR = FRAMES + "RuntimeError: injected failure in the middle of training\n"
SHUT_DOWN = ("Horovod has been shut down. This was caused by an exception on one of the ranks or an attempt to "
             "allreduce, allgather or broadcast a tensor after one of the ranks finished execution.")
ECHO = (FRAMES + f"RuntimeError: {SHUT_DOWN}\n\nDuring handling of the above exception, another exception "
        f"occurred:\n\n" + FRAMES + f"horovod.common.exceptions.HorovodInternalError: {SHUT_DOWN}\n")
HOROVODRUN_WORKERS_FAILED = """\
Traceback (most recent call last):
  File "/work/main/.venv/bin/horovodrun", line 6, in <module>
    sys.exit(run_commandline())
  File "/work/main/.venv/lib/python3.11/site-packages/horovod/runner/gloo_run.py", line 284, in launch_gloo
    raise RuntimeError('Horovod detected that one or more processes exited with non-zero '
RuntimeError: Horovod detected that one or more processes exited with non-zero status, thus causing the job to be terminated. The first process to do so was:
Process name: {rank}
Exit code: {code}

"""
MPIRUN_WORKER_FAILED = """\
--------------------------------------------------------------------------
Primary job  terminated normally, but 1 process returned
a non-zero exit code. Per user-direction, the job has been aborted.
--------------------------------------------------------------------------
--------------------------------------------------------------------------
mpirun detected that one or more processes exited with non-zero status, thus causing
the job to be terminated. The first process to do so was:

  Process name: [[18702,1],0]
  Exit code:    1
--------------------------------------------------------------------------
"""


def tagged(prefix: str, text: str) -> str:
    return "".join(prefix + line for line in text.splitlines(keepends=True))


def relay(output: str, returncode: int, hosts: list[str] = (), world_size: int = 2) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `hvdtrain launch` for this horovodrun output."""
    out, err = io.StringIO(), io.StringIO()
    r = Relay(list(hosts), world_size, out=out, err=err)
    for line in output.splitlines(keepends=True):
        r.feed(line)
    return r.finish(returncode), out.getvalue(), err.getvalue()


def test_a_traceback_on_one_worker_is_shown_once_without_the_echoes_of_the_others():
    output = ("[0]<stdout>:step 0: eval loss 4.8694\n" + tagged("[1]<stderr>:", REAL_ERROR) +
              tagged("[0]<stderr>:", ECHO) + "[0]<stderr>:Terminated\n" +
              "Process 0 exit with status code 1.\nTerminating remaining workers after failure of Process 0.\n"
              "Process 1 exit with status code 1.\n" + HOROVODRUN_WORKERS_FAILED.format(rank=0, code=1))
    code, out, err = relay(output, 1)
    assert code == 1
    assert out == "step 0: eval loss 4.8694\n"  # rank 0's output passes through, untagged
    assert err == "hvdtrain: worker 1 failed:\n" + REAL_ERROR


def test_the_real_error_wins_even_when_an_echo_arrives_first():
    output = tagged("[1,0]<stderr>:", ECHO) + tagged("[1,1]<stderr>:", REAL_ERROR) + MPIRUN_WORKER_FAILED
    code, _, err = relay(output, 1, hosts=["node1", "node2"])
    assert (code, err) == (1, "hvdtrain: worker 1 on host node2 failed:\n" + REAL_ERROR)


def test_pieces_that_mpirun_tagged_separately_are_joined_into_lines():
    """mpirun --tag-output tags each piece a worker writes, not each line."""
    output = ("[1,1]<stderr>:Traceback (most recent call last):\n[1,1]<stderr>:  File \"x.py\", line 1\n"
              "[1,1]<stderr>:    ^^^^[1,1]<stderr>:^^^^\n[1,1]<stderr>:RuntimeError: boom\n"
              "[1,0]<stdout>:step 1: loss 4.5[1,0]<stdout>:\n" + MPIRUN_WORKER_FAILED)
    code, out, err = relay(output, 1)
    assert out == "step 1: loss 4.5\n"
    assert err == "hvdtrain: worker 1 failed:\nTraceback (most recent call last):\n  File \"x.py\", line 1\n" \
                  "    ^^^^^^^^\nRuntimeError: boom\n"


def test_a_user_error_on_several_workers_is_one_line_and_exit_code_2():
    line = "hvdtrain: error: data.source: /data/corpus.txt does not exist\n"
    output = f"[1]<stderr>:{line}[0]<stderr>:{line}" + tagged("[0]<stderr>:", ECHO)
    assert relay(output, 1) == (2, "", line)


def test_a_user_error_on_one_worker_wins_over_the_echo_on_the_others():
    line = "hvdtrain: error: data.source: /data/corpus.txt does not exist\n"
    output = tagged("[0]<stderr>:", ECHO) + f"[1]<stderr>:{line}" + HOROVODRUN_WORKERS_FAILED.format(rank=0, code=1)
    assert relay(output, 1) == (2, "", line)


def test_with_several_hosts_a_user_error_says_where_it_happened():
    line = "hvdtrain: error: data.source: /data/corpus.txt does not exist\n"
    output = tagged("[0]<stderr>:", ECHO) + f"[1]<stderr>:{line}"
    assert relay(output, 1, hosts=["node1", "node2"]) == (2, "", line.rstrip() + " (worker 1 on host node2)\n")


@pytest.mark.parametrize("output,code", [
    ("[1]<stderr>:Killed\n[0]<stderr>:[2026-11-30 20:06:14.179190: E horovod/common/operations.cc:697] [0]: Horovod "
     "background loop uncaught exception: [gloo/transport/tcp/pair.cc:598] Connection closed by peer\n"
     + tagged("[0]<stderr>:", ECHO) + "Process 1 exit with status code 137.\n"
     "Terminating remaining workers after failure of Process 1.\nProcess 0 exit with status code 143.\n"
     + HOROVODRUN_WORKERS_FAILED.format(rank=1, code=137), 1),
    (tagged("[1,0]<stderr>:", ECHO) + MPIRUN_WORKER_FAILED.split("-" * 74 + "\n-")[0] +
     "-" * 74 + "\nmpirun noticed that process rank 1 with PID 0 on node vm exited on signal 9 (Killed).\n"
     + "-" * 74 + "\n", 137),
], ids=["gloo", "mpi"])
def test_a_killed_worker_is_named_with_its_signal(output, code):
    exit_code, _, err = relay(output, code, hosts=["a", "b"])
    assert exit_code != 0
    assert err == "hvdtrain: error: worker 1 on host b was killed by signal 9 (SIGKILL, out of memory?)\n"


def test_a_worker_whose_program_is_missing_on_its_host_names_the_host():
    output = ("[1]<stderr>:env: '/work/main/.venv/bin/python': No such file or directory\n"
              "[0]<stderr>:Terminated\nProcess 1 exit with status code 127.\n"
              + HOROVODRUN_WORKERS_FAILED.format(rank=1, code=127))
    code, _, err = relay(output, 1, hosts=["127.0.0.1", "127.0.0.2"])
    assert code == 127
    assert err.endswith("hvdtrain: error: worker 1 on host 127.0.0.2 exited with status 127: "
                        "env: '/work/main/.venv/bin/python': No such file or directory\n")


def test_a_worker_whose_program_mpirun_cannot_start_is_one_line_naming_the_host():
    output = ("-" * 74 + "\nmpirun was unable to launch the specified application as it could not access\n"
              "or execute an executable:\n\nExecutable: /work/main/.venv/bin/python\nNode: 127.0.0.2\n\n"
              "while attempting to start process rank 1.\n" + "-" * 74 + "\n")
    assert relay(output, 132) == (132, "", "hvdtrain: error: mpirun: mpirun was unable to launch the specified "
                                           "application as it could not access or execute an executable: Executable: "
                                           "/work/main/.venv/bin/python Node: 127.0.0.2 while attempting to start "
                                           "process rank 1.\n")


@pytest.mark.parametrize("output,expected", [
    ("Traceback (most recent call last):\n  File \"horovod/runner/launch.py\", line 759, in run_controller\n"
     "ValueError: MPI support has not been built.  If this is not expected, ensure MPI is installed and reinstall "
     "Horovod with HOROVOD_WITH_MPI=1 to debug the build error.\n",
     "hvdtrain: error: horovodrun: MPI support has not been built.  If this is not expected, ensure MPI is installed "
     "and reinstall Horovod with HOROVOD_WITH_MPI=1 to debug the build error.\n"),
    ("Was unable to run mpirun --version:\n/bin/sh: 1: mpirun: not found\n\n"
     "Traceback (most recent call last):\n  File \"horovod/runner/mpi_run.py\", line 154, in mpi_run\n"
     "Exception: horovod does not find an installed MPI.\n\nChoose one of:\n1. Install Open MPI 4.0.0+\n",
     "hvdtrain: error: horovodrun: horovod does not find an installed MPI.\n"),
    ("Traceback (most recent call last):\n  File \"horovod/runner/launch.py\", line 655, in _run_static\n"
     "RuntimeError: could not connect to some hosts via ssh\nssh not successful for host nosuch.invalid:\n"
     "ssh: Could not resolve hostname nosuch.invalid: Name or service not known\n\n",
     "hvdtrain: error: cannot reach host nosuch.invalid over ssh: ssh: Could not resolve hostname nosuch.invalid: "
     "Name or service not known\n"),
    ("usage: horovodrun [-h] [-v] -np NUM_PROC\n                  ...\nhorovodrun: error: unrecognized arguments: --foo\n",
     "hvdtrain: error: horovodrun: error: unrecognized arguments: --foo\n"),
], ids=["mpi-not-built", "no-mpirun", "ssh", "usage"])
def test_horovodrun_failing_before_any_worker_started_says_why(output, expected):
    code, _, err = relay(output, 1)
    assert (code, err) == (1, expected)


def test_a_run_stopped_on_purpose_keeps_its_exit_code():
    output = ("[0]<stderr>:hvdtrain: stopped: SIGTERM received; checkpoint written at step 4\n"
              "Process 0 exit with status code 75.\nProcess 1 exit with status code 75.\n"
              + HOROVODRUN_WORKERS_FAILED.format(rank=0, code=75))
    assert relay(output, 1) == (75, "", "hvdtrain: stopped: SIGTERM received; checkpoint written at step 4\n")


WAITING = ("[{rank}]<stderr>:hvdtrain: stalled: rank {rank} is waiting for the others: no step finished in 5 s "
           "after step 3 (horovod.stall_timeout_s=5); in synchronize, called from run_steps "
           "(hvdtrain/training/train.py:327)\n")


def test_a_stopped_worker_is_named_as_the_one_the_others_waited_for():
    output = (WAITING.format(rank=0) + WAITING.format(rank=2) + "Process 0 exit with status code 4.\n"
              "Process 2 exit with status code 4.\nProcess 1 exit with status code -9.\n"
              + HOROVODRUN_WORKERS_FAILED.format(rank=0, code=4))
    assert relay(output, 1, world_size=3) == (
        4, "", "hvdtrain: error: worker 1 stalled: the other workers waited for it in a collective operation, "
               "no step finished in 5 s after step 3 (horovod.stall_timeout_s=5); it was stopped, or its host "
               "hung or lost its network\n")


def test_a_stopped_worker_that_says_so_itself_is_named_without_open_mpi_s_echo():
    """Under MPI the stopped worker runs again (mpirun sends SIGCONT before it ends a job); its
    shared-memory read from the worker that already exited fails, which is only an echo."""
    output = ("[1,1]<stderr>:[vm:01939] Read -1, expected 15680, errno = 3\n" + WAITING.format(rank=0) +
              "[1,1]<stderr>:hvdtrain: stalled: rank 1 is stuck: no step finished in 6 s after step 10 "
              "(horovod.stall_timeout_s=6); it did not run for 8 s (stopped, or its host suspended)\n" + MPIRUN_WORKER_FAILED)
    code, out, err = relay(output, 1)
    assert err == ("hvdtrain: error: worker 1 stalled: no step finished in 6 s after step 10 (horovod.stall_timeout_s=6); "
                   "it did not run for 8 s (stopped, or its host suspended)\n")


def test_a_stuck_worker_says_where_it_is_stuck():
    output = ("[1]<stderr>:hvdtrain: stalled: rank 1 is stuck: no step finished in 5 s after step 0 "
              "(horovod.stall_timeout_s=5); in read (hvdtrain/data/streams.py:80), called from run_steps "
              "(hvdtrain/training/train.py:300)\n" + WAITING.format(rank=0) + "Process 1 exit with status code 4.\n"
              + HOROVODRUN_WORKERS_FAILED.format(rank=1, code=4))
    assert relay(output, 1) == (
        4, "", "hvdtrain: error: worker 1 stalled: no step finished in 5 s after step 0 (horovod.stall_timeout_s=5); "
               "in read (hvdtrain/data/streams.py:80), called from run_steps (hvdtrain/training/train.py:300)\n")


def test_after_a_successful_run_nothing_is_lost():
    """A traceback a worker printed and survived (a library logging a handled error) is shown
    at the end, with its worker."""
    output = tagged("[1]<stderr>:", REAL_ERROR) + "[0]<stdout>:done\n"
    code, out, err = relay(output, 0)
    assert (code, out, err) == (0, "done\n" + tagged("[worker 1] ", REAL_ERROR), "")


def test_rank_0_is_shown_untagged_and_the_others_only_when_it_matters():
    output = ("[1,0]<stdout>:hvdtrain: gpt2 0.94M parameters\n[1,1]<stdout>:hvdtrain: cache hit\n"
              "[1,1]<stdout>:/x/y.py:3: UserWarning: the slow path\n"
              f"[1,1]<stdout>:{LEAVING}rank 1 on host b is stuck\n[1,0]<stdout>:step 10/20: loss 7.3972, "
              "lr 1.00e-03, 2670 tokens/s, comm 4%\n[1,0]<stdout>:hvdtrain: done: 20 steps\n")
    assert relay(output, 0, hosts=["a", "b"]) == (
        0, "hvdtrain: gpt2 0.94M parameters\n[worker 1 on host b] /x/y.py:3: UserWarning: the slow path\n"
           f"[worker 1 on host b] {LEAVING}rank 1 on host b is stuck\n"
           "step 10/20: loss 7.3972, lr 1.00e-03, 2670 tokens/s, comm 4%\nhvdtrain: done: 20 steps\n", "")


def test_a_mixture_s_progress_line_carries_its_routing_through_the_launcher():
    """A Mixtral run's line adds the router's loss and the busiest expert's load; the launcher
    reads it back whole (and a dense model's line without them)."""
    moe = Progress(10, 20, 7.3972, 1e-3, 2670, 0.04, aux_loss=0.0213, expert_load=1.4213)
    assert moe.line() == "step 10/20: loss 7.3972, lr 1.00e-03, 2670 tokens/s, comm 4%, aux 0.0213, load 1.42"
    assert parse_progress_line(moe.line()) == Progress(10, 20, 7.3972, 1e-3, 2670, 0.04, 0.0213, 1.42)
    assert parse_progress_line(Progress(10, 20, 7.3972, 1e-3, 2670, 0.04).line()).aux_loss is None


# ---------------------------------------------------------------- real runs

@pytest.mark.workers
@pytest.mark.parametrize("controller", ["gloo", pytest.param("mpi", marks=pytest.mark.deep)])
def test_on_a_terminal_rank_0_is_one_clean_stream_under_one_bar_and_a_summary(tmp_path, tiny_config, controller):
    """What the screen of a 160-column terminal shows once the launch has ended (issue 39)."""
    out = tmp_path / "run"
    config = tiny_config({"train": {"max_steps": 8}, "log": {"every": 2, "progress": True}, "eval": {"every": 4},
                          "checkpoint": {"every": 4}})
    code, raw, screen = run_on_terminal([BIN / "hvdtrain", "launch", f"--{controller}", "-np", "2", config,
                                         f"out_dir={out}"])
    assert code == 0, "\n".join(screen)
    lines = assert_one_clean_stream(screen, raw, 8, out)
    shown = "\n".join(lines)
    assert raw.count("train:") >= 4  # the bar drawn at each of the 4 log points
    bar = next(i for i, line in enumerate(lines) if line.startswith("train:"))
    order = [next(i for i, line in enumerate(lines) if line.startswith(start)) for start in
             ("hvdtrain: gpt2", "step 0: eval loss", "step 4: eval loss", "step 8: eval loss")]
    assert order == sorted(order) and order[-1] < bar, shown  # as they happened, above the bar
    assert "step 8: eval loss" in "".join(lines[bar + 1:]), shown  # the summary's final evaluation


def assert_no_echoes(text: str):
    for echo in ("Horovod has been shut down", "HorovodInternalError", "Horovod detected", "Terminated",
                 "mpirun detected"):
        assert echo not in text, text


@pytest.mark.workers
@pytest.mark.parametrize("controller", ["gloo", pytest.param("mpi", marks=pytest.mark.deep)])
def test_launch_shows_the_failing_workers_traceback_once(tmp_path, tiny_config, controller):
    proc = hvdtrain("launch", f"--{controller}", "-np", "2", tiny_config(), f"out_dir={tmp_path / 'run'}",
                    env=inject("error"))
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("hvdtrain: worker 1 failed:\nTraceback (most recent call last):\n")
    assert proc.stderr.endswith("RuntimeError: injected failure in the middle of training\n")
    assert proc.stderr.count("Traceback") == 1
    assert_no_echoes(proc.stdout + proc.stderr)


@pytest.mark.workers
def test_a_user_error_on_one_worker_only_is_reported(tmp_path, tiny_config):
    """E.g. the data missing on the second host: rank 1 fails, rank 0 is stopped."""
    config, out = tiny_config(), tmp_path / "run"
    line = "hvdtrain: error: injected user error on this worker only\n"
    proc = hvdtrain("launch", "--gloo", "-np", "2", config, f"out_dir={out}", env=inject("user-error"))
    assert (proc.returncode, proc.stderr) == (2, line)
    assert_no_echoes(proc.stdout)
    # Plain horovodrun shows every worker's own line, with its rank: here only rank 1 has one.
    proc = horovodrun(2, ["-m", "hvdtrain.cli", "train", config, f"out_dir={out}"], env=inject("user-error"))
    assert proc.returncode != 0 and f"[1]<stderr>:{line}" in proc.stderr and proc.stderr.count("hvdtrain: error") == 1


@pytest.mark.workers
def test_horovodrun_s_own_error_reaches_the_user(tmp_path, tiny_config):
    """--mpi where mpirun is not on PATH: horovodrun fails before starting any worker."""
    bare = tmp_path / "bin"
    bare.mkdir()
    for tool in ("sh", "env"):
        (bare / tool).symlink_to(f"/bin/{tool}")
    proc = hvdtrain("launch", "--mpi", "-np", "2", tiny_config(), f"out_dir={tmp_path / 'run'}",
                    env={"PATH": f"{BIN}{os.pathsep}{bare}"})
    assert proc.returncode != 0
    assert proc.stderr == "hvdtrain: error: horovodrun: horovod does not find an installed MPI.\n"


@pytest.fixture
def silent_port():
    """A port on 127.0.0.4 that accepts TCP connections and never says anything: a host whose
    ssh does not answer (a hung machine, a firewall that swallows packets)."""
    with socket.socket() as s:
        s.bind(("127.0.0.4", 0))
        s.listen()
        yield s.getsockname()[1]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.3", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


@pytest.mark.workers
def test_a_host_that_refuses_or_does_not_answer_is_one_line_within_the_start_timeout(tmp_path, tiny_config,
                                                                                     silent_port):
    """horovodrun itself would try each host 5 times with a 10 s timeout and name it on stdout."""
    for host, port, why in [("127.0.0.3", closed_port(), "Connection refused"),
                            ("127.0.0.4", silent_port, "timed out")]:
        start = time.monotonic()
        proc = hvdtrain("launch", "--gloo", "-np", "2", "-H", f"127.0.0.1:1,{host}:1", "--start-timeout", "2",
                        f"--horovodrun-args=--ssh-port {port}", tiny_config(), f"out_dir={tmp_path / 'run'}")
        assert time.monotonic() - start < 12
        assert proc.returncode == 2
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"hvdtrain: error: cannot reach host {host} over ssh")
        assert why in lines[0]
        assert not (tmp_path / "run").exists()


def test_hosts_and_slots_are_checked_before_anything_starts(tmp_path, tiny_config):
    for args, words in [(["-H", "node1:x"], "-H: expected host1:slots"),
                        (["-np", "3", "-H", "127.0.0.1:2"], "-np 3 is more than the slots of -H 127.0.0.1:2")]:
        proc = hvdtrain("launch", *args, tiny_config(), f"out_dir={tmp_path / 'run'}")
        assert proc.returncode == 2 and proc.stderr.startswith("hvdtrain: error: ") and words in proc.stderr
        assert len(proc.stderr.splitlines()) == 1


def elastic_command(*argv) -> list[str]:
    """The horovodrun command of `hvdtrain launch --elastic ARGV config.yaml`."""
    import argparse

    parser = argparse.ArgumentParser()
    launch.add_launch_options(parser, 1)
    launch.add_elastic_options(parser)
    launch.add_config_args(parser)
    return launch.horovodrun_command(parser.parse_args(["--elastic", *map(str, argv), "config.yaml"]), ["train"])


def test_an_elastic_job_on_this_machine_alone_talks_over_loopback(tmp_path):
    """Horovod Elastic finds the network interface by testing between two hosts: a job whose
    hosts are all this machine gets the loopback interface (a real run: test_elastic.py), one
    other machine alone is one line, two or more are Horovod's to test, a given one is kept."""
    def interface(*argv):
        cmd = elastic_command(*argv)
        return cmd[cmd.index("--network-interface") + 1] if "--network-interface" in cmd else None

    assert interface("-np", "2", "-H", "localhost:2") == "lo"
    assert interface("-np", "1", "--host-discovery-script", discovery(tmp_path, ["127.0.0.1:1", "localhost:4"])) == "lo"
    assert interface("-np", "2", "-H", "203.0.113.7:1,203.0.113.8:1") is None  # Horovod tests between them
    assert interface("-np", "1", "-H", "localhost:1", "--network-interface", "eth7") == "eth7"
    with pytest.raises(UserError, match=r"^--elastic on one host \(203.0.113.7\) needs --network-interface"):
        elastic_command("-np", "1", "--host-discovery-script", discovery(tmp_path, ["203.0.113.7:2"]))


@pytest.mark.workers
@pytest.mark.parametrize("controller,killed", [("gloo", "launcher"), pytest.param("mpi", "launcher", marks=pytest.mark.deep),
                                               pytest.param("gloo", "group", marks=pytest.mark.deep)])
def test_the_workers_of_a_killed_launcher_stop_by_themselves(tmp_path, tiny_config, controller, killed):
    """SIGKILL of `hvdtrain launch` alone (its terminal closed, an OOM kill), or of its whole
    process group (a shell's `kill -9 %1`, which also reaches what the launcher started in its
    group): horovodrun and the workers must not go on training into the run folder beside a
    relaunched job."""
    from helpers import start_cmd
    out = tmp_path / "run"
    config = tiny_config({"train": {"max_steps": 500, "slow_ranks": [0, 1], "slow_seconds": 0.2}})
    launcher = start_cmd([BIN / "hvdtrain", "launch", "-np", "2", f"--{controller}", config, f"out_dir={out}"],
                         new_session=True)
    assert_workers_stop_when_killed(launcher, out, group=killed == "group", within_s=20)


@pytest.mark.workers
@pytest.mark.parametrize("controller", ["gloo", pytest.param("mpi", marks=pytest.mark.deep)])
def test_a_stop_signal_to_the_launcher_stops_the_workers_as_a_preemption(tmp_path, tiny_config, controller):
    """A scheduler's SIGTERM to `hvdtrain launch` reaches the workers: they agree on a step, write
    its checkpoint and stop, and the launcher says so and exits 75 (run the same command again).
    They reach that step 8 seconds after the signal (their first step's straggle starts as the
    evaluation of step 0 is written): horovodrun's own stop would have killed them before (Gloo:
    5 s later; mpirun: at once). Each reads through a DataLoader process, a fork with its command
    line, which the signal must not reach (the DataLoader would fail the step)."""
    import signal
    from helpers import start_cmd
    from hvdtrain.checkpointing import checkpoint
    out = tmp_path / "run"
    config = tiny_config({"train": {"max_steps": 500, "slow_ranks": [0, 1], "slow_seconds": 8},
                          "data": {"num_workers": 1}})
    launcher = start_cmd([BIN / "hvdtrain", "launch", "-np", "2", f"--{controller}", config, f"out_dir={out}"])
    deadline = time.monotonic() + 120
    # step 0's evaluation, a collective: every worker is in the loop, its stop signal handled
    while not (out / "metrics.jsonl").exists() or "eval_loss" not in (out / "metrics.jsonl").read_text():
        assert launcher.poll() is None and time.monotonic() < deadline, "the run did not start"
        time.sleep(0.2)
    launcher.send_signal(signal.SIGTERM)
    stdout, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 75, stdout[-2000:] + stderr[-2000:]
    assert "preempted" in stdout + stderr and "Traceback" not in stdout + stderr
    assert checkpoint.newest_intact_checkpoint(out) is not None and training_workers(out) == []


def test_the_guard_kills_what_of_the_job_ignores_its_stop_signal(tmp_path):
    """The guard of a dead launcher stops horovodrun's group with SIGTERM, then kills what is
    left after STOP_GRACE_S (Horovod's elastic driver outlived its stopped workers for ever)."""
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                 "signal.SIG_IGN); print('ready', flush=True); time.sleep(120)"],
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert stubborn.stdout.readline().strip() == "ready"
    guard = ("import hvdtrain.launching.launcher_guard as g; g.STOP_GRACE_S = 2; "
             f"g.main({stubborn.pid}, {{launcher}})")
    # The launcher: starts its guard, then dies (the guard gets SIGTERM, as when a launcher is killed)
    launcher = subprocess.run([sys.executable, "-c", "import os, subprocess, sys, time; subprocess.Popen("
                               f"[sys.executable, '-c', {guard!r}.format(launcher=os.getpid())], "
                               "start_new_session=True); time.sleep(1)"], timeout=60)
    assert launcher.returncode == 0
    try:
        assert stubborn.wait(timeout=60) == -signal.SIGKILL
    finally:
        stubborn.kill()
        stubborn.stdout.close()
