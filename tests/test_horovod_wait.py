"""Horovod as scripts/install.py patches it: with HVDTRAIN_HOROVOD_SPIN_US set (hvdtrain's CPU
workers), a rank waiting in hvd.synchronize stops spinning after that long and leaves its core to
the others; unset (GPU workers), it spins as upstream Horovod does."""
import re

import pytest
import torch
from helpers import REPO, WORKERS, horovodrun

from hvdtrain.config import load_config
from hvdtrain.parallel.distributed import horovod_env

WAIT_S = 2.0


def cpu_seconds_of_a_wait(spin_us: str | None) -> float:
    """The CPU time of rank 1's main thread while it waits WAIT_S for rank 0 in hvd.synchronize
    (2 real workers). Measured on 2 cores: 1.8-1.9 s spinning, 0.19 s with 50 us of spin."""
    proc = horovodrun(2, [WORKERS / "wait_in_synchronize.py", WAIT_S], env={"HVDTRAIN_HOROVOD_SPIN_US": spin_us},
                      timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    waited, cpu = map(float, re.search(r"waited ([\d.]+) s, cpu ([\d.]+) s", proc.stdout).groups())
    assert waited > WAIT_S / 2, proc.stdout
    return cpu


@pytest.mark.workers
def test_a_cpu_worker_waiting_in_synchronize_leaves_its_core_and_a_gpu_worker_spins():
    spinning, sleeping = cpu_seconds_of_a_wait(None), cpu_seconds_of_a_wait("50")
    # Spinning, the waiting thread is on a core the whole wait (less of it when the machine is busy).
    assert spinning > WAIT_S / 3, (spinning, sleeping)
    assert sleeping < spinning / 3, (spinning, sleeping)


def test_hvdtrain_sets_the_wait_for_cpu_workers_and_keeps_a_users_own(monkeypatch):
    cfg = load_config(str(REPO / "recipes" / "gpt-tiny.yaml"))
    monkeypatch.delenv("HVDTRAIN_HOROVOD_SPIN_US", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert horovod_env(cfg)["HVDTRAIN_HOROVOD_SPIN_US"] == "50"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "HVDTRAIN_HOROVOD_SPIN_US" not in horovod_env(cfg)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("HVDTRAIN_HOROVOD_SPIN_US", "200")
    assert "HVDTRAIN_HOROVOD_SPIN_US" not in horovod_env(cfg)
