"""When a run stops early on its own: non-finite steps and stalled workers. (Preemption,
RunStopped and the exit codes are in hvdtrain.training.stopping.)

Non-finite steps: a step whose gradient norm is inf or NaN (a loss spike, a bad batch) is
skipped and counted; with fp16 the grad scaler skips it (and backs off its scale), and it is
counted alike. On a GPU with fused AdamW or LAMB the skip is decided on the device (the
optimizer's `found_inf`), so the skip adds no synchronisation; the count of the interval is
read at log points. After `train.max_bad_steps` in a row the run stops, at the step the streak
reaches it whatever log.every is: the streak is read in the next step, once its gradients are
reduced (the device has finished the step before by then: the read waits only for the
normalisation just queued), and before a checkpoint. Every rank reads the same streak (the
gradients are reduced), so all stop at the same step.

Stalled workers: a worker that stops taking part (stuck in I/O, a deadlock, SIGSTOP) leaves the
others waiting in their next collective for ever; Horovod's own stall check cannot end that,
as its coordinator waits in the same collective when a worker is stopped, and MPI never times
out. So every worker watches itself: see StallWatchdog. A plain job ends, naming the stalled
worker; an elastic job goes on without it.
"""
import os
import socket
import subprocess
import sys
import threading
import time
import traceback

import torch

from hvdtrain.launching.relay import LEAVING, STALLED  # how the watchdog's lines start: the launcher reads them
from hvdtrain.training.stopping import DIVERGED_EXIT_CODE, STALLED_EXIT_CODE, RunStopped

# Where a worker that waits for the others is: in Horovod's wait for a collective, or in the
# pipeline's sends and receives between stages.
COLLECTIVE_PACKAGES = ("horovod", "torch.distributed")


class NonFiniteGuard:
    """Skips (or sees skipped) the steps whose gradients are not finite, counts them on the
    device, and stops the run after `max_bad_steps` of them in a row (see the module's notes)."""

    def __init__(self, device: torch.device, max_bad_steps: int):
        self.max_bad_steps = max_bad_steps
        self.skipped = torch.zeros((), device=device)  # in this log interval
        self.in_a_row = torch.zeros((), device=device)

    def count(self, bad: torch.Tensor):
        """`bad`: 1.0 when this step was skipped, else 0.0 (a device tensor: nothing is read)."""
        self.skipped += bad
        self.in_a_row = (self.in_a_row + bad) * bad

    def step(self, optimizer, grad_norm: torch.Tensor):
        """optimizer.step() unless the gradients are not finite."""
        bad = (~torch.isfinite(grad_norm)).float()
        self.count(bad)
        if getattr(optimizer, "_step_supports_amp_scaling", False) and bad.is_cuda:
            optimizer.found_inf = bad  # fused AdamW and LAMB skip the update on the device
            optimizer.step()
            optimizer.found_inf = None
        elif not bad.item():  # on the CPU reading the flag costs nothing
            optimizer.step()

    def scaler_step(self, scaler: torch.amp.GradScaler, optimizer):
        """fp16: scaler.step() and update(), which skip the step and back off the scale when
        unscale_ found inf or NaN in the gradients; the same flag counts the step as skipped."""
        found_inf = scaler._found_inf_per_device(optimizer)  # per device, from unscale_, on the device
        self.count((sum(found_inf.values()) > 0).float())
        scaler.step(optimizer)
        scaler.update()

    def check(self, step: int):
        """Stop the run when the steps up to `step` were skipped max_bad_steps times in a row
        (reads the streak: call it where the device has finished that step anyway)."""
        in_a_row = int(self.in_a_row.item())
        if in_a_row >= self.max_bad_steps:
            raise RunStopped(f"the gradients were not finite in the last {in_a_row} steps up to step {step} "
                             f"(train.max_bad_steps={self.max_bad_steps}); the run stops without writing a "
                             f"checkpoint from them: lower train.lr or check the data", DIVERGED_EXIT_CODE)

    def interval(self) -> dict:
        """Read at a log point: the steps skipped since the last one."""
        skipped = int(self.skipped.item())
        self.skipped.zero_()
        return {"skipped_steps": skipped}


