"""Where each training step's time goes: data, forward, backward, allreduce wait, optimizer.

`StepTimer.phase(name)` is a context manager around each part of the step; the totals of an
interval (between log points) are read with `interval()`. While the profiler runs, each phase
also opens a `record_function` range of the same name, so traces show the same breakdown.

On a CPU a phase's time is the wall time spent in it.

On a GPU the work of a phase runs later than the Python code that queues it, and waiting for
it (torch.cuda.synchronize) at every phase end would stall the CPU, which must keep queuing
ahead of the GPU for the GPU to stay busy. So each phase end only records a CUDA event on the
current stream, costing microseconds and no wait; `interval()`, at the log point, reads the
elapsed time between consecutive events. A phase's time is then the GPU time from the end of
the previous phase to its own end: the time its queued work took, plus any time the GPU sat
idle waiting for the CPU to queue it (slow data, a blocking allreduce wait), which is where
that time belongs. The first phase of an interval counts from the event recorded by reset().
Events are kept in a pool and reused from one interval to the next.

log.step_breakdown=false turns the phases off and leaves only whole-step timing.
"""
import time
from contextlib import contextmanager

import torch

from hvdtrain.observe.metrics import PHASES


class StepTimer:
    def __init__(self, device: torch.device, enabled: bool):
        self.enabled = enabled
        self.cuda = device.type == "cuda"
        self.annotate = False  # set while the profiler is recording
        self.events = []  # the pool of CUDA timing events
        self.reset()

    def reset(self):
        """Start a new interval (after logging, evaluation or a checkpoint, which are not step time)."""
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self.started = time.perf_counter()
        self.used = 0
        self.ends = []  # (phase, CUDA event recorded at its end), in order
        self.start_event = self.record() if self.cuda and self.enabled else None

    def record(self) -> torch.cuda.Event:
        if self.used == len(self.events):
            self.events.append(torch.cuda.Event(enable_timing=True))
        event = self.events[self.used]
        self.used += 1
        event.record()
        return event

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
            if self.cuda:
                self.ends.append((name, self.record()))
            else:
                self.totals[name] += time.perf_counter() - t0
            if ranged is not None:
                ranged.__exit__(None, None, None)

    def interval(self) -> tuple[list[float], float]:
        """Per-step means of each phase and of the whole step since the last reset; resets.

        On a GPU this waits for the queued work first, breakdown on or off: the interval's
        wall time must include the GPU work its steps queued, or a CPU running ahead would
        report the steps faster than they ran."""
        if self.cuda:
            torch.cuda.synchronize()
            previous = self.start_event
            for name, event in self.ends:
                self.totals[name] += previous.elapsed_time(event) / 1000.0  # ms -> s
                previous = event
        elapsed = time.perf_counter() - self.started
        steps = max(1, self.steps)
        means = [self.totals[p] / steps for p in PHASES]
        self.reset()
        return means, elapsed / steps
