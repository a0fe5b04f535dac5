"""What the tests share: tiny configs, real `horovodrun -np N --gloo|--mpi` and plain `mpirun`
runs of hvdtrain, and comparisons of runs (losses step by step, parameters tensor by tensor)."""
import os
import re
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

import forked_horovodrun

from hvdtrain.config import deep_merge
from hvdtrain.observe.metrics import read_metrics as read_run_metrics

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
WORKERS = Path(__file__).resolve().parent / "workers"
RTOL = 1e-5

# A GPT small enough for a step in milliseconds on one CPU core; no dropout, so runs with
# different world sizes or accumulation must agree to rounding.
TINY = {
    "model": {"arch": "gpt2", "n_layer": 2, "n_head": 2, "d_model": 32, "dropout": 0.0},
    "data": {"source": "synthetic", "seq_len": 16, "vocab_size": 128, "synthetic_samples": 256, "num_workers": 0},
    "train": {"micro_batch_size": 4, "grad_accum": 1, "max_steps": 6, "lr": 1e-2, "warmup_steps": 2,
              "schedule": "cosine", "precision": "fp32", "seed": 7},
    "checkpoint": {"every": 0, "keep": 2},
    "log": {"every": 1, "progress": False, "tensorboard": False},
    "eval": {"every": 0, "batches": 2},
}

# Offline everywhere: tests never reach a hub.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def write_config(path: Path, overrides: dict | None = None, base: dict = TINY) -> Path:
    """A YAML recipe: `base` deep-merged with `overrides`."""
    path.write_text(yaml.safe_dump(deep_merge(base, overrides or {})))
    return path


# The test machine's cores are shared by all workers: Open MPI yields them while it waits
# instead of spinning (as `hvdtrain launch` on one host does), and so does Horovod's wait in
# hvd.synchronize (as hvdtrain's CPU workers set it) in the workers that call hvd.init themselves.
SHARED_CORES = {"OMPI_MCA_mpi_yield_when_idle": "1", "HVDTRAIN_HOROVOD_SPIN_US": "50"}


def command_env(env: dict | None) -> dict:
    """A command's environment: the tests' own, offline, cores shared, and `env` over it (a
    variable given as None: unset)."""
    merged = {**os.environ, **OFFLINE, **SHARED_CORES, **(env or {})}
    return {k: v for k, v in merged.items() if v is not None}


def run_cmd(args: list, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                          env=command_env(env), cwd=REPO)


def default_sigint():
    """SIGINT handled by default, as under a terminal (Ctrl-C). pytest started from a background
    job (`make test &` in a script, nohup) has SIGINT ignored, which its children inherit: Python
    then never raises KeyboardInterrupt and bash cannot trap it, so a test's SIGINT would go unseen."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_cmd(args: list, env: dict | None = None, new_session: bool = False) -> subprocess.Popen:
    """run_cmd's command, started: the test acts on it while it runs (`new_session`: as a shell's
    job, in a process group of its own)."""
    return subprocess.Popen([str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=command_env(env), cwd=REPO,
                            start_new_session=new_session, preexec_fn=default_sigint)


def hvdtrain(*args, **kw) -> subprocess.CompletedProcess:
    return run_cmd([BIN / "hvdtrain", *args], **kw)


def horovodrun(np: int, script_args: list, controller: str = "gloo", timeout: int = 300,
               env: dict | None = None) -> subprocess.CompletedProcess:
    """`horovodrun -np N --gloo|--mpi python ...`: real worker processes talking through Gloo or MPI,
    started by Horovod's own launcher, forked from a server that has it loaded (forked_horovodrun.py)."""
    argv = [str(a) for a in (BIN / "horovodrun", "-np", np, f"--{controller}", sys.executable, *script_args)]
    return forked_horovodrun.run(argv, command_env(env), REPO, timeout)


# Open MPI refuses to run as root unless told that it is meant (horovodrun tells it itself).
MPIRUN_AS_ROOT = ["--allow-run-as-root"] if os.geteuid() == 0 else []


def mpirun(np: int, script_args: list, **kw) -> subprocess.CompletedProcess:
    """Plain `mpirun -np N python ...`, without horovodrun, as Slurm and the MPI Operator start
    workers; Horovod takes ranks from Open MPI."""
    return run_cmd(["mpirun", *MPIRUN_AS_ROOT, "--oversubscribe", "-np", np, "-bind-to", "none",
                    sys.executable, *script_args], **kw)


