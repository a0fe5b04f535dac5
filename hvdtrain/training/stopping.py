"""How a run stops on purpose: RunStopped and the exit codes that tell a scheduler why, and the
preemption signal.

Preemption: a scheduler sends SIGTERM or SIGUSR1 before it kills a job (Slurm's `--signal`,
Kubernetes' termination grace period). The handler only sets a flag. The flag rides on the
allreduce of target-token counts that every step already does, so all ranks agree at the
same step boundary, write a checkpoint and exit with PREEMPTED_EXIT_CODE; rerunning the same
command resumes exactly.

No torch here: `hvdtrain train` opens a PreemptionSignal before it loads torch and Horovod
(seconds), so a signal during that set-up is kept too (hvdtrain.cli).
"""
import os
import signal
from pathlib import Path

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: a temporary failure; run the same command again
DIVERGED_EXIT_CODE = 3
STALLED_EXIT_CODE = 4


def mark_preempted(world):
    """Create the file named by HVDTRAIN_PREEMPTED_FILE (rank 0): a job script that starts the
    workers with srun or mpirun can tell a preempted run (requeue it) from a failed one, whatever
    exit code the launcher makes of the workers' 75 (srun --kill-on-bad-exit may kill the last
    ones as they exit)."""
    marker = os.environ.get("HVDTRAIN_PREEMPTED_FILE")
    if marker and world.is_main:
        Path(marker).touch()


class RunStopped(Exception):
    """The run ended early on purpose; `exit_code` tells the scheduler why."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class PreemptionSignal:
    """Remembers that SIGTERM or SIGUSR1 arrived; restores the previous handlers on close.

    A worker opens one around its whole run (hvdtrain.cli), and the run opens its own once its
    steps can start (training.train.opened_run): a signal that came during the set-up (torch's
    import, Horovod's init, the data, the model, the resumed state), kept by the outer one, is the inner one's
    from the start, so the first step stops the run as a later one would (checkpoint, exit 75).
    Without the outer one, the signal's default action ended the worker there (exit 143, no
    checkpoint, and the scheduler's requeue saw a failure). After the last step, a signal is
    kept and ignored: the export of the final checkpoint finishes."""
    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.previous = {s: signal.signal(s, self.handle) for s in self.SIGNALS}
        outer = getattr(self.previous[signal.SIGTERM], "__self__", None)
        self.received = outer.received if isinstance(outer, PreemptionSignal) else None

    def handle(self, signum, frame):
        self.received = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.received is not None

    def close(self):
        for s, handler in self.previous.items():
            signal.signal(s, handler)
