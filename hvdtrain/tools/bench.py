"""`hvdtrain bench`: how fast hvdtrain runs, against what the hardware and PyTorch allow.

  hvdtrain bench compare [CONFIG] [overrides]         hvdtrain's training step vs a plain
        [--compile off,on] [--vary KEY=A,B]           transformers loop on the recipe's model and
                                                      synthetic data, one worker, in one process:
                                                      tokens/s, MFU, peak memory, ratios
  hvdtrain bench overhead [CONFIG] [overrides]        the same, eager only (the loop's overhead)
  hvdtrain bench scaling CONFIG --np 1,2 [overrides]  throughput and scaling efficiency with N
                                                      local workers (each on one thread)
  hvdtrain bench allreduce [-np N] [--sizes 1K,..]    Horovod allreduce bandwidth per message size
  hvdtrain bench memory [CONFIG] [--copies 1,2,4]     optimizer state and peak memory per worker,
                                                      sharded and not, against `hvdtrain plan`

Every number comes from real runs of the real code: `compare` and `overhead` call
hvdtrain.training.train.train() and read the throughput it logs, `scaling` runs `hvdtrain launch`,
`allreduce` times hvd.allreduce in workers started by horovodrun the way `hvdtrain launch`
starts them.
"""
import contextlib
import gc
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hvdtrain.models import flops
from hvdtrain.launching import launch
from hvdtrain.observe import metrics
from hvdtrain.tools import report
from hvdtrain.tools.bench_common import RESULT_TAG, parse_ints, proc_status_bytes
from hvdtrain.config import Config, load_config, resolve_batch
from hvdtrain.errors import UserError
from hvdtrain.models import family

# torch, Horovod and the modules that import them are imported by the commands that need them:
# the CLI imports this module to list its subcommands, and `hvdtrain --help` should not wait for
# torch, nor `hvdtrain doctor` fail when Horovod is broken.

DEFAULT_RECIPE = "recipes/gpt-tiny.yaml"


# ---------------------------------------------------------------- compare (and overhead)
#
# `compare` runs sides in one process, in alternating windows (A B C, C B A, A B C ...), so that
# load from other processes and the GPU's clocks hit every side alike; each side reports its
# median window. A side is a loop, a compile setting and optional variations:
#   hvdtrain: hvdtrain.training.train.train() itself, the code `hvdtrain train` runs, one call per window,
#             its throughput read from the metrics it logs;
#   plain:    the obvious transformers loop on the same model and batches (model(**batch).loss,
#             torch.compile of the whole model, fused AdamW on a GPU): what a user would write.
# `overhead` is `compare` of the two loops, not compiled.

@dataclass
class Side:
    loop: str  # "hvdtrain" or "plain"
    compiled: bool
    variation: str | None = None  # a config override "key=value" or an environment switch "env:NAME=value"

    @property
    def label(self) -> str:
        return " ".join([self.loop, "compiled" if self.compiled else "eager"] + ([self.variation] if self.variation else []))

    def overrides(self) -> list[str]:
        """Config overrides of this side (after the user's)."""
        own = [self.variation] if self.variation and not self.variation.startswith("env:") else []
        return [f"model.compile={str(self.compiled).lower()}", *own]

    def env(self) -> dict:
        if self.variation and self.variation.startswith("env:"):
            name, value = self.variation[len("env:"):].split("=", 1)
            return {name: value}
        return {}


def parse_variations(texts: list[str], config: str, overrides: list[str]) -> list[str]:
    """--vary KEY=A,B (config keys, checked now) or env:NAME=A,B -> ["KEY=A", "KEY=B", ...]."""
    out = []
    for text in texts:
        key, sep, values = text.partition("=")
        if not sep or not key or not values:
            raise UserError(f"--vary '{text}': expected KEY=VALUE[,VALUE...] or env:NAME=VALUE[,VALUE...]")
        for value in values.split(","):
            if key.startswith("env:"):
                from hvdtrain.models.common import SWITCHES
                name = key[len("env:"):]
                if name in SWITCHES and value not in SWITCHES[name]:
                    raise UserError(f"--vary '{text}': {name} takes {', '.join(SWITCHES[name])}")
            else:
                load_config(config, [*overrides, f"{key}={value}"])  # an unknown key or bad value: one line
            out.append(f"{key}={value}")
    return out


