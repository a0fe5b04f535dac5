"""The image's entrypoint passes a stop signal on to the hvdtrain ranks in its container.

In a Kubernetes worker pod or a Docker `worker` container the ranks are started over ssh, so they
are descendants of sshd; in the default role (`docker compose up`: `hvdtrain launch`) they are
horovodrun's. An eviction or `docker stop` signals PID 1 only, a PID 1 without a handler never
sees it, and when PID 1 ends the kernel SIGKILLs the rest. docker/entrypoint.sh is run here as it
runs in the container, with real processes: a stand-in sshd that starts the "sessions" (fake
ranks, or real ranks through horovodrun) or hvdtrain launch itself, then a signal to the entrypoint.
"""
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from helpers import BIN, OFFLINE, REPO, SHARED_CORES, default_sigint
from hvdtrain.checkpointing import checkpoint

ENTRYPOINT = REPO / "docker" / "entrypoint.sh"


def write_program(path: Path, body: str) -> Path:
    path.parent.mkdir(exist_ok=True)
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)
    return path


def start_worker(tmp_path: Path, sessions: str, ranks: str) -> subprocess.Popen:
    """The entrypoint's worker role with a stand-in sshd that runs `sessions` (bash) as its
    children, writes `ready` to tmp_path/log, and on SIGTERM logs how many processes whose
    command line matches `ranks` (a regular expression) are still running."""
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "authorized_keys").write_text("ssh-ed25519 AAAA test\n")
    log = tmp_path / "log"
    write_program(tmp_path / "bin" / "sshd", f"""
trap 'echo "sshd: SIGTERM, ranks running: $(pgrep -f "{ranks}" | wc -l)" >> {log}; exit 0' TERM
{sessions}
echo ready >> {log}
while true; do sleep 0.05; done
""")
    env = dict(os.environ, **OFFLINE, **SHARED_CORES, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}",
               TMPDIR=str(tmp_path), HOME=str(tmp_path), SSH_DIR=str(keys), HVDTRAIN_TEST_WORKER=str(tmp_path))
    # Its output goes to files: what it leaves running (as a container's kernel would not) keeps pipes open.
    with open(tmp_path / "worker.out", "w") as out, open(tmp_path / "worker.err", "w") as err:
        return subprocess.Popen([ENTRYPOINT, "worker"], stdout=out, stderr=err, env=env, cwd=REPO,
                                preexec_fn=default_sigint)  # as a container's first process has it