def train_workers(np: int, config: Path, *overrides, worker: str = "train_and_dump.py", launcher: str = "gloo",
                  **kw):
    """Train with N real workers; each rank also dumps its final parameters (see workers/).
    launcher: "gloo" or "mpi" (horovodrun --gloo/--mpi), or "mpirun" (plain mpirun)."""
    args = [WORKERS / worker, config, *overrides]
    proc = mpirun(np, args, **kw) if launcher == "mpirun" else horovodrun(np, args, controller=launcher, **kw)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def train_sharded_across_layouts(config: Path, out_dir: Path, *split: str, workers: int = 4):
    """`workers` split by the overrides `split` with parallel.shard=optimizer to step 4, 2 workers
    unsplit and unsharded to step 6, `workers` split with parallel.shard=gradients to the end: a
    run whose sharded checkpoints are written and read at other layouts."""
    train_workers(workers, config, f"out_dir={out_dir}", *split, "parallel.shard=optimizer", "train.stop_at_step=4",
                  timeout=900)
    train_workers(2, config, f"out_dir={out_dir}", "train.stop_at_step=6")
    train_workers(workers, config, f"out_dir={out_dir}", *split, "parallel.shard=gradients", timeout=900)


def train_fully_sharded_with_a_resume(config: Path, out_dir: Path, *split: str):
    """4 workers split by the overrides `split` with parallel.shard=full to step 4, then resumed
    at the same layout to the end (train.max_steps): a run whose fully sharded checkpoint is
    written and read."""
    for stop in (4, None):
        train_workers(4, config, f"out_dir={out_dir}", *split, "parallel.shard=full",
                      *([f"train.stop_at_step={stop}"] if stop else []), timeout=900)


def training_workers(out_dir) -> list[int]:
    """The pids of this run's training workers (python -m hvdtrain.cli train ... out_dir=...)."""
    import psutil
    return [p.pid for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [])[1:4] == ["-m", "hvdtrain.cli", "train"]
            and f"out_dir={out_dir}" in p.info["cmdline"]]


def described(pids: list[int]) -> str:
    """Each process of `pids` with its state, age and parent: what a test shows of processes left behind."""
    import psutil
    lines = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            parent = p.parent()
            lines.append(f"pid {pid} ({p.status()}, {time.time() - p.create_time():.0f} s old) child of "
                         f"{parent.pid if parent else None}: {' '.join((parent.cmdline() if parent else [])[:4])}")
        except psutil.Error as e:
            lines.append(f"pid {pid}: {e}")
    return "; ".join(lines)


def assert_workers_stop_when_killed(launcher: subprocess.Popen, out_dir: Path, group: bool, within_s: float):
    """Once `launcher` (started with new_session) trains in `out_dir` on 2 workers, SIGKILL it
    alone or with its whole process group (`group`, a shell's `kill -9 %1`); its workers must
    stop by themselves within `within_s`. Whatever is left is killed, and the pipes closed."""
    import signal
    try:
        deadline = time.monotonic() + 120
        while not (Path(out_dir) / "metrics.jsonl").exists() or len(training_workers(out_dir)) < 2:
            assert launcher.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.2)
        if group:
            os.killpg(launcher.pid, signal.SIGKILL)
        else:
            launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + within_s
        while training_workers(out_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = training_workers(out_dir)
        assert left == [], f"workers still training {within_s} s after their launcher was killed: {described(left)}"
    finally:
        for pid in training_workers(out_dir):
            os.kill(pid, signal.SIGKILL)
        launcher.stdout.close()
        launcher.stderr.close()


def discovery(tmp_path, hosts: list[str]):
    """An elastic job's host discovery script printing the lines of hosts.txt, which a test may change."""
    (tmp_path / "hosts.txt").write_text("".join(f"{h}\n" for h in hosts))
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {tmp_path / 'hosts.txt'}\n")
    script.chmod(0o755)
    return script


def inject(failure: str) -> dict:
    """The environment that makes rank 1 of a real run fail at its third backward pass
    (workers/failure_injection): `error`, `user-error` or `kill`."""
    return {"PYTHONPATH": os.pathsep.join([str(WORKERS / "failure_injection"), os.environ.get("PYTHONPATH", "")]),
            "HVDTRAIN_TEST_FAIL": failure}


def read_metrics(out_dir: Path) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) of a run folder's metrics.jsonl, in step order."""
    return read_run_metrics(Path(out_dir))


def step_losses(out_dir: Path) -> dict[int, float]:
    """Per-step training loss by step number (log.every=1 gives one record per step)."""
    out = {}
    for record in read_metrics(out_dir)[0]:
        first = record["step"] - len(record["step_losses"]) + 1
        out.update({first + i: v for i, v in enumerate(record["step_losses"])})
    return out


def steps_logged(out_dir: Path) -> int:
    """The training steps a run (still going, maybe) has logged so far (log.every=1)."""
    metrics = Path(out_dir) / "metrics.jsonl"
    return metrics.read_text().count('"tokens_per_s"') if metrics.exists() else 0


def load_params(out_dir: Path, rank: int) -> dict:
    from safetensors.torch import load_file
    return load_file(str(Path(out_dir) / f"params_rank{rank}.safetensors"))