def parse_compile_modes(text: str) -> list[bool]:
    """--compile off / on / off,on: the modes each loop runs in."""
    try:
        return [{"off": False, "on": True}[m.strip()] for m in text.split(",")]
    except KeyError:
        raise UserError(f"--compile: expected off, on or off,on, got '{text}'") from None


def compare_sides(loops: list[str], compile_modes: list[bool], variations: list[str]) -> list[Side]:
    sides = []
    for compiled in compile_modes:
        if "hvdtrain" in loops:
            sides += [Side("hvdtrain", compiled)] + [Side("hvdtrain", compiled, v) for v in variations]
        if "plain" in loops:
            sides.append(Side("plain", compiled))
    return sides


def side_ratios(sides: list[Side]) -> list[tuple[Side, Side]]:
    """(candidate, reference) pairs: hvdtrain over the plain loop, and hvdtrain over each of its
    variations (for log.step_breakdown=false: the breakdown's cost, on over off)."""
    pairs = []
    for base in (s for s in sides if s.loop == "hvdtrain" and s.variation is None):
        plain = [s for s in sides if s.loop == "plain" and s.compiled == base.compiled]
        mine = [s for s in sides if s.loop == "hvdtrain" and s.compiled == base.compiled]
        pairs += [(s, p) for s in mine for p in plain] + [(base, s) for s in mine if s.variation]
    return pairs


def reset_peak_memory(device) -> int:
    """Starts a window's peak-memory count; returns what is allocated now (the baseline)."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    try:  # Linux: "5" resets the process's peak resident size (VmHWM) to the current one
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return proc_status_bytes("VmRSS")


def peak_memory(device, baseline: int) -> int:
    """Memory the window added at its peak: torch.cuda.max_memory_allocated on a GPU, the
    resident set size (RSS) on a CPU."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) - baseline
    return proc_status_bytes("VmHWM") - baseline


@contextlib.contextmanager
def environment(values: dict):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def plain_window(cfg: Config, data, steps: list[list[dict]], device, compiled: bool) -> float:
    """Tokens/s of the obvious transformers loop over `steps` (lists of micro batches already on
    the device), timed over the second half: the first half warms up (and compiles) as
    hvdtrain's first log interval does. The same model (hvdtrain.models.common.build_model), batches,
    precision, accumulation and clipping as hvdtrain; the loss is the model's own (mean over
    the targets, the whole vocabulary projection for every position, BERT included)."""
    import torch

    from hvdtrain.models.common import build_model

    t = cfg.train
    torch.manual_seed(t.seed)
    model = build_model(cfg.model, data.vocab, cfg.data.seq_len).to(device)
    model.train()
    net = torch.compile(model) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=tuple(t.betas), eps=t.eps,
                                  weight_decay=t.weight_decay, fused=device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16 if t.precision == "bf16" else torch.float16,
                              enabled=t.precision != "fp32")
    scaler = torch.amp.GradScaler(device.type, enabled=t.precision == "fp16")
    causal = family(cfg.model.arch).causal

    def step(micro_batches):
        for mb in micro_batches:
            with autocast:  # GPT-2 shifts its labels itself: they are the inputs
                loss = net(input_ids=mb["input_ids"], labels=mb["input_ids"] if causal else mb["labels"]).loss
            scaler.scale(loss / len(micro_batches)).backward()
        if t.grad_clip > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    half = len(steps) // 2
    for micro_batches in steps[:half]:
        step(micro_batches)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for micro_batches in steps[half:]:
        step(micro_batches)
    if device.type == "cuda":
        torch.cuda.synchronize()
    tokens = sum(mb["input_ids"].numel() for micro_batches in steps[half:] for mb in micro_batches)
    return tokens / (time.perf_counter() - start)


