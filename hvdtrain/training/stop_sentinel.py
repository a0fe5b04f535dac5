"""The stop sentinel of an elastic worker: a worker stopped from outside is ended, so that the
elastic job goes on without it.

A stopped process (SIGSTOP, SIGTSTP) runs nothing, its stall watchdog thread included
(hvdtrain.training.run_guards.StallWatchdog), and the other workers wait for it in their next
collective. Horovod's elastic driver removes a worker once its process has exited (it
blacklists the host and resets the others to their last commit, without it), but waits for ever
for one that is only stopped. So the watchdog of an elastic worker starts this small process
beside it, which looks at the worker from outside: once the worker has been stopped for
horovod.stall_timeout_s, the sentinel says so in one line naming its rank and host and SIGKILLs
it. The sentinel dies with the worker (Linux's parent-death signal), and the watchdog ends it
when its step loop ends.

    python -m hvdtrain.training.stop_sentinel TIMEOUT_S RANK HOST
"""
import os
import signal
import sys
import time

import psutil

from hvdtrain.launching.launcher_guard import die_with_parent
from hvdtrain.launching.relay import LEAVING


def main(timeout_s: float, rank: int, host: str):
    worker = psutil.Process(os.getppid())
    if not die_with_parent(signal.SIGKILL, worker.pid):
        return
    interval, stopped_since = min(1.0, timeout_s / 10), None
    while True:
        time.sleep(interval)
        try:
            stopped = worker.status() == psutil.STATUS_STOPPED
        except psutil.NoSuchProcess:
            return
        now = time.monotonic()
        stopped_since = (stopped_since or now) if stopped else None
        if stopped_since is not None and now - stopped_since >= timeout_s:
            print(f"{LEAVING}rank {rank} on host {host} is stopped: it did not run for {now - stopped_since:.0f} s "
                  f"(horovod.stall_timeout_s={timeout_s:g}); ended, the others go on without it",
                  file=sys.stderr, flush=True)
            worker.kill()
            return


if __name__ == "__main__":
    main(float(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
