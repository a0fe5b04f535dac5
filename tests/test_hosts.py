"""Several hosts over ssh, on this machine.

Each extra "host" is an OpenSSH server on its own loopback address (127.0.0.2, 127.0.0.3; 127.0.0.1
is this host, which horovodrun runs without ssh), started by the test with a key pair made in
tmp_path, a free port and its own sshd_config. It runs in a private mount namespace where chosen
folders are other folders, so a host has its own data cache, or lacks the data or the venv. An
`ssh` first on PATH adds the test's known_hosts, holding the servers' host keys. horovodrun and
mpirun start the remote workers through it, so the ssh launch, HOROVOD_HOSTNAME, the local and
cross ranks, per-host data preparation and a broken host's errors are real.

Nothing outlives a test: the servers are its children, killed at the end, and their mounts go
with their namespaces; ~/.ssh, /etc/ssh and horovodrun's cache (~/.horovod) are not touched.

The fake hosts share this machine's interfaces, so the runs pin Horovod's and MPI's traffic to
`lo` (--network-interface lo): offered eth0 too, Open MPI's TCP transport between two "hosts"
with the same eth0 address hung in about one run of three.
"""
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import (BIN, assert_one_clean_stream, assert_same_losses, assert_same_params, hvdtrain, run_cmd,
                     run_on_terminal, step_losses, write_config)

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
pytestmark = [
    pytest.mark.workers,
    pytest.mark.skipif(not os.path.exists(SSHD), reason="no OpenSSH server (sshd): `scripts/install.py --sshd` "
                                                        "installs it (as root, with apt)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="each fake host needs a private mount namespace: run as root"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="unshare (util-linux) is not installed"),
]

# Text data prepared on each host: a tokenizer trained there, blocks packed and cached there.
TEXT_DATA = {"source": "builtin", "tokenizer": "train", "vocab_size": 512, "seq_len": 32}


class LoopbackHosts:
    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir()
        self.key = folder / "id_ed25519"
        host_key = folder / "host_ed25519"
        for key in (self.key, host_key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], check=True)
        (folder / "authorized_keys").write_text(self.key.with_suffix(".pub").read_text())
        self.host_key_line = host_key.with_suffix(".pub").read_text()
        with socket.socket() as s:  # one port for all hosts, as horovodrun's --ssh-port wants
            s.bind(("127.0.0.2", 0))
            self.port = s.getsockname()[1]
        (folder / "ssh_config").write_text(f"Host *\n  UserKnownHostsFile {folder}/known_hosts\n"
                                           "  GlobalKnownHostsFile /dev/null\n  BatchMode yes\n  LogLevel ERROR\n")
        bin_dir = folder / "bin"
        bin_dir.mkdir()
        (bin_dir / "ssh").write_text(f'#!/bin/sh\nexec /usr/bin/ssh -F {folder}/ssh_config "$@"\n')
        (bin_dir / "ssh").chmod(0o755)
        self.env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
        # --disable-cache: horovodrun would remember these hosts' checks in ~/.horovod.
        self.horovodrun_args = ["--ssh-port", str(self.port), "--ssh-identity-file", str(self.key), "--disable-cache"]
        self.launch_args = ["--network-interface", "lo", f"--horovodrun-args={' '.join(self.horovodrun_args)}"]
        self.servers: list[subprocess.Popen] = []

    def start(self, address: str, replaced: dict[Path, Path] | None = None):
        """An sshd on `address` whose sessions see each folder `replaced` maps by the other one."""
        config = self.folder / f"sshd_config_{address}"
        config.write_text(f"Port {self.port}\nListenAddress {address}\nHostKey {self.folder}/host_ed25519\n"
                          f"AuthorizedKeysFile {self.folder}/authorized_keys\nPidFile none\nUsePAM no\n"
                          "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                          "PermitRootLogin prohibit-password\nStrictModes no\n")
        with open(self.folder / "known_hosts", "a") as known:
            known.write(f"[{address}]:{self.port} {self.host_key_line}")
        # sshd wants /run/sshd: a private /run gives it one without touching the machine's.
        mounts = "".join(f"mount --bind {new} {old} && " for old, new in (replaced or {}).items())
        script = f"mount -t tmpfs tmpfs /run && mkdir /run/sshd && {mounts}exec {SSHD} -D -e -f {config}"
        log = open(self.folder / f"sshd_{address}.log", "w")
        self.servers.append(subprocess.Popen(["unshare", "--mount", "sh", "-c", script], stderr=log))
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection((address, self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline or self.servers[-1].poll() is not None:
                    raise RuntimeError(f"sshd on {address} did not start:\n{(self.folder / log.name).read_text()}") from None
                time.sleep(0.05)

    def stop(self):
        for server in self.servers:
            server.kill()
            server.wait()


@pytest.fixture
def hosts(tmp_path):
    loopback = LoopbackHosts(tmp_path / "ssh")
    yield loopback
    loopback.stop()


@pytest.fixture(scope="module")
def one_host_run(tmp_path_factory):
    """The reference: one process on one host, the same global batch."""
    folder = tmp_path_factory.mktemp("one-host")
    config = write_config(folder / "config.yaml", {"data": TEXT_DATA, "train": {"global_batch_size": 8}})
    proc = hvdtrain("train", config, f"out_dir={folder / 'run'}", f"data.cache_dir={folder / 'cache'}")
    assert proc.returncode == 0, proc.stderr
    return config, folder / "run"


def hf_params(run: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(run / "hf" / "model.safetensors"))


PROBE = ("import os, horovod.torch as hvd; hvd.init(); print('layout', hvd.rank(), hvd.local_rank(), hvd.local_size(), "
         "hvd.cross_rank(), hvd.cross_size(), os.environ['HOROVOD_HOSTNAME'], flush=True)")


@pytest.mark.parametrize("controller", ["gloo", pytest.param("mpi", marks=pytest.mark.deep)])
def test_two_hosts_over_ssh_train_like_one_host(tmp_path, hosts, one_host_run, controller):
    config, reference = one_host_run
    cache, cache_of_host_2 = tmp_path / "cache", tmp_path / "cache-of-127.0.0.2"
    cache.mkdir()
    cache_of_host_2.mkdir()
    hosts.start("127.0.0.2", {cache: cache_of_host_2})
    run = tmp_path / "run"
    # On a terminal, as a user launches it: rank 0 one clean stream under its bar (issue 39).
    code, raw, screen = run_on_terminal([BIN / "hvdtrain", "launch", f"--{controller}", "-np", "2",
                                         "-H", "127.0.0.1:1,127.0.0.2:1", *hosts.launch_args, config,
                                         f"out_dir={run}", f"data.cache_dir={cache}", "log.progress=true"],
                                        env=hosts.env)
    assert code == 0, "\n".join(screen)
    assert_one_clean_stream(screen, raw, 6, run)
    assert_same_losses(step_losses(reference), step_losses(run))
    assert_same_params(hf_params(reference), hf_params(run), atol=1e-5)
    # Each host prepared the data (tokenizer, packed blocks) in its own cache.
    assert any(cache.iterdir()) and any(cache_of_host_2.iterdir())
    if controller == "gloo":
        # horovodrun gives each host its own local ranks; the workers there know their host.
        probe = run_cmd([BIN / "horovodrun", "-np", "2", "-H", "127.0.0.1:1,127.0.0.2:1", "--gloo",
                         "--network-interface", "lo", *hosts.horovodrun_args, sys.executable, "-c", PROBE],
                        env=hosts.env)
        layout = sorted(line.split("layout ", 1)[1] for line in probe.stdout.splitlines() if "layout " in line)
        assert layout == ["0 0 1 0 2 127.0.0.1", "1 0 1 1 2 127.0.0.2"], probe.stdout + probe.stderr


def test_data_missing_on_one_host_is_one_line_naming_the_file_and_the_host(tmp_path, hosts, tiny_config):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = "a small corpus that only the first host has, long enough for a few blocks".split()
    paragraphs = (" ".join(words[(i + j) % len(words)] for j in range(200)) for i in range(300))
    (corpus / "text.txt").write_text("\n\n".join(paragraphs))  # a .txt paragraph is a document
    (tmp_path / "nothing").mkdir()
    hosts.start("127.0.0.2", {corpus: tmp_path / "nothing"})
    out = tmp_path / "run"
    proc = hvdtrain("launch", "--gloo", "-np", "2", "-H", "127.0.0.1:1,127.0.0.2:1", *hosts.launch_args,
                    tiny_config({"data": {**TEXT_DATA, "source": str(corpus / "text.txt"),
                                                         "validation_fraction": 0.1}}), f"out_dir={out}",
                    f"data.cache_dir={tmp_path / 'cache'}", env=hosts.env)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hvdtrain: error: data.source"), proc.stderr
    assert "text.txt" in lines[0] and lines[0].endswith("(worker 1 on host 127.0.0.2)")
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not out.exists()


def test_a_tensor_parallel_group_across_hosts_is_one_line(tmp_path, hosts, tiny_config):
    """parallel.tensor_parallel=2 with one worker on each of two hosts: a group would span them."""
    hosts.start("127.0.0.2")
    out = tmp_path / "run"
    proc = hvdtrain("launch", "--gloo", "-np", "2", "-H", "127.0.0.1:1,127.0.0.2:1", *hosts.launch_args,
                    tiny_config({"model": {"arch": "llama"}}), f"out_dir={out}", "parallel.tensor_parallel=2",
                    env=hosts.env)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "'parallel.tensor_parallel': 2 does not divide the workers of each host (1)" in lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("controller", ["gloo", pytest.param("mpi", marks=pytest.mark.deep)])
def test_a_host_without_the_venv_is_one_line_naming_the_host(tmp_path, hosts, tiny_config, controller):
    (tmp_path / "empty").mkdir()
    hosts.start("127.0.0.3", {BIN: tmp_path / "empty"})
    start = time.monotonic()
    proc = hvdtrain("launch", f"--{controller}", "-np", "2", "-H", "127.0.0.1:1,127.0.0.3:1", *hosts.launch_args,
                    "--start-timeout", "20", tiny_config(), f"out_dir={tmp_path / 'run'}", env=hosts.env)
    assert time.monotonic() - start < 60
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hvdtrain: error: ")]
    assert len(errors) == 1 and "127.0.0.3" in errors[0] and str(BIN / "python") in errors[0], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