def hvdtrain_window(config: str, overrides: list[str], out_dir: Path, steps: int) -> tuple[float, dict]:
    """Tokens/s of hvdtrain.training.train.train() over 2 x `steps` steps, from its second log record
    (the first one includes start-up), and that record's step-time breakdown. Its console
    output is dropped: only the numbers matter."""
    from hvdtrain.training.train import train

    cfg = load_config(config, [*overrides, f"out_dir={out_dir}", f"train.max_steps={2 * steps}",
                               f"log.every={steps}", "log.progress=false", "log.tensorboard=false",
                               "checkpoint.resume=false", "checkpoint.every=0", "eval.every=0", "eval.batches=1"])
    output = io.StringIO()
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            train(cfg)
    except BaseException:
        sys.stderr.write(output.getvalue()[-5000:])  # what train() said before it failed
        raise
    record = metrics.read_metrics(out_dir)[0][-1]
    breakdown = {k: record[k] for k in [f"time_{p}" for p in metrics.PHASES] + ["time_step"] if k in record}
    return record["tokens_per_s"], breakdown


def compare_batches(cfg: Config, data, device, steps: int) -> list[list[dict]]:
    """The micro batches of hvdtrain's first 2 x `steps` steps on one worker, on the device."""
    import torch

    from hvdtrain.data.sampler import StreamSampler

    grad_accum, global_batch = resolve_batch(cfg, 1)
    sampler = StreamSampler(len(data.train), global_batch, grad_accum, 0, 1, cfg.train.seed,
                            max_steps=2 * steps)
    micro = [{k: v.to(device) for k, v in data.collate([data.train[key] for key in keys]).items()
              if torch.is_tensor(v)} for keys in sampler]
    return [micro[i:i + grad_accum] for i in range(0, len(micro), grad_accum)]


def flops_and_peak(cfg: Config, data, device) -> tuple[float | None, float | None, str]:
    """FLOPs per token of the model as built (on the meta device: no memory, no time) and the
    device's peak TFLOP/s for the recipe's precision (log.peak_tflops overrides; none on a CPU)."""
    import torch

    from hvdtrain.models.common import model_blueprint

    dims = flops.built_model_dims(model_blueprint(cfg.model, data.vocab, cfg.data.seq_len).model.config)
    per_token = flops.model_flops_per_token(cfg, dims) if dims else None
    if cfg.log.peak_tflops is not None:
        return per_token, cfg.log.peak_tflops, "log.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak, source = flops.peak_tflops(name, cfg.train.precision)
        return per_token, peak, f"{name}: {source}"
    return per_token, None, "CPU: no peak"