def assert_same_losses(a: dict, b: dict, min_steps: int = 5):
    assert len(a) >= min_steps and a.keys() == b.keys()
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=RTOL), f"step {step}: {a[step]} vs {b[step]}"


def assert_same_params(a: dict, b: dict, atol=0.0):
    """Bitwise (atol=0) only for the same computation run twice (copies on two ranks, a resume);
    two different computations (other world sizes, accumulation) need an fp32 atol."""
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=0, atol=atol), name


def two_stages_equal_one_worker(tmp_path: Path, config: Path, *overrides: str) -> Path:
    """Train `config` on one worker and in two pipeline stages (with `overrides`); assert the same losses and
    weights within a tenth of one lr step (3 steps of lr 1e-3 move a weight by up to 3e-3): an
    untied embedding's rows of rare tokens get gradients near AdamW's eps, whose step turns fp32
    rounding into ~2% of an lr step (1.6e-5 seen on a CPU). Returns the one worker's folder."""
    one, two = tmp_path / "one", tmp_path / "two"
    train_workers(1, config, f"out_dir={one}")
    train_workers(2, config, f"out_dir={two}", "parallel.pipeline_stages=2", *overrides)
    assert_same_losses(step_losses(one), step_losses(two), min_steps=3)
    stages = {**load_params(two, 0), **load_params(two, 1)}
    for name, value in load_params(one, 0).items():
        assert torch.allclose(value, stages[name], rtol=0, atol=1e-4), (name, (value - stages[name]).abs().max())
    return one


def png_size(path) -> tuple[int, int]:
    """(width, height) of a PNG file, after checking its signature and header chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def run_on_terminal(args: list, columns: int = 160, timeout: int = 300, env: dict | None = None) -> tuple[int, str, list[str]]:
    """run_cmd's command on a pseudo-terminal `columns` wide, as a user runs it: (exit code, what
    it wrote, the screen's lines once it has ended: redraws in place and cleared lines applied)."""
    import fcntl
    import pty
    import select
    import struct
    import termios
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    proc = subprocess.Popen([str(a) for a in args], stdin=slave, stdout=slave, stderr=slave, cwd=REPO,
                            env=dict(os.environ, **OFFLINE, **SHARED_CORES, COLUMNS=str(columns), **(env or {})))
    os.close(slave)
    raw, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 1)[0]:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: every writer of the terminal has closed it
                    break
                if not chunk:
                    break
                raw += chunk
        else:
            proc.kill()
        code = proc.wait(timeout=30)
    finally:
        os.close(master)
    text = raw.decode(errors="replace")
    return code, text, terminal_screen(text, columns)


def assert_one_clean_stream(screen: list[str], raw: str, steps: int, out: Path, columns: int = 160) -> list[str]:
    """What `hvdtrain launch` on a terminal must show (issue 39): rank 0's lines without the
    launcher's rank tags, one progress bar at its end, redrawn in place at every log point, and
    below it the summary line (wrapped at `columns`). Returns the screen's non-empty lines."""
    lines = [line for line in screen if line]
    shown = "\n".join(lines)
    assert "<stdout>" not in shown and "<stderr>" not in shown and "[1," not in shown, shown
    bars = [i for i, line in enumerate(lines) if line.startswith("train:")]
    assert len(bars) == 1 and f"{steps}/{steps}" in lines[bars[0]], shown  # one bar, at its end ...
    assert raw.count("train:") >= 2, raw  # ... drawn more than once, in place
    summary = "".join(line.ljust(columns) for line in lines[bars[0] + 1:]).rstrip()
    assert summary.startswith(f"hvdtrain: done: {steps} steps in ") and "tokens/s" in summary, shown
    assert f"run folder {out}, model in {out / 'hf'}" in summary, shown
    return lines


def terminal_screen(text: str, columns: int) -> list[str]:
    """The lines a terminal shows for `text`: carriage returns, line feeds, wrapping at `columns`,
    and the cursor-up and erase-line sequences that tqdm writes."""
    screen, row, col = [[]], 0, 0
    for token in re.findall(r"\x1b\[(\d*)([A-Za-z])|(.)", text, flags=re.S):
        count, command, char = token
        if command == "A":
            row = max(0, row - int(count or 1))
        elif command == "K":
            del screen[row][col:]
        elif command:
            continue  # colours and the like: nothing on the screen moves
        elif char == "\r":
            col = 0
        elif char == "\n":
            row += 1
        elif char >= " ":
            if col == columns:
                row, col = row + 1, 0
            while len(screen) <= row:
                screen.append([])
            line = screen[row]
            line.extend(" " * (col - len(line)))
            line[col:col + 1] = [char]
            col += 1
        while len(screen) <= row:
            screen.append([])
    return ["".join(line).rstrip() for line in screen]
