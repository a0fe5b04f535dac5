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

PHASES = ("data", "forward", "backward", "allreduce", "optimizer")


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


def summarize_ranks(per_rank, threshold: float) -> dict:
    """Breakdown and load imbalance from an array (world_size, len(PHASES) + 1) of per-step
    means: the phases, then the whole step.

    A rank's busy time is data + forward + backward: what it spends before it can join the
    allreduce. The other ranks wait for the slowest one inside the allreduce, so a straggler
    shows up as a large busy time on one rank and large allreduce time on the others."""
    mean = per_rank.mean(axis=0)
    record = {f"time_{p}": float(mean[i]) for i, p in enumerate(PHASES)}
    record["time_step"] = float(mean[-1])
    record["comm_fraction"] = record["time_allreduce"] / record["time_step"] if record["time_step"] > 0 else 0.0
    compute = per_rank[:, 1] + per_rank[:, 2]
    busy = per_rank[:, 0] + compute
    record["compute_min"], record["compute_max"] = float(compute.min()), float(compute.max())
    record["slowest_rank"], record["fastest_rank"] = int(busy.argmax()), int(busy.argmin())
    record["imbalance"] = float((busy.max() - busy.min()) / busy.min()) if busy.min() > 0 else 0.0
    record["imbalance_warning"] = record["imbalance"] > threshold and len(busy) > 1
    record["ranks"] = {p: [float(v) for v in per_rank[:, i]] for i, p in enumerate(PHASES)}
    record["ranks"]["step"] = [float(v) for v in per_rank[:, -1]]
    return record
