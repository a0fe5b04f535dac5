"""When a run stops early, and how: preemption signals and non-finite steps.

Preemption: a scheduler sends SIGTERM or SIGUSR1 before it kills a job (Slurm's `--signal`,
Kubernetes' termination grace period). The handler only sets a flag. The flag rides on the
allreduce of target-token counts that every step already does, so all ranks agree at the
same step boundary, write a checkpoint and exit with PREEMPTED_EXIT_CODE; rerunning the same
command resumes exactly.

Non-finite steps: a step whose gradient norm is inf or NaN (a loss spike, a bad batch) is
skipped, as fp16's grad scaler skips one, and counted. On a GPU with fused AdamW the skip is
decided on the device (the optimizer's `found_inf`), so the check adds no synchronisation;
the counts are read at log points. After `train.max_bad_steps` in a row the run stops.
"""
import os
import signal
from pathlib import Path

import torch

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: a temporary failure; run the same command again
DIVERGED_EXIT_CODE = 3


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
    """Remembers that SIGTERM or SIGUSR1 arrived; restores the previous handlers on close."""
    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.received = None
        self.previous = {s: signal.signal(s, self.handle) for s in self.SIGNALS}

    def handle(self, signum, frame):
        self.received = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.received is not None

    def close(self):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


class NonFiniteGuard:
    def __init__(self, device: torch.device, max_bad_steps: int):
        self.max_bad_steps = max_bad_steps
        self.skipped = torch.zeros((), device=device)  # in this log interval
        self.in_a_row = torch.zeros((), device=device)

    def step(self, optimizer, grad_norm: torch.Tensor):
        """optimizer.step() unless the gradients are not finite."""
        bad = (~torch.isfinite(grad_norm)).float()
        self.skipped += bad
        self.in_a_row = (self.in_a_row + bad) * bad
        if getattr(optimizer, "_step_supports_amp_scaling", False) and bad.is_cuda:
            optimizer.found_inf = bad  # fused AdamW skips the update on the device
            optimizer.step()
            optimizer.found_inf = None
        elif not bad.item():  # on the CPU reading the flag costs nothing
            optimizer.step()

    def interval(self, step: int) -> dict:
        """Read at a log point: the steps skipped since the last one; stops a diverged run."""
        skipped, in_a_row = int(self.skipped.item()), int(self.in_a_row.item())
        self.skipped.zero_()
        if in_a_row >= self.max_bad_steps:
            raise RunStopped(f"the gradients were not finite in the last {in_a_row} steps up to step {step} "
                             f"(train.max_bad_steps={self.max_bad_steps}); the run stops without writing a "
                             f"checkpoint from them: lower train.lr or check the data", DIVERGED_EXIT_CODE)
        return {"skipped_steps": skipped}
