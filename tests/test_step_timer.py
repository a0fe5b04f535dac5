"""StepTimer: per-phase times of the training step. On a GPU the phases are timed with CUDA
events read at the log interval: nothing inside a step waits for the GPU."""
import time

import pytest
import torch

from hvdtrain.observe.metrics import PHASES
from hvdtrain.observe.step_timer import StepTimer


def run_step(timer, sleeps: dict):
    for name in PHASES:
        with timer.phase(name):
            time.sleep(sleeps.get(name, 0.0))
    timer.steps += 1


def test_cpu_wall_time_per_phase():
    timer = StepTimer(torch.device("cpu"), enabled=True)
    for _ in range(2):
        run_step(timer, {"forward": 0.02, "backward": 0.04})
    means, step = timer.interval()
    by_phase = dict(zip(PHASES, means))
    assert 0.02 <= by_phase["forward"] < 0.035 and 0.04 <= by_phase["backward"] < 0.06
    assert step >= by_phase["forward"] + by_phase["backward"]
    assert timer.steps == 0 and timer.totals == dict.fromkeys(PHASES, 0.0)  # interval() resets


def test_disabled_keeps_the_step_time_only():
    timer = StepTimer(torch.device("cpu"), enabled=False)
    run_step(timer, {"forward": 0.01})
    means, step = timer.interval()
    assert means == [0.0] * len(PHASES) and step >= 0.01


class FakeCuda:
    """torch.cuda's Event and synchronize on a CPU: an event's time is the wall clock at
    record(); synchronize calls are counted, and refused while a step is running."""

    def __init__(self, monkeypatch):
        self.synchronized, self.events, self.in_step = 0, 0, False
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                fake.events += 1
                self.at = None

            def record(self):
                self.at = time.perf_counter()

            def elapsed_time(self, end):  # milliseconds, as CUDA's
                return (end.at - self.at) * 1000.0

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "synchronize", self.synchronize)

    def synchronize(self, device=None):
        assert not self.in_step, "torch.cuda.synchronize() inside a step"
        self.synchronized += 1


@pytest.mark.parametrize("enabled", [True, False])
def test_cuda_phases_use_events_and_never_synchronize_inside_a_step(monkeypatch, enabled):
    fake = FakeCuda(monkeypatch)
    timer = StepTimer(torch.device("cuda"), enabled=enabled)
    for interval in range(2):
        for _ in range(3):
            fake.in_step = True
            run_step(timer, {"data": 0.005, "backward": 0.05})
            fake.in_step = False
        means, step = timer.interval()
        by_phase = dict(zip(PHASES, means))
        # One wait per interval, breakdown on or off: the step time must include the GPU's work.
        assert fake.synchronized == interval + 1
        if enabled:
            assert 0.005 <= by_phase["data"] < 0.035 and 0.05 <= by_phase["backward"] < 0.08
            assert sum(means) <= step
        else:
            assert means == [0.0] * len(PHASES)
        assert step >= 0.025
    # The events of the first interval were reused by the second: a start and the phase ends.
    assert fake.events == (1 + 3 * len(PHASES) if enabled else 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_cuda_events_attribute_gpu_work_to_its_phase():
    timer = StepTimer(torch.device("cuda"), enabled=True)
    a = torch.randn(4096, 4096, device="cuda")
    timer.reset()
    for _ in range(3):
        with timer.phase("data"):
            b = a + 1
        with timer.phase("forward"):
            for _ in range(20):
                b = b @ a
                b = b / b.norm()
        with timer.phase("backward"):
            pass
        timer.steps += 1
    means, step = timer.interval()
    by_phase = dict(zip(PHASES, means))
    assert by_phase["forward"] > 10 * by_phase["data"] and by_phase["forward"] > 10 * by_phase["backward"]
    assert sum(means) <= step * 1.01