def wait_for(condition, proc: subprocess.Popen, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the worker ended before {what}"
        assert time.monotonic() < deadline, f"no {what} in {timeout} s"
        time.sleep(0.1)


def stop_all(proc: subprocess.Popen, tmp_path: Path):
    """Kill whatever the test started and is left (horovodrun starts its ranks in sessions of
    their own): every process with this test's mark in its environment."""
    for process in psutil.process_iter():
        try:
            if process.environ().get("HVDTRAIN_TEST_WORKER") == str(tmp_path):
                process.kill()
        except psutil.Error:
            pass
    proc.wait()


# A rank stand-in: `hvdtrain train NAME` logs each signal; on SIGTERM it takes a while (its
# checkpoint), then exits with the preemption code. A bystander under sshd (as orted) logs any signal.
FAKE_RANK = """trap 'echo "$2: SIGUSR1" >> {log}' USR1
trap 'echo "$2: SIGTERM" >> {log}; sleep 1; echo "$2: exited" >> {log}; exit 75' TERM
while true; do sleep 0.05; done
"""
BYSTANDER = """for s in TERM INT USR1; do trap "echo \\"bystander: SIG$s\\" >> {log}" $s; done
while true; do sleep 0.05; done
"""


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_reaches_the_ranks_and_sshd_stops_after_they_exit(tmp_path, stop):
    log = tmp_path / "log"
    write_program(tmp_path / "bin" / "hvdtrain", FAKE_RANK.format(log=log))
    write_program(tmp_path / "bin" / "bystander", BYSTANDER.format(log=log))
    worker = start_worker(tmp_path, f"""
bash {tmp_path}/bin/hvdtrain train rank0 &
bash -c 'bash {tmp_path}/bin/hvdtrain train rank1; echo "session of rank1 ended" >> {log}' &
bash {tmp_path}/bin/bystander &
""", ranks=f"^bash {tmp_path}/bin/hvdtrain train")
    try:
        wait_for(lambda: log.exists() and "ready" in log.read_text(), worker, 20, "sshd")
        time.sleep(0.5)  # the stand-ins have set their traps

        worker.send_signal(signal.SIGUSR1)  # a warning: passed on, the worker stays
        wait_for(lambda: log.read_text().count("SIGUSR1") == 2, worker, 10, "SIGUSR1 at both ranks")
        time.sleep(0.5)
        assert worker.poll() is None

        worker.send_signal(stop)
        try:
            worker.wait(timeout=60)  # the ranks take 1 s; a loaded machine's bash, far longer
        except subprocess.TimeoutExpired:
            pytest.fail(f"the entrypoint did not end within 60 s of {stop.name}; its log: {log.read_text()!r}; "
                        f"its stderr: {(tmp_path / 'worker.err').read_text()!r}")
    finally:
        stop_all(worker, tmp_path)
    lines = log.read_text().splitlines()
    assert {"rank0: SIGUSR1", "rank1: SIGUSR1", "rank0: SIGTERM", "rank1: SIGTERM"} <= set(lines), lines
    # sshd was stopped only once both ranks had exited; nothing else was signalled.
    assert lines[-1] == "sshd: SIGTERM, ranks running: 0", lines
    assert lines.index("rank0: exited") < lines.index(lines[-1]) and "session of rank1 ended" in lines
    assert not [line for line in lines if line.startswith("bystander")], lines
    assert worker.returncode == 0  # a clean stop
    assert f"hvdtrain-entrypoint: {stop.name}: SIGTERM to the hvdtrain ranks here:" in (tmp_path / "worker.err").read_text()


def test_a_stop_signal_without_ranks_stops_sshd_at_once(tmp_path):
    worker = start_worker(tmp_path, "", ranks="^$")
    try:
        wait_for(lambda: (tmp_path / "log").exists(), worker, 20, "sshd")
        start = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=10)
    finally:
        stop_all(worker, tmp_path)
    assert time.monotonic() - start < 5
    assert "ranks here: none" in (tmp_path / "worker.err").read_text() and "sshd: SIGTERM" in (tmp_path / "log").read_text()


@pytest.mark.deep
@pytest.mark.workers
def test_sigterm_to_the_worker_checkpoints_real_ranks_started_by_horovodrun(tmp_path, tiny_config):
    """As a worker pod whose ranks a launcher started: 2 real ranks (`python -m hvdtrain.cli train`
    under horovodrun) take the eviction's SIGTERM through the entrypoint: they agree on a step,
    write a checkpoint and exit with the preemption code, before sshd is stopped."""
    config = tiny_config({"train": {"max_steps": 100_000}, "checkpoint": {"every": 0}})
    out = tmp_path / "run"
    worker = start_worker(tmp_path, f"""
(cd {REPO} && {BIN}/horovodrun -np 2 --gloo {BIN}/python -m hvdtrain.cli train {config} out_dir={out} \\
   > {tmp_path}/ranks.out 2> {tmp_path}/ranks.err; echo $? > {tmp_path}/horovodrun.exit) &
""", ranks=f"^[^ ]*python[^ ]* -m hvdtrain.cli train {config}")
    metrics = out / "metrics.jsonl"
    try:
        wait_for(lambda: metrics.exists() and metrics.read_text().count('"tokens_per_s"') >= 3, worker, 180,
                 "3 training steps")
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=120)
        wait_for_file = time.monotonic() + 30  # horovodrun itself may take a moment longer
        while not (tmp_path / "horovodrun.exit").exists() and time.monotonic() < wait_for_file:
            time.sleep(0.2)
    finally:
        stop_all(worker, tmp_path)
    ranks_err = (tmp_path / "ranks.err").read_text()
    assert "stopped: preempted at step" in ranks_err, ranks_err[-3000:]
    step = int(ranks_err.split("stopped: preempted at step ")[1].split()[0].rstrip(":,."))
    assert checkpoint.newest_intact_checkpoint(out).name == f"step_{step:08d}"
    # The ranks were gone before sshd was told to stop; horovodrun saw them end early.
    assert (tmp_path / "log").read_text().splitlines()[-1] == "sshd: SIGTERM, ranks running: 0"
    assert (tmp_path / "horovodrun.exit").read_text().strip() != "0"
    assert worker.returncode == 0


