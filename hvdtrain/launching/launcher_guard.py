"""The launcher's guard: when `hvdtrain launch` dies, even by SIGKILL, its job stops too.

`hvdtrain launch` starts horovodrun in a process group of its own and this small process beside
it, in a session of its own (so that a SIGKILL to the launcher's process group spares it),
armed with Linux's parent-death signal: when the launcher dies, the guard gets SIGTERM and
passes it to horovodrun's group (horovodrun, and under --mpi the shell and mpirun it starts).
They stop the workers (Horovod gives each 5 seconds after its SIGTERM to write a preemption
checkpoint, mpirun none), so none goes on training into the run folder beside a relaunched
job. What of the group is still there STOP_GRACE_S later is killed: Horovod's elastic driver
outlives its stopped workers (it waits to start new ones), and would otherwise stay for ever. A launcher that ends normally kills its guard first.

    python -m hvdtrain.launching.launcher_guard GROUP LAUNCHER_PID
"""
import ctypes
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent dies
# Time for horovodrun (or mpirun) to stop its workers and end
STOP_GRACE_S = 300


def die_with_parent(signum: int, parent: int) -> bool:
    """Arm Linux's parent-death signal: this process gets `signum` when its parent dies.
    False when `parent` died before it was armed (this process already has another parent)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum)
    return os.getppid() == parent


def main(group: int, launcher: int):
    def stop(*_):
        deadline = time.monotonic() + STOP_GRACE_S
        try:
            os.killpg(group, signal.SIGTERM)
            while time.monotonic() < deadline:
                time.sleep(1)
                os.killpg(group, 0)  # raises once every process of the group has ended
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the job has ended
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    if not die_with_parent(signal.SIGTERM, launcher):
        stop()
    while True:
        signal.pause()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