def raise_compile_cache_limits():
    """Every window builds new models; let the compiler keep their compiled code rather than
    fall back to eager after its default number of recompilations."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 1024))


def run_compare(args) -> int:
    # Every argument is checked before torch loads (seconds), so a mistake is told at once.
    if args.steps < 1 or args.windows < 1:
        raise UserError(f"--steps ({args.steps}) and --windows ({args.windows}) must be >= 1")
    config, overrides = args.config, args.overrides
    if config is not None and "=" in config and not Path(config).is_file():
        config, overrides = None, [config, *overrides]  # no CONFIG given, only overrides
    config = config or DEFAULT_RECIPE
    overrides = ["data.source=synthetic", *overrides]  # the recipe's model on synthetic data
    loops = [loop.strip() for loop in args.loops.split(",")]
    if not loops or set(loops) - {"hvdtrain", "plain"}:
        raise UserError(f"--loops: expected hvdtrain, plain or both, got '{args.loops}'")
    cfg = load_config(config, overrides)
    variations = parse_variations(args.vary, config, overrides)
    if variations and "hvdtrain" not in loops:
        raise UserError("--vary changes the hvdtrain loop: keep it in --loops")
    compile_modes = parse_compile_modes(args.compile) if args.compile else None

    import torch

    from hvdtrain.parallel import distributed
    from hvdtrain.data import build_data

    world = distributed.init(cfg)  # first, so both loops run with the thread count hvdtrain sets
    if world.size > 1:
        raise UserError(f"bench {args.benchmark} measures one worker: run it directly, not under horovodrun")
    device = world.device
    compile_modes = compile_modes or ([False, True] if device.type == "cuda" else [False])  # eager and compiled on a GPU
    sides = compare_sides(loops, compile_modes, variations)
    if any(s.compiled for s in sides):
        raise_compile_cache_limits()

    grad_accum, global_batch = resolve_batch(cfg, 1)
    data = build_data(cfg, cfg.train.seed)
    flops_per_token, peak, peak_source = flops_and_peak(cfg, data, device)
    steps = compare_batches(cfg, data, device, args.steps) if "plain" in loops else None

    runs = {s.label: [] for s in sides}
    failed = {}  # side label -> its error: a side that fails (say a compile mode) leaves the others

    def result(complete: bool) -> dict:
        rows = [side_row(side, runs[side.label], failed.get(side.label), cfg, flops_per_token, peak)
                for side in sides]
        by_label = {r["side"]: r for r in rows if r["tokens_per_s"]}
        ratios = [{"side": a.label, "reference": b.label,
                   "ratio": by_label[a.label]["median_tokens_per_s"] / by_label[b.label]["median_tokens_per_s"],
                   "pair_ratios": [x / y for x, y in zip(by_label[a.label]["tokens_per_s"],
                                                         by_label[b.label]["tokens_per_s"])]}
                  for a, b in side_ratios(sides) if a.label in by_label and b.label in by_label]
        return {"benchmark": args.benchmark, "complete": complete, "config": config, "overrides": overrides,
                "device": str(device),
                "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "torch": torch.__version__, "threads": torch.get_num_threads(), "steps_per_window": args.steps,
                "windows": args.windows, "global_batch": global_batch, "grad_accum": grad_accum,
                "seq_len": cfg.data.seq_len, "precision": cfg.train.precision, "flops_per_token": flops_per_token,
                "peak_tflops": peak, "peak_source": peak_source, "sides": rows, "ratios": ratios}

    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as tmp:
        for window in range(args.windows):
            for side in sides if window % 2 == 0 else sides[::-1]:
                if side.label in failed:
                    continue
                out_dir = Path(tmp) / f"{window}-{side.label.replace(' ', '_')}"
                try:
                    runs[side.label].append(compare_window(side, config, overrides, cfg, data, steps, device,
                                                           out_dir, args.steps))
                except Exception as e:  # noqa: BLE001 - reported with the results
                    failed[side.label] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                    print(f"hvdtrain bench: {side.label} failed: {failed[side.label]}", file=sys.stderr, flush=True)
                finally:
                    shutil.rmtree(out_dir, ignore_errors=True)  # checkpoints: gigabytes for big models
                    gc.unfreeze()  # train() froze the objects alive at its start, this loop's included
                    gc.collect()
                if args.json:  # so far, as one line: a run stopped by a time limit still has these
                    print(json.dumps(result(complete=False)), flush=True)
    if args.json:
        print(json.dumps(result(complete=True)))
    else:
        print_compare(result(complete=True))
    return 1 if failed else 0


def compare_window(side: Side, config: str, overrides: list[str], cfg: Config, data, steps, device, out_dir: Path,
                   n_steps: int) -> dict:
    """One timing window of one side: tokens/s, the memory it added at its peak, and for
    hvdtrain the step-time breakdown it logged."""
    with environment(side.env()):
        baseline = reset_peak_memory(device)
        breakdown = None
        if side.loop == "hvdtrain":
            rate, breakdown = hvdtrain_window(config, [*overrides, *side.overrides()], out_dir, n_steps)
        else:
            rate = plain_window(cfg, data, steps, device, side.compiled)
        return {"tokens_per_s": rate, "peak_memory_bytes": peak_memory(device, baseline), "breakdown": breakdown}


def side_row(side: Side, windows: list[dict], error: str | None, cfg: Config, flops_per_token, peak) -> dict:
    rates = [w["tokens_per_s"] for w in windows]
    median = statistics.median(rates) if rates else None
    return {"side": side.label, "loop": side.loop, "compiled": side.compiled, "variation": side.variation,
            "error": error, "tokens_per_s": rates, "median_tokens_per_s": median,
            "median_sequences_per_s": median / cfg.data.seq_len if rates else None,
            "mfu": flops.mfu(median, flops_per_token, peak) if rates and peak and flops_per_token else None,
            "peak_memory_bytes": max(w["peak_memory_bytes"] for w in windows) if windows else None,
            "breakdown": sorted(windows, key=lambda w: w["tokens_per_s"])[len(windows) // 2]["breakdown"]
            if windows else None}


def print_compare(result: dict):
    print(f"{result['benchmark']}: {result['config']} {' '.join(result['overrides'])}\n  {result['device_name']}, "
          f"torch {result['torch']}, 1 worker ({result['threads']} threads), {result['precision']}, global batch "
          f"{result['global_batch']} x {result['seq_len']} tokens (accumulation {result['grad_accum']}); "
          f"{result['windows']} alternating windows of {result['steps_per_window']} timed steps (after as many "
          f"warm-up steps); MFU peak: {result['peak_tflops'] or 'none'} ({result['peak_source']})")
    width = max(len(r["side"]) for r in result["sides"]) + 2
    print(f"{'side':<{width}}{'tokens/s':>12}{'seq/s':>10}{'MFU':>8}{'peak mem':>11}   windows (tokens/s)")
    for r in result["sides"]:
        if not r["tokens_per_s"]:
            print(f"{r['side']:<{width}}failed: {r['error']}")
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        print(f"{r['side']:<{width}}{r['median_tokens_per_s']:>12,.0f}{r['median_sequences_per_s']:>10,.1f}{mfu:>8}"
              f"{r['peak_memory_bytes'] / 2**30:>7.2f} GiB   {' '.join(f'{v:,.0f}' for v in r['tokens_per_s'])}"
              + (f"  (then failed: {r['error']})" if r["error"] else ""))
    for r in result["ratios"]:
        print(f"ratio {r['side']} / {r['reference']}: {r['ratio']:.3f} (within pairs of windows "
              f"{min(r['pair_ratios']):.3f} to {max(r['pair_ratios']):.3f})")


def run_overhead(args) -> int:
    """hvdtrain's loop against the plain loop, eager: `compare --loops hvdtrain,plain --compile off`."""
    args.loops, args.compile, args.vary = "hvdtrain,plain", "off", []
    return run_compare(args)


