"""What the benchmark commands share: option parsing, the tag of a worker's result line,
this process's memory from /proc, and a training run sampled at every log point. No torch
import at the top (the CLI imports the benchmarks)."""
from pathlib import Path

from hvdtrain.errors import UserError

RESULT_TAG = "hvdtrain-bench-result: "  # marks the line a benchmark worker reports its result on


def parse_ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise UserError(f"{what}: expected comma-separated integers >= 1, got '{text}'")
    return values


def proc_status_bytes(field: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def train_sampling(cfg, sample):
    """`hvdtrain train`'s set-up and steps (hvdtrain.training.train) in this worker, calling
    `sample(setup, peak_bytes)` at every log point: each step, the last right after the last
    step, before the final evaluation, checkpoint and export. `peak_bytes()` is this worker's
    peak memory since its set-up ended: the allocator's peak on a GPU, the rise of the resident
    set's peak (VmHWM) over the start on a CPU. Returns the set-up and `peak_bytes`."""
    import torch

    from hvdtrain.observe import step_timer
    from hvdtrain.training import train as loop

    before_setup = proc_status_bytes("VmRSS")
    setup = loop.set_up(cfg)
    device = setup.world.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        try:  # "5" resets the peak resident size (VmHWM) to the current one
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass

    def peak_bytes() -> int:
        if device.type == "cuda":
            return torch.cuda.max_memory_allocated(device)
        return proc_status_bytes("VmHWM") - before_setup

    original = step_timer.StepTimer.interval

    def interval(self):
        sample(setup, peak_bytes)
        return original(self)

    step_timer.StepTimer.interval = interval
    try:
        loop.run_steps(cfg, setup)
    finally:
        step_timer.StepTimer.interval = original
    return setup, peak_bytes


def add_worker_parser(kinds, name: str, func):
    """The internal `bench _NAME-worker CONFIG [key=value ...]` command that each horovodrun
    worker of a benchmark runs (no help, so `bench --help` does not list it)."""
    p = kinds.add_parser(f"_{name}-worker")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=func)