def start_launcher(tmp_path: Path, *args) -> subprocess.Popen:
    """The entrypoint's default role: `hvdtrain ARGS` (tmp_path/bin first on PATH, then this venv's,
    as in the image, where the venv's bin folder is on PATH)."""
    env = dict(os.environ, **OFFLINE, **SHARED_CORES, PATH=f"{tmp_path / 'bin'}:{BIN}:{os.environ['PATH']}",
               TMPDIR=str(tmp_path), HOME=str(tmp_path), HVDTRAIN_TEST_WORKER=str(tmp_path))
    with open(tmp_path / "launcher.out", "w") as out, open(tmp_path / "launcher.err", "w") as err:
        return subprocess.Popen([ENTRYPOINT, *map(str, args)], stdout=out, stderr=err, env=env, cwd=REPO)


def test_in_the_launcher_role_the_ranks_get_the_stop_signal_and_the_launcher_ends_with_them(tmp_path):
    log = tmp_path / "log"
    # A stand-in for `hvdtrain launch` that starts two ranks (`hvdtrain train rN`), logs any
    # signal it gets itself, and exits with what the last rank exited with.
    write_program(tmp_path / "bin" / "hvdtrain", f"""
if [[ $1 == train ]]; then
{FAKE_RANK.format(log=log)}
fi
for s in TERM INT USR1; do trap "echo \\"launch: SIG$s\\" >> {log}" $s; done
bash $0 train rank0 & bash $0 train rank1 &
echo ready >> {log}
while ! wait; do :; done
echo "launch: ranks ended" >> {log}
exit 75
""")
    launcher = start_launcher(tmp_path, "launch", "-np", "2", "recipes/gpt-tiny.yaml")
    try:
        wait_for(lambda: log.exists() and "ready" in log.read_text(), launcher, 20, "the launcher")
        time.sleep(0.5)
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=20)
    finally:
        stop_all(launcher, tmp_path)
    lines = log.read_text().splitlines()
    assert {"rank0: SIGTERM", "rank1: SIGTERM", "rank0: exited", "rank1: exited", "launch: ranks ended"} <= set(lines)
    assert not [line for line in lines if line.startswith("launch: SIG")], lines
    assert launcher.returncode == 75  # the launcher's own status: preempted, rerun to resume


def test_without_ranks_the_stop_signal_goes_to_the_hvdtrain_command_itself(tmp_path):
    write_program(tmp_path / "bin" / "hvdtrain", f"trap 'echo got SIGTERM > {tmp_path}/log; exit 3' TERM\n"
                                                 f"touch {tmp_path}/ready\nwhile true; do sleep 0.05; done\n")
    launcher = start_launcher(tmp_path, "doctor")
    try:
        wait_for(lambda: (tmp_path / "ready").exists(), launcher, 20, "hvdtrain doctor")
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=10)
    finally:
        stop_all(launcher, tmp_path)
    assert (tmp_path / "log").read_text() == "got SIGTERM\n" and launcher.returncode == 3


@pytest.mark.workers
def test_sigterm_to_a_launcher_container_checkpoints_and_exits_as_preempted(tmp_path, tiny_config):
    """`docker compose stop` of the train service: SIGTERM to PID 1, the entrypoint running
    `hvdtrain launch -np 2` (Gloo): the ranks checkpoint at the same step and the container
    exits with the preemption code, so that `up` again resumes."""
    config = tiny_config({"train": {"max_steps": 100_000}, "checkpoint": {"every": 0}})
    out = tmp_path / "run"
    (tmp_path / "bin").mkdir()
    launcher = start_launcher(tmp_path, "launch", "-np", "2", "--gloo", config, f"out_dir={out}")
    metrics = out / "metrics.jsonl"
    try:
        wait_for(lambda: metrics.exists() and metrics.read_text().count('"tokens_per_s"') >= 3, launcher, 180,
                 "3 training steps")
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=120)
    finally:
        stop_all(launcher, tmp_path)
    said = (tmp_path / "launcher.err").read_text() + (tmp_path / "launcher.out").read_text()
    assert "stopped: preempted at step" in said, said[-3000:]
    step = int(said.split("stopped: preempted at step ")[1].split()[0].rstrip(":,."))
    assert checkpoint.newest_intact_checkpoint(out).name == f"step_{step:08d}"
    assert launcher.returncode == 75, said[-2000:]
