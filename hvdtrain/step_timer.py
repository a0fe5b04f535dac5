"""Where each training step's time goes: data, forward, backward, allreduce wait, optimizer.

`StepTimer.phase(name)` is a context manager around each part of the step. It adds the
wall time to a per-interval total and, while the profiler runs, opens a `record_function`
range of the same name so traces show the same breakdown. On a GPU the timer synchronises
the device at phase ends so that time lands in the phase that spent it (off with
log.step_breakdown=false, which leaves only whole-step timing).
"""
import time
from contextlib import contextmanager

import torch

from hvdtrain.metrics import PHASES


class StepTimer:
    def __init__(self, device: torch.device, enabled: bool):
        self.sync = enabled and device.type == "cuda"
        self.enabled = enabled
        self.annotate = False  # set while the profiler is recording
        self.reset()

    def reset(self):
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self.started = time.perf_counter()

    @contextmanager
    def phase(self, name: str):
        if not self.enabled:
            yield
            return
        ranged = torch.profiler.record_function(name) if self.annotate else None
        if ranged is not None:
            ranged.__enter__()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize()
            self.totals[name] += time.perf_counter() - t0
            if ranged is not None:
                ranged.__exit__(None, None, None)

    def interval(self) -> tuple[list[float], float]:
        """Per-step means of each phase and of the whole step since the last reset; resets."""
        if self.sync:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - self.started
        steps = max(1, self.steps)
        means = [self.totals[p] / steps for p in PHASES]
        self.reset()
        return means, elapsed / steps
