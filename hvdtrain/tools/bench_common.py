"""What the benchmark commands share: option parsing, the workers' start through horovodrun
and the tag of their result lines, this process's memory from /proc, and a training run
sampled at every log point. No torch import at the top (the CLI imports the benchmarks)."""
import argparse
import io
import json
import os
import subprocess
import sys
from pathlib import Path

from hvdtrain.errors import UserError
from hvdtrain.launching import launch
from hvdtrain.launching.relay import Relay
from hvdtrain.observe.progress import LAUNCHED

RESULT_TAG = "hvdtrain-bench-result: "  # marks the line a benchmark worker reports its result on


def parse_ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise UserError(f"{what}: expected comma-separated integers >= 1, got '{text}'")
    return values


def worker_command(workers: int, worker_args: list[str], threads: int) -> tuple[list[str], dict]:
    """The horovodrun command and environment that start `workers` ranks of `hvdtrain
    WORKER_ARGS` (Gloo, this host) as `hvdtrain launch` starts them, each with `threads` compute
    threads."""
    ns = argparse.Namespace(np=workers, hosts=None, controller="gloo", network_interface=None, start_timeout=None,
                            horovodrun_args=[])
    cmd = launch.horovodrun_command(ns, worker_args)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads), OMPI_MCA_mpi_yield_when_idle="1",
               **{LAUNCHED: "1"})
    # A fixed mmap threshold (glibc's initial 128 KiB): large tensors are then always mapped and
    # unmapped, so the resident size follows what is live. With glibc's default dynamic threshold
    # freed activations stay in the heap, and the peak RSS grows with the number of micro batches
    # a step allocates rather than with what they keep (measured with `bench pipeline`: +30 MiB on
    # the last stage from m=2 to m=16 without it, +2 MiB with it).
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    return cmd, env


def worker_results(output: str) -> list[dict]:
    """The result lines (RESULT_TAG) of the workers' joined output, by rank."""
    reports = [json.loads(line.split(RESULT_TAG, 1)[1]) for line in output.splitlines() if RESULT_TAG in line]
    return sorted(reports, key=lambda r: r["rank"])


def worker_failure(output: str, workers: int, returncode: int) -> tuple[str, int]:
    """What `hvdtrain launch` would show of the failed workers' joined output (hvdtrain.launching.relay):
    the failing worker's own error once, not the others' echoes of it; and its exit code."""
    relay = Relay([], workers, out=io.StringIO(), err=io.StringIO())  # rank 0's progress is not the failure
    for line in output.splitlines(keepends=True):
        relay.feed(line)
    code = relay.finish(returncode or 1) or 1
    return relay.err.getvalue(), code


def run_workers(workers: int, name: str, config: str, overrides: list[str], threads: int) -> list[dict]:
    """`workers` ranks of `bench _NAME-worker CONFIG OVERRIDES` (worker_command); their result
    lines, by rank. When a worker fails, the user sees its error as `hvdtrain launch` would show
    it (worker_failure), and the benchmark ends with that exit code."""
    cmd, env = worker_command(workers, ["bench", f"_{name}-worker", config, *overrides], threads)
    print(f"OMP_NUM_THREADS={threads} MALLOC_MMAP_THRESHOLD_={env['MALLOC_MMAP_THRESHOLD_']} {' '.join(cmd)}",
          file=sys.stderr, flush=True)  # to be run again by hand
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    reports = worker_results(proc.stdout)
    if proc.returncode or len(reports) != workers:
        text, code = worker_failure(proc.stdout, workers, proc.returncode)
        sys.stderr.write(text)
        raise SystemExit(code)
    return reports


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
    `sample(setup, peak_bytes, interval)` at every log point, the last right after the last
    step, before the final evaluation, checkpoint and export. `peak_bytes()` is this worker's
    peak memory since its set-up ended: the allocator's peak on a GPU, the rise of the resident
    set's peak (VmHWM) over the start on a CPU. `interval`: this worker's StepTimer.interval()
    of the log point, the per-step means of each phase (metrics.PHASES) and seconds per step
    since the last one. Returns the set-up and `peak_bytes`."""
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
        measured = original(self)
        sample(setup, peak_bytes, measured)
        return measured

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