# ---------------------------------------------------------------- scaling

def scaling_run(n: int, args, out_dir: Path) -> dict:
    """One `hvdtrain launch -np n` run; its throughput and timings after the first log interval."""
    # The per-worker batch stays fixed (weak scaling, as Horovod's synthetic benchmark) at the
    # recipe's batch for one worker: its micro batch and the accumulation it has at world size 1.
    grad_accum, _ = resolve_batch(load_config(args.config, args.overrides), 1)
    fixed = ["train.global_batch_size=null", f"train.grad_accum={grad_accum}", f"train.max_steps={args.steps}", f"log.every={args.log_every}",
             "log.step_breakdown=true", "log.progress=false", "checkpoint.every=0", "checkpoint.resume=false",
             "eval.every=0", f"out_dir={out_dir}"]
    cmd = [sys.executable, "-m", "hvdtrain.cli", "launch", "-np", str(n), args.config, *args.overrides, *fixed]
    print(f"OMP_NUM_THREADS={args.threads} hvdtrain {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)), capture_output=True,
                          text=True)
    if proc.returncode:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(proc.returncode)
    measured = report.steady(metrics.read_metrics(out_dir)[0])
    step = report.time_mean(measured, lambda r: r["time_step"])
    return {"tokens_per_s": report.rate(measured, "tokens_per_s"), "time_step": step,
            "comm_share": report.time_mean(measured, lambda r: r["time_allreduce"]) / step,
            "load_average": os.getloadavg()[0]}


