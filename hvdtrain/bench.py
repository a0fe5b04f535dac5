"""`hvdtrain bench`: how fast hvdtrain runs, against what the hardware and PyTorch allow.

  hvdtrain bench overhead [CONFIG] [overrides]        hvdtrain's training loop vs a bare PyTorch
                                                      loop, one worker, in one process
  hvdtrain bench scaling CONFIG --np 1,2 [overrides]  throughput and scaling efficiency with N
                                                      local workers (each on one thread)
  hvdtrain bench allreduce [-np N] [--sizes 1K,..]    Horovod allreduce bandwidth per message size

Every number comes from real runs of the real code: `overhead` calls hvdtrain.train.train()
and reads the throughput it logs, `scaling` runs `hvdtrain launch`, `allreduce` times
hvd.allreduce in workers started by horovodrun the way `hvdtrain launch` starts them.
"""
import contextlib
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hvdtrain import launch, metrics, report
from hvdtrain.config import Config, load_config, resolve_batch
from hvdtrain.errors import UserError

# torch, Horovod and the modules that import them are imported by the commands that need them:
# the CLI imports this module to list its subcommands, and `hvdtrain --help` should not wait for
# torch, nor `hvdtrain doctor` fail when Horovod is broken.

DEFAULT_RECIPE = "recipes/gpt-tiny.yaml"
RESULT_TAG = "hvdtrain-bench-result: "  # marks the line a benchmark worker reports its result on


def parse_ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise UserError(f"{what}: expected comma-separated integers >= 1, got '{text}'")
    return values


# ---------------------------------------------------------------- overhead

def bare_window(cfg: Config, data, steps: list[list[dict]], device) -> float:
    """Tokens/s of a plain PyTorch loop over `steps` (lists of micro batches already on the
    device), timed over the second half: the first half warms up as hvdtrain's first log
    interval does. The same model and maths as hvdtrain's step: accumulation, clipping, precision."""
    import torch

    from hvdtrain.models import IGNORE_INDEX, build_model, logits_and_labels, prepare
    from hvdtrain.optimizers import build_optimizer

    t = cfg.train
    torch.manual_seed(t.seed)
    model = build_model(cfg.model, data.vocab, cfg.data.seq_len).to(device)
    model.train()
    prepare(model, cfg.model)  # model.compile / activation checkpointing, as configured
    optimizer = build_optimizer(model, t, t.lr, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16 if t.precision == "bf16" else torch.float16,
                              enabled=t.precision != "fp32")

    def step(micro_batches):
        for mb in micro_batches:
            with autocast:
                # logits_and_labels: BERT projects only the masked positions, as in hvdtrain.
                logits, labels = logits_and_labels(model, mb)
                loss = torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX)
            (loss / len(micro_batches)).backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
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


def hvdtrain_window(config: str, overrides: list[str], out_dir: Path, steps: int) -> float:
    """Tokens/s of hvdtrain.train.train() over 2 x `steps` steps, from its second log record
    (the first one includes start-up). Its console output is dropped: only the numbers matter."""
    from hvdtrain.train import train

    cfg = load_config(config, [*overrides, f"out_dir={out_dir}", f"train.max_steps={2 * steps}",
                               f"log.every={steps}", "log.progress=false", "checkpoint.resume=false"])
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        train(cfg)
    records, _ = metrics.read_metrics(out_dir)
    return records[-1]["tokens_per_s"]


def run_overhead(args) -> int:
    import torch

    from hvdtrain import distributed
    from hvdtrain.data import build_data
    from hvdtrain.sampler import StreamSampler

    if args.steps < 1 or args.windows < 1:
        raise UserError(f"--steps ({args.steps}) and --windows ({args.windows}) must be >= 1")
    config, overrides = args.config, args.overrides
    if config is not None and "=" in config and not Path(config).is_file():
        config, overrides = None, [config, *overrides]  # no CONFIG given, only overrides
    if config is None:
        config, overrides = DEFAULT_RECIPE, ["data.source=synthetic", *overrides]
    cfg = load_config(config, overrides)
    world = distributed.init(cfg)  # first, so both loops run with the thread count hvdtrain sets
    if world.size > 1:
        raise UserError("bench overhead measures one worker: run it directly, not under horovodrun")

    # The bare loop gets the batches hvdtrain's first 2 x steps steps use, prepared up front.
    grad_accum, global_batch = resolve_batch(cfg, 1)
    data = build_data(cfg, cfg.train.seed)
    sampler = StreamSampler(len(data.train), cfg.train.micro_batch_size, grad_accum, 0, 1, cfg.train.seed,
                            max_steps=2 * args.steps)
    micro = [{k: v.to(world.device) for k, v in data.collate([data.train[key] for key in keys]).items()
              if torch.is_tensor(v)} for keys in sampler]
    steps = [micro[i:i + grad_accum] for i in range(0, len(micro), grad_accum)]

    # Alternate the two (A B A B ...) so that load from other processes on a shared machine
    # hits both alike; the medians then compare like with like.
    bare, hvdtrain = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.windows):
            hvdtrain.append(hvdtrain_window(config, overrides, Path(tmp) / f"window{i}", args.steps))
            bare.append(bare_window(cfg, data, steps, world.device))
    result = {"config": config, "overrides": overrides, "steps_per_window": args.steps, "windows": args.windows,
              "global_batch": global_batch, "seq_len": cfg.data.seq_len, "threads": torch.get_num_threads(),
              "bare_tokens_per_s": bare, "hvdtrain_tokens_per_s": hvdtrain,
              "bare_median": statistics.median(bare), "hvdtrain_median": statistics.median(hvdtrain)}
    result["ratio"] = result["hvdtrain_median"] / result["bare_median"]
    # The spread of the ratio within each A-B pair shows how far the machine's noise reaches.
    result["pair_ratios"] = [h / b for h, b in zip(hvdtrain, bare)]
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"overhead: {config} {' '.join(overrides)}\n  1 worker, {torch.get_num_threads()} threads, global batch "
          f"{global_batch} x {cfg.data.seq_len} tokens, {args.windows} alternating windows of {args.steps} timed "
          f"steps (after {args.steps} warm-up steps each)")
    print(f"{'loop':<14}{'median tokens/s':>16}   windows")
    for name, values in (("bare PyTorch", bare), ("hvdtrain", hvdtrain)):
        print(f"{name:<14}{statistics.median(values):>16,.0f}   {' '.join(f'{v:,.0f}' for v in values)}")
    print(f"ratio hvdtrain/bare: {result['ratio']:.3f} (ratios within pairs of windows: "
          f"{min(result['pair_ratios']):.3f} to {max(result['pair_ratios']):.3f})")
    return 0


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

    from hvdtrain import distributed

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

def add_cli(sub):
    bench = sub.add_parser("bench", help="benchmarks: loop overhead, scaling, allreduce bandwidth")
    kinds = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")

    p = kinds.add_parser("overhead", help="hvdtrain's training loop vs a bare PyTorch loop (1 worker)")
    p.add_argument("config", nargs="?", help=f"YAML recipe (default: {DEFAULT_RECIPE} with data.source=synthetic)")
    p.add_argument("overrides", nargs="*", help="dotted overrides such as train.micro_batch_size=4")
    p.add_argument("--steps", type=int, default=5, help="timed steps per window (each also warms up as many)")
    p.add_argument("--windows", type=int, default=5, help="timing windows of each loop, alternated")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
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