class StallWatchdog:
    """Ends this worker when no step finishes for `timeout_s` (horovod.stall_timeout_s).

    The training loop calls `progress(step)` after each step, evaluation and checkpoint (an
    assignment: nothing per step but that). A thread wakes every few seconds; past the limit it
    prints one line saying what the training thread is doing, from its Python stack:
      `hvdtrain: stalled: rank R is waiting for the others: ...` when it waits in a collective;
      `hvdtrain: stalled: rank R is stuck: ...` anywhere else (the stalled rank itself), or
      when this process did not run itself (SIGSTOP; it says so once it runs again);
    then exits with STALLED_EXIT_CODE, and the launcher ends the other workers. A stopped worker
    says nothing: `hvdtrain launch` names it as the one the others waited for (hvdtrain.launching.relay).
    The first step may take FIRST_STEP_FACTOR times as long (as torchtitan's init timeout): it
    compiles the model and connects NCCL's communicators.

    In an elastic job (`elastic`) the stalled worker alone leaves, and the job goes on without
    it: Horovod's driver blacklists the host of a worker that exited with an error and resets
    the others to their last commit. So a stuck worker says `hvdtrain: stalled, leaving the
    elastic job: rank R on host H is stuck: ...` and exits; one that waits for the others goes on
    waiting (its collective fails once the stalled one has exited, and Horovod resets it); a
    stopped worker is ended from outside by hvdtrain.training.stop_sentinel, which the watchdog starts."""
    FIRST_STEP_FACTOR = 3

    def __init__(self, timeout_s: float, rank: int, step: int, elastic: bool = False):
        self.timeout_s, self.rank, self.elastic = timeout_s, rank, elastic
        self.first_step, self.step, self.last_progress = step, step, time.monotonic()
        self.watched = threading.get_ident()  # the training thread
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self.watch, name="hvdtrain-stall-watchdog", daemon=True)
        self.host = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
        self.sentinel = None
        if timeout_s > 0:
            self.thread.start()
            if elastic:
                self.sentinel = subprocess.Popen([sys.executable, "-m", "hvdtrain.training.stop_sentinel", str(timeout_s),
                                                  str(rank), self.host])

    def progress(self, step: int):
        self.step, self.last_progress = step, time.monotonic()

    def watch(self):
        interval, awake = min(5.0, self.timeout_s / 10), time.monotonic()
        while not self.closed.wait(interval):
            # A wake-up long overdue: this whole process did not run (SIGSTOP, then the SIGCONT
            # that mpirun sends before it ends a job; a suspended host). It is the stalled one.
            now = time.monotonic()
            frozen, awake = now - awake - interval, now
            limit = self.timeout_s * (self.FIRST_STEP_FACTOR if self.step == self.first_step else 1)
            if now - self.last_progress > limit:
                waiting, line = self.report(limit, frozen if frozen > self.timeout_s / 2 else 0.0)
                if self.elastic and waiting:
                    continue  # for the stalled worker to leave: then Horovod resets this one
                print(line, file=sys.stderr, flush=True)
                if not self.elastic:
                    time.sleep(2.0)  # so that every worker has said where it is before the launcher ends them
                os._exit(STALLED_EXIT_CODE)

    def report(self, limit: float, frozen: float = 0.0) -> tuple[bool, str]:
        """(whether the training thread waits in a collective, the line saying where it is)."""
        since = f"no step finished in {limit:g} s after step {self.step} (horovod.stall_timeout_s={self.timeout_s:g})"
        who = f"{LEAVING}rank {self.rank} on host {self.host}" if self.elastic else f"{STALLED}rank {self.rank}"
        if frozen:
            return False, f"{who} is stuck: {since}; it did not run for {frozen:.0f} s (stopped, or its host suspended)"
        frame = sys._current_frames().get(self.watched)
        stack = traceback.extract_stack(frame) if frame is not None else []
        collective = tuple(filter(None, map(_package_folder, COLLECTIVE_PACKAGES)))
        ours = [i for i, f in enumerate(stack) if f.filename.startswith(_package_folder("hvdtrain"))]
        # What hvdtrain's innermost frame called: an elastic job's whole loop runs inside
        # Horovod's hvd.elastic.run, which waits for nobody.
        called = stack[ours[-1] + 1:] if ours else stack
        waits = [f for f in called if collective and f.filename.startswith(collective)]
        caller = _where(stack[ours[-1]] if ours else stack[-1] if stack else None)
        if waits:
            return True, f"{who} is waiting for the others: {since}; in {waits[0].name}, called from {caller}"
        inner = _where(stack[-1] if stack else None)
        where = inner if inner == caller else f"{inner}, called from {caller}"
        return False, f"{who} is stuck: {since}; in {where}"

    def close(self):
        self.closed.set()
        if self.sentinel is not None:
            self.sentinel.kill()
            self.sentinel.wait()


def _package_folder(name: str) -> str | None:
    """Where an imported package's files are, ending with a separator; None if not imported."""
    module = sys.modules.get(name)
    return os.path.dirname(module.__file__) + os.sep if module is not None else None


def _where(frame: traceback.FrameSummary | None) -> str:
    """`function (hvdtrain/training/train.py:123)`: the path from the top package's folder on."""
    if frame is None:
        return "?"
    for name in ("hvdtrain", "horovod", "torch"):
        folder = _package_folder(name)
        if folder and frame.filename.startswith(folder):
            return f"{frame.name} ({os.path.relpath(frame.filename, os.path.dirname(folder.rstrip(os.sep)))}:{frame.lineno})"
    return f"{frame.name} ({os.path.basename(frame.filename)}:{frame.lineno})"
