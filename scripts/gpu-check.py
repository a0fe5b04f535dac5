#!/usr/bin/env python3
"""Every GPU figure issues 15 and 33 ask for, in one call on a lent GPU machine, within a time budget.

The machine (one H200: Python 3.12, torch 2.11 CUDA 13, NCCL from the nvidia-nccl pip wheel,
16 cores) has no network, so what it lacks travels in the git-ignored folder .gpu-carry/:
Horovod's source package (scripts/install.py builds it offline from there), the cp312 wheels
that build needs (cffi, pycparser), datasets (imported by hvdtrain.data, with dill and
multiprocess) and the plain-transformers baseline hf_baseline.py.

  Here, once (PyPI):  python3 scripts/gpu-check.py --prepare    # fill .gpu-carry/, then --dry-run
  Here, before:       python3 scripts/gpu-check.py --dry-run    # every carried file, every command
  There, one call:    the device tool's run with carry [".gpu-carry"] and the command
                      python3 scripts/gpu-check.py --budget 570  (timeout_s 600)

Stages, in order of importance; each gets what is left of the budget (up to its own limit) and
is skipped when less than its minimum is left, so the last ones may not run:
  wheels, imports  the carried wheels, installed offline; hvdtrain and its packages import
  horovod          Horovod built with NCCL by scripts/install.py (cores 2-15), and meanwhile on
                   cores 0-1: hf-eager (hf_baseline.py: plain transformers GPT-2 and BERT-large,
                   eager), then tests (tests/test_loss.py, tests/test_step_timer.py, CUDA cases)
  doctor           hvdtrain doctor
  compare-gpt2     bench compare gpt2-small (B=16, T=1024): hvdtrain vs plain, eager and compiled,
                   and hvdtrain with log.step_breakdown=false (the breakdown's cost)
  compare-bert     bench compare bert-large (B=128, T=128), and hvdtrain with AdamW instead of LAMB
  compare-llama1b  bench compare llama-1b compiled, micro batch 16 x 2048 without activation
                   checkpointing (64 GiB in the plan: the plain loop's logits fit beside it)
  memory-d1        bench memory --copies 1: every sharding level's peak GPU memory against the plan
  train-gpt2       hvdtrain train gpt2-small, 1 GPU, 300 steps on synthetic data: metrics.jsonl
  switches-gpt2    hvdtrain compiled with each speed switch (hvdtrain.models.common.SWITCHES)
  hf-compiled      hf_baseline.py compiled (GPT-2, BERT-large)
A second call with --only NAME,... on the still-warm machine runs the stages the first one skipped
(Horovod stays installed there).
A compare cut short by its time limit still reports the windows it finished.
Everything lands in $OUT (or --out): log.txt (all output), summary.json (every parsed figure),
gpt2-small-metrics.jsonl, hf-eager/bench.json, hf-compiled/bench.json; the last lines printed
are a summary table.

Only the standard library: it runs before anything is installed.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import install  # noqa: E402  (scripts/install.py: the pinned sdist and its checksum, standard library only)

REPO = Path(__file__).resolve().parent.parent
CARRY = REPO / ".gpu-carry"
HOROVOD_SDIST = "cache/build/horovod-0.28.1.tar.gz"  # where install.py --cache-dir CARRY/cache looks
# cp312 wheels the GPU machine lacks: cffi for Horovod's build; datasets, which hvdtrain.data
# imports even for synthetic data, with the two of its requirements missing there.
WHEELS = ["cffi==2.1.1", "pycparser==3.12", "datasets==5.2.0", "dill==0.4.1", "multiprocess==0.70.19"]
HF_BASELINE = "hf_baseline.py"
SHARED_HF_BASELINE = REPO.parent / "shared" / "bench" / HF_BASELINE
MANIFEST = "manifest.json"
CARRY_LIMIT = 60 * 2**20  # the device tool carries 64 MiB with the working tree
PIP_PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]

GPT2 = ["recipes/gpt2-small.yaml", "train.global_batch_size=null", "train.grad_accum=1"]  # B=16 x 1024
BERT = ["recipes/bert-large.yaml", "train.global_batch_size=null", "train.grad_accum=1",
        "train.micro_batch_size=128"]  # B=128 x 128, as hf_baseline.py
# Micro batch 16 x 2048 without activation checkpointing: 64 GiB in `hvdtrain plan recipes/llama-1b.yaml
# --gpus 1 --gpu H200`, room for the plain loop's full-vocabulary logits beside it.
LLAMA = ["recipes/llama-1b.yaml", "train.global_batch_size=null", "train.grad_accum=1",
         "train.micro_batch_size=16", "model.activation_checkpointing=false"]
TRAIN_STEPS = 300


@dataclass
class Stage:
    name: str
    argv: list  # the command, run in the repository
    max_s: int  # its own time limit
    min_s: int  # skipped when less than this is left
    kind: str = "run"  # run | compare | memory | train | hf: what parse() reads from it
    extra: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    beside: list = field(default_factory=list)  # stages run one after another on cores 0-1 meanwhile


def hvdtrain(*args) -> list:
    return [sys.executable, "-m", "hvdtrain.cli", *args]


def stages(carry: Path, out: Path, work: Path) -> list[Stage]:
    run_dir = work / "gpt2-small-run"
    wheels = sorted(str(w) for w in (carry / "wheels").glob("*.whl"))
    hf_eager = Stage("hf-eager", [sys.executable, str(carry / HF_BASELINE), "gpt2", "bertl"], 150, 30, "hf",
                     {"hf_out": out / "hf-eager"})
    tests = Stage("tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_loss.py",
                            "tests/test_step_timer.py"], 150, 20)
    return [
        Stage("wheels", [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", *wheels], 60, 5),
        Stage("imports", [sys.executable, "-c", "import cffi, datasets, torch, transformers, hvdtrain.training.train, "
                          "hvdtrain.tools.bench; print('imports ok: datasets', datasets.__version__)"], 60, 5),
        # Horovod needs no GPU to build: hf_baseline and the tests use it meanwhile, on cores of their own.
        Stage("horovod", [sys.executable, str(REPO / "scripts" / "install.py"), "--no-venv", "--python",
                          sys.executable, "--cache-dir", str(carry / "cache"), "--no-hvdtrain", "--no-apt",
                          "--jobs", str(build_cores())], 300, 60,
              env={"PIP_NO_INDEX": "1", "HOROVOD_BUILD_CUDA_CC_LIST": "90"}, beside=[hf_eager, tests]),
        Stage("doctor", hvdtrain("doctor"), 30, 10),
        Stage("compare-gpt2", hvdtrain("bench", "compare", *GPT2, "--vary", "log.step_breakdown=false",
                                       "--steps", "20", "--windows", "1", "--json"), 200, 60, "compare"),
        Stage("compare-bert", hvdtrain("bench", "compare", *BERT, "--vary", "train.optimizer=adamw",
                                       "--steps", "10", "--windows", "1", "--json"), 170, 60, "compare"),
        Stage("compare-llama1b", hvdtrain("bench", "compare", *LLAMA, "--compile", "on",
                                          "--steps", "4", "--windows", "1", "--json"), 170, 60, "compare"),
        Stage("memory-d1", hvdtrain("bench", "memory", "--copies", "1", "--steps", "2", "--json"), 120, 40, "memory"),
        Stage("train-gpt2", hvdtrain("train", *GPT2, "data.source=synthetic", f"train.max_steps={TRAIN_STEPS}",
                                     "train.warmup_steps=30", "log.every=10", "log.progress=false",
                                     "log.tensorboard=false", "eval.every=100", "eval.batches=4",
                                     "checkpoint.every=0", "checkpoint.resume=false", f"out_dir={run_dir}"),
              240, 45, "train", {"run_dir": run_dir, "copy_to": out / "gpt2-small-metrics.jsonl"}),
        Stage("switches-gpt2", hvdtrain("bench", "compare", *GPT2, "--loops", "hvdtrain", "--compile", "on",
                                        "--vary", "env:HVDTRAIN_LOSS=logits,compiled",
                                        "--vary", "env:HVDTRAIN_COMPILE_SCOPE=body",
                                        "--vary", "env:HVDTRAIN_COMPILE_MODE=reduce-overhead",
                                        "--steps", "20", "--windows", "1", "--json"), 300, 60, "compare"),
        Stage("hf-compiled", [sys.executable, str(carry / HF_BASELINE), "gpt2c", "bertlc"], 240, 60, "hf",
              {"hf_out": out / "hf-compiled"}),
    ]


def build_cores() -> int:
    return max(1, len(os.sched_getaffinity(0)) - 2)


# ---------------------------------------------------------------- the carried files

def wheel_file_ok(name: str) -> bool:
    """A wheel pip installs on CPython 3.12 x86-64 Linux: cp312, abi3 or pure Python."""
    tags = name[:-len(".whl")].split("-")[-3:]
    python, abi, platform = tags
    return (("cp312" in python.split(".") or python.startswith("py3") or abi == "abi3")
            and (platform == "any" or "x86_64" in platform) and ("manylinux" in platform or platform == "any"))


def expected_files(carry: Path) -> list[Path]:
    """What the call needs from the carry folder, as the manifest lists it (and the manifest)."""
    return [carry / HOROVOD_SDIST, carry / HF_BASELINE]


def dry_run(carry: Path, pinned_sha256: str | None = None) -> list[str]:
    """Problems that would spoil the call, one line each; [] when it is ready."""
    problems = []
    manifest_path = carry / MANIFEST
    if not manifest_path.is_file():
        return [f"{manifest_path}: missing (run: python3 scripts/gpu-check.py --prepare)"]
    manifest = json.loads(manifest_path.read_text())
    for path in expected_files(carry):
        if str(path.relative_to(carry)) not in manifest:
            problems.append(f"{path}: not in {MANIFEST}")
    wheel_names = [name for name in manifest if name.startswith("wheels/")]
    for requirement in WHEELS:
        project, version = requirement.split("==")
        prefix = f"wheels/{project.replace('-', '_')}-{version}-"
        if not any(name.startswith(prefix) for name in wheel_names):
            problems.append(f"{carry / 'wheels'}: no wheel {requirement}")
    total = 0
    for name, digest in manifest.items():
        path = carry / name
        if not path.is_file():
            problems.append(f"{path}: missing")
            continue
        total += path.stat().st_size
        if install.sha256(path) != digest:
            problems.append(f"{path}: sha256 differs from {MANIFEST} (damaged or replaced)")
        if name.startswith("wheels/") and not wheel_file_ok(path.name):
            problems.append(f"{path}: not installable on CPython 3.12 x86-64 Linux")
    sdist = carry / HOROVOD_SDIST
    if sdist.is_file() and install.sha256(sdist) != (pinned_sha256 or install.HOROVOD_SHA256):
        problems.append(f"{sdist}: sha256 is not the one scripts/install.py pins (it would try to download)")
    if total > CARRY_LIMIT:
        problems.append(f"{carry}: {total / 2**20:.1f} MiB, over the {CARRY_LIMIT // 2**20} MiB that can travel")
    return problems


def check_commands(carry: Path) -> list[str]:
    """Each hvdtrain command of the call parses and its recipe loads, here (no GPU needed)."""
    sys.path.insert(0, str(REPO))
    try:
        from hvdtrain.cli import build_parser
        from hvdtrain.config import load_config
        from hvdtrain.errors import UserError
    except ImportError as e:
        return [f"cannot check the commands without hvdtrain's packages ({e}): run this with .venv/bin/python"]

    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        for stage in stages(carry, Path(tmp), Path(tmp)):
            if stage.name == "horovod":  # scripts/install.py still takes every option given to it
                usage = subprocess.run([sys.executable, stage.argv[1], "--help"], capture_output=True, text=True).stdout
                problems += [f"horovod: scripts/install.py has no option {option}" for option in stage.argv[2:]
                             if option.startswith("--") and option not in usage]
            if stage.argv[1:3] != ["-m", "hvdtrain.cli"]:
                continue
            args, extra = build_parser().parse_known_args(stage.argv[3:])
            if extra and not all("=" in e and not e.startswith("-") for e in extra):
                problems.append(f"{stage.name}: unknown arguments {extra}")
            if getattr(args, "config", None):
                try:
                    load_config(args.config, [*args.overrides, *extra])
                except UserError as e:
                    problems.append(f"{stage.name}: {e}")
    return problems


def prepare(carry: Path, hf_baseline: Path) -> int:
    """Fill the carry folder (needs PyPI) and write its manifest of sha256 sums."""
    (carry / "wheels").mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", *PIP_PLATFORM,
                    "-d", str(carry / "wheels"), *WHEELS], check=True)
    sdist = carry / HOROVOD_SDIST
    sdist.parent.mkdir(parents=True, exist_ok=True)
    cached = Path.home() / ".cache" / "hvdtrain" / "build" / sdist.name  # what `make setup` downloaded
    if not sdist.is_file():
        if cached.is_file():
            shutil.copyfile(cached, sdist)
        else:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                            "horovod==0.28.1", "-d", str(sdist.parent)], check=True)
    if not hf_baseline.is_file():
        raise SystemExit(f"{hf_baseline}: missing (give --hf-baseline PATH)")
    shutil.copyfile(hf_baseline, carry / HF_BASELINE)
    wanted = {f"{w.split('==')[0].replace('-', '_')}-{w.split('==')[1]}-" for w in WHEELS}
    files = [p for p in expected_files(carry)] + [p for p in sorted((carry / "wheels").glob("*.whl"))
                                                  if any(p.name.startswith(w) for w in wanted)]
    manifest = {str(p.relative_to(carry)): install.sha256(p) for p in files}
    (carry / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(f"gpu-check: {carry} holds {len(manifest)} files, "
          f"{sum(p.stat().st_size for p in files) / 2**20:.1f} MiB")
    return 0


# ---------------------------------------------------------------- running the stages there

class Runner:
    BESIDE_CORES = {0, 1}

    def __init__(self, carry: Path, out: Path, budget: float, env: dict):
        self.carry, self.out, self.env = carry, out, env
        self.deadline = time.monotonic() + budget
        self.log = open(out / "log.txt", "a", buffering=1)
        self.lock = threading.Lock()
        self.results = {}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, text: str):
        with self.lock:
            print(text, flush=True)
            self.log.write(text + "\n")

    def start(self, argv: list, cores: set | None = None, env: dict | None = None) -> subprocess.Popen:
        self.say(f"$ {' '.join(str(a) for a in argv)}")
        cores = cores & os.sched_getaffinity(0) if cores else None
        preexec = (lambda: os.sched_setaffinity(0, cores)) if cores else None
        return subprocess.Popen([str(a) for a in argv], cwd=REPO, env=dict(self.env, **(env or {})),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=preexec,
                                start_new_session=True)

    def finish(self, proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
        """(status, output): ok, failed (exit N) or timeout (killed with its children)."""
        try:
            output, _ = proc.communicate(timeout=max(1.0, timeout))
            status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            output, _ = proc.communicate()
            status = "timeout"
        with self.lock:
            self.log.write(output or "")
        return status, output or ""

    def run(self, stage: Stage, reserve: float = 10.0, cores: set | None = None):
        """Run `stage` in what is left of the budget (and its beside stages meanwhile)."""
        left = self.left() - reserve
        if left < stage.min_s:
            self.record(stage, {"status": f"skipped ({max(0, left):.0f} s left, needs {stage.min_s})"})
            return
        timeout = min(stage.max_s, left)
        self.say(f"== {stage.name} (up to {timeout:.0f} s)")
        beside = None
        if stage.beside:
            beside = threading.Thread(target=lambda: [self.run(b, reserve, self.BESIDE_CORES) for b in stage.beside])
            beside.start()
            cores = set(range(len(self.BESIDE_CORES), os.cpu_count() or 1))
        started = time.monotonic()
        if stage.kind == "hf":
            stage.extra["hf_out"].mkdir(parents=True, exist_ok=True)
        status, output = self.finish(self.start(stage.argv, cores, dict(stage.env, **(
            {"OUT": str(stage.extra["hf_out"])} if stage.kind == "hf" else {}))), timeout)
        self.record(stage, {"status": status, "seconds": round(time.monotonic() - started, 1), **parse(stage, output)})
        if beside is not None:
            beside.join(max(1.0, self.left()))

    def record(self, stage: Stage, result: dict):
        with self.lock:
            self.results[stage.name] = result
            (self.out / "summary.json").write_text(json.dumps(self.results, indent=1) + "\n")
        self.say(f"== {stage.name}: {result['status']}" + (f" in {result['seconds']} s" if "seconds" in result else ""))


def parse(stage: Stage, output: str) -> dict:
    """The figures a stage printed or wrote."""
    lines = [line for line in output.splitlines() if line.strip()]
    if stage.kind in ("compare", "memory"):
        for line in reversed(lines):
            if line.startswith("{"):
                try:
                    return {"result" if stage.kind == "compare" else "memory": json.loads(line)}
                except json.JSONDecodeError:
                    break
        return {}
    if stage.kind == "train":
        path = Path(stage.extra["run_dir"]) / "metrics.jsonl"
        if not path.is_file():
            return {}
        shutil.copyfile(path, stage.extra["copy_to"])
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        train = [r for r in records if "tokens_per_s" in r]
        steady = train[1:] or train  # the first interval includes compilation
        keys = ["tokens_per_s", "mfu"] + [k for k in (train[-1] if train else {}) if k.startswith("time_")]
        return {"records": len(train), "steps": train[-1]["step"] if train else 0,
                "mean": {k: sum(r[k] for r in steady) / len(steady) for k in keys if all(k in r for r in steady)},
                "evals": [{k: r[k] for k in ("step", "eval_loss")} for r in records if "eval_loss" in r]}
    if stage.kind == "hf":
        path = Path(stage.extra["hf_out"]) / "bench.json"
        return {"hf": json.loads(path.read_text())} if path.is_file() else {}
    if stage.name == "doctor":
        return {"verdict": next((line for line in lines if line.startswith("verdict")), None)}
    return {"last_line": lines[-1] if lines else None}


def machine_env(carry: Path, work: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PIP_FIND_LINKS=str(carry / "wheels"), HVDTRAIN_CACHE=str(work / "cache"))
    # Horovod links libnccl.so from the nvidia-nccl wheel: its folder must be found at run time.
    probe = subprocess.run([sys.executable, "-c", "import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])"],
                           capture_output=True, text=True)
    if probe.returncode == 0 and probe.stdout.strip():
        lib = str(Path(probe.stdout.strip()) / "lib")
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [lib, os.environ.get("LD_LIBRARY_PATH")]))
    # Checkpoints of each benchmark window (gigabytes for BERT-large) go to memory when it is big.
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 32 * 2**30:
        env["TMPDIR"] = str(shm)
    return env


def summary_table(results: dict) -> list[str]:
    lines = ["", "stage            status                          seconds"]
    for name, r in results.items():
        lines.append(f"{name:<17}{r['status']:<32}{r.get('seconds', '')}")
    for name, r in results.items():
        result = r.get("result")
        if result:
            lines.append(f"-- {name}: {result['device_name']}, global batch {result['global_batch']} x "
                         f"{result['seq_len']}, peak {result['peak_tflops']} TFLOP/s"
                         + ("" if result.get("complete") else " (cut short: the windows it finished)"))
            for side in result["sides"]:
                if side["median_tokens_per_s"] is None:
                    lines.append(f"   {side['side']:<52}failed: {side['error']}")
                    continue
                mfu = f"{side['mfu']:.1%}" if side["mfu"] is not None else "-"
                lines.append(f"   {side['side']:<52}{side['median_tokens_per_s']:>11,.0f} tok/s "
                             f"{side['median_sequences_per_s']:>9,.1f} seq/s  MFU {mfu:>6}  "
                             f"{side['peak_memory_bytes'] / 2**30:6.2f} GiB")
            for ratio in result["ratios"]:
                lines.append(f"   ratio {ratio['side']} / {ratio['reference']}: {ratio['ratio']:.3f}")
        if r.get("memory"):
            lines.append(f"-- {name}: per level at d=1, peak (plan) and optimizer state (plan), MiB")
            for row in r["memory"]["rows"]:
                p = row["predicted"]
                lines.append(f"   {row['level']:<12}{row['peak_bytes'] / 2**20:>10.1f} ({p['peak_bytes'] / 2**20:.1f}) "
                             f"{row['optimizer_bytes'] / 2**20:>10.1f} ({p['optimizer_bytes'] / 2**20:.1f})")
        if "mean" in r:
            m = r["mean"]
            lines.append(f"-- {name}: {r['steps']} steps, mean after the first interval: "
                         f"{m.get('tokens_per_s', 0):,.0f} tok/s, MFU {m.get('mfu', 0):.1%}; evals {r['evals']}")
        if "hf" in r:
            lines.append(f"-- {name} hf_baseline: " + ", ".join(f"{k} {v}" for k, v in r["hf"].items()
                                                               if k.endswith((".tokens_per_s", ".mfu_vs_989"))))
        if r.get("verdict") or r.get("last_line"):
            lines.append(f"-- {name}: {r.get('verdict') or r.get('last_line')}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prepare", action="store_true", help="here: fill the carry folder (PyPI), then --dry-run")
    parser.add_argument("--dry-run", action="store_true", help="here: check the carried files and the commands")
    parser.add_argument("--carry", default=str(CARRY), help=f"the carried folder (default {CARRY})")
    parser.add_argument("--hf-baseline", default=str(SHARED_HF_BASELINE), help="hf_baseline.py to carry")
    parser.add_argument("--budget", type=float, default=570, help="seconds for all stages (default 570)")
    parser.add_argument("--only", default=None, help="comma-separated stage names to run (default all)")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="results folder (default $OUT)")
    args = parser.parse_args()
    carry = Path(args.carry).resolve()

    if args.prepare:
        prepare(carry, Path(args.hf_baseline))
    if args.prepare or args.dry_run:
        problems = dry_run(carry) + check_commands(carry)
        for line in problems:
            print(f"gpu-check: {line}", file=sys.stderr)
        if not problems:
            where = carry.relative_to(REPO) if carry.is_relative_to(REPO) else carry
            print(f"gpu-check: ready. Device tool: run with carry [\"{where}\"], timeout_s "
                  f"{min(600, int(args.budget) + 30)}, command: python3 scripts/gpu-check.py --budget {int(args.budget)}")
        return 1 if problems else 0

    if not args.out:
        raise SystemExit("gpu-check: no results folder: set OUT or give --out")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    runner = Runner(carry, out, args.budget, machine_env(carry, work))
    problems = dry_run(carry)
    runner.say("gpu-check: carried files " + ("ok" if not problems else "PROBLEMS: " + "; ".join(problems)))
    for argv in (["nvidia-smi", "-L"], [sys.executable, "-c", "import torch, transformers; print('torch', "
                 "torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"]):
        if shutil.which(argv[0]) or argv[0] == sys.executable:
            runner.say(runner.finish(runner.start(argv), 30)[1].strip())
    chosen = args.only.split(",") if args.only else None
    for stage in stages(carry, out, work):
        if chosen is None:
            runner.run(stage)
        elif stage.name in chosen:
            stage.beside = [b for b in stage.beside if b.name in chosen]
            runner.run(stage)
        else:
            for b in stage.beside:
                if b.name in chosen:
                    runner.run(b)
    for line in summary_table(runner.results):
        runner.say(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