def run_scaling(args) -> int:
    worlds = sorted(set(parse_ints(args.np, "--np")))
    load_config(args.config, args.overrides)  # a bad config fails here, not in every worker
    if args.steps <= args.log_every or args.repeats < 1:
        raise UserError(f"--steps ({args.steps}) must exceed --log-every ({args.log_every}), as the first log "
                        f"interval is warm-up and not measured, and --repeats ({args.repeats}) must be >= 1")
    # Repeats go round the world sizes (1 2 1 2 ...) so that load from other processes on a
    # shared machine hits every size alike; each size then reports its median run.
    runs = {n: [] for n in worlds}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for n in worlds:
                runs[n].append(scaling_run(n, args, Path(tmp) / f"np{n}-{repeat}"))
    rows = []
    for n in worlds:
        row = {key: statistics.median(r[key] for r in runs[n]) for key in runs[n][0]}
        row.update(np=n, tokens_per_s_per_worker=row["tokens_per_s"] / n, runs=[r["tokens_per_s"] for r in runs[n]],
                   load_average=max(r["load_average"] for r in runs[n]))
        rows.append(row)
    base = rows[0]
    for row in rows:  # throughput(N) / (N / N0 x throughput(N0)); N0 is normally 1
        row["efficiency"] = row["tokens_per_s"] / (base["tokens_per_s"] * row["np"] / base["np"])

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot_scaling(rows, out / "scaling.png")
    if args.json:
        print(json.dumps({"config": args.config, "overrides": args.overrides, "threads": args.threads, "rows": rows}))
        return 0
    print(f"scaling: {args.config} {' '.join(args.overrides)}\n  fixed batch per worker, OMP_NUM_THREADS="
          f"{args.threads}, steps {args.log_every + 1}-{args.steps} measured, median of {args.repeats} runs; "
          f"load avg: the host's highest 1-minute load after a run (above N: other processes competed)")
    print(f"{'workers':>7} {'tokens/s':>10} {'per worker':>11} {'efficiency':>10} {'step ms':>8} "
          f"{'allreduce':>9} {'load avg':>8}   runs (tokens/s)")
    for r in rows:
        print(f"{r['np']:>7} {r['tokens_per_s']:>10,.0f} {r['tokens_per_s_per_worker']:>11,.0f} "
              f"{r['efficiency']:>10.2f} {r['time_step'] * 1e3:>8.1f} {r['comm_share']:>9.1%} "
              f"{r['load_average']:>8.2f}   {' '.join(f'{v:,.0f}' for v in r['runs'])}")
    print(f"plot: {out / 'scaling.png'}")
    return 0


def plot_scaling(rows: list[dict], path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [r["np"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.plot(n, [r["tokens_per_s"] for r in rows], "o-", label="measured")
    left.plot(n, [rows[0]["tokens_per_s"] * k / n[0] for k in n], "--", label="linear")
    left.set(xlabel="workers", ylabel="tokens/s", title="throughput", xticks=n, ylim=(0, None))
    left.legend()
    right.plot(n, [r["efficiency"] for r in rows], "o-")
    right.set(xlabel="workers", ylabel="throughput / (N x 1 worker)", title="scaling efficiency", xticks=n,
              ylim=(0, max(1.1, *(r["efficiency"] + 0.05 for r in rows))))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------- allreduce

UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    """'64K' -> 65536 bytes: a whole number of float32 values."""
    match = re.fullmatch(r"(\d+)([KMG]?)B?", text.strip().upper())
    size = int(match.group(1)) * UNITS[match.group(2)] if match else 0
    if size < 4 or size % 4:
        raise UserError(f"--sizes: '{text}' is not a size in bytes (like 1K, 64M) that holds whole float32 values")
    return size


def run_allreduce(args) -> int:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.np < 1:
        raise UserError(f"-np: expected a number of workers >= 1, got {args.np}")
    cmd = launch.horovodrun_command(args, ["bench", "_allreduce-worker", ",".join(map(str, sizes)),
                                        "--warmup", str(args.warmup), "--repeats", str(args.repeats)])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line.split(RESULT_TAG, 1)[1] for line in proc.stdout.splitlines() if RESULT_TAG in line]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        return proc.returncode or 1
    result = json.loads(lines[0])
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"allreduce: {result['np']} workers, {result['backend']}, float32 sum, in place; mean time of "
          f"{args.repeats} calls after {args.warmup} warm-up calls, averaged over ranks")
    print(f"{'size':>10} {'elements':>10} {'time us':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}")
    for r in result["rows"]:
        print(f"{human_bytes(r['bytes']):>10} {r['bytes'] // 4:>10} {r['time_s'] * 1e6:>10.1f} "
              f"{r['algbw_gbs']:>11.4f} {r['busbw_gbs']:>11.4f}")
    return 0


def human_bytes(n: int) -> str:
    for unit in ("G", "M", "K"):
        if n >= UNITS[unit] and n % UNITS[unit] == 0:
            return f"{n // UNITS[unit]} {unit}iB"
    return f"{n} B"


def run_allreduce_worker(args) -> int:
    """One rank of `bench allreduce`, started by horovodrun; rank 0 prints the result."""
    import horovod.torch as hvd
    import torch

    from hvdtrain.parallel import distributed

    world = distributed.init(Config())
    n = world.size
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        # Zeros summed in place stay zeros: the same tensor serves every call, no allocation
        # is timed, and a sum never overflows.
        x = torch.zeros(size // 4, dtype=torch.float32, device=world.device)
        name = f"bench.allreduce.{size}"
        for _ in range(args.warmup):
            hvd.allreduce_(x, op=hvd.Sum, name=name)
        hvd.barrier()
        start = time.perf_counter()
        for _ in range(args.repeats):
            hvd.allreduce_(x, op=hvd.Sum, name=name)
        if x.is_cuda:
            torch.cuda.synchronize()
        elapsed = (time.perf_counter() - start) / args.repeats
        elapsed = distributed.allreduce_sum([elapsed], name="bench.time")[0] / n
        algbw = size / elapsed / 1e9
        # NCCL-tests' bus bandwidth: a ring allreduce moves 2(N-1)/N of the data over each link,
        # which makes the number comparable with the link's bandwidth whatever N is.
        rows.append({"bytes": size, "time_s": elapsed, "algbw_gbs": algbw, "busbw_gbs": algbw * 2 * (n - 1) / n})
    if world.is_main:
        backend = "NCCL" if world.device.type == "cuda" and hvd.nccl_built() else (
            "Gloo" if hvd.gloo_enabled() else "MPI")
        print(RESULT_TAG + json.dumps({"np": n, "backend": f"{backend} ({world.device.type} tensors)", "rows": rows}),
              flush=True)
    return 0


# ---------------------------------------------------------------- command line

def add_compare_args(p):
    p.add_argument("config", nargs="?", help=f"YAML recipe (default: {DEFAULT_RECIPE}); its data is replaced by "
                                             "synthetic data")
    p.add_argument("overrides", nargs="*", help="dotted overrides such as train.micro_batch_size=4")
    p.add_argument("--steps", type=int, default=5, help="timed steps per window (each also warms up as many)")
    p.add_argument("--windows", type=int, default=5, help="timing windows of each side, alternated")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def add_cli(sub):
    bench = sub.add_parser("bench", help="benchmarks: hvdtrain vs plain PyTorch, scaling, allreduce bandwidth")
    kinds = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")

    p = kinds.add_parser("compare", help="hvdtrain's training step vs a plain transformers loop, and variations")
    add_compare_args(p)
    p.add_argument("--loops", default="hvdtrain,plain", help="hvdtrain, plain or both (default both)")
    p.add_argument("--compile", default=None,
                   help="off, on or off,on: the loops eager and/or compiled (default: off,on on a GPU, off on a CPU)")
    p.add_argument("--vary", action="append", default=[], metavar="KEY=A[,B]",
                   help="also run hvdtrain with each value: a config key (log.step_breakdown=false) or an "
                        "environment switch (env:HVDTRAIN_LOSS=logits); repeatable")
    p.set_defaults(func=run_compare)

    p = kinds.add_parser("overhead", help="hvdtrain's training loop vs a plain loop, eager (compare --compile off)")
    add_compare_args(p)
    p.set_defaults(func=run_overhead)

    p = kinds.add_parser("scaling", help="throughput and scaling efficiency with N local workers")
    launch.add_config_args(p)
    p.add_argument("--np", default="1,2", help="worker counts, comma-separated (default 1,2)")
    p.add_argument("--steps", type=int, default=30, help="steps per run (default 30)")
    p.add_argument("--log-every", type=int, default=10, help="log interval; the first one is not measured")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per worker (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="runs per worker count, alternated (default 3)")
    p.add_argument("--out", default="runs/bench-scaling", help="folder for scaling.png")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run_scaling)

    p = kinds.add_parser("allreduce", help="Horovod allreduce bandwidth over message sizes")
    launch.add_launch_options(p, default_np=2)
    p.add_argument("--sizes", default="1K,4K,16K,64K,256K,1M,4M,16M,64M", help="message sizes in bytes")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per size")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per size")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run_allreduce)

    # Internal (no help, so not listed): what each horovodrun worker of `bench allreduce` runs.
    p = kinds.add_parser("_allreduce-worker")
    p.add_argument("sizes", help="sizes in bytes, comma-separated")
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--repeats", type=int, required=True)
    p.set_defaults(func=run_allreduce_worker)

    # `bench pipeline` and `bench memory` live in their own modules (imported here: they import this one).
    from hvdtrain.tools import bench_memory, bench_pipeline
    bench_pipeline.add_cli(kinds)
    bench_memory.add_cli(kinds)
