"""`hvdtrain bench memory`: what each sharding level saves per worker, measured against
`hvdtrain plan`'s count.

    hvdtrain bench memory [CONFIG] [overrides] [--copies 1,2,4] [--levels none,optimizer,gradients,full]
                          [--steps 3] [--threads 1] [--json]

For each d in --copies, one run of d data-parallel copies per level (d x t workers with
parallel.tensor_parallel = t: each copy's layers split over a group of t) started by horovodrun as
`hvdtrain launch` starts them, each worker running hvdtrain.training.train's set_up and step loop (what `hvdtrain
train` runs) on the recipe's model with synthetic data, with parallel.shard at that level. Each worker
reports
  * its optimizer state: the bytes of the tensors the optimizer keeps (moments and step counts;
    sharded: this worker's slices, and the fp32 master slices where the weights are 16-bit; split
    by tensor parallelism: this worker's slices of the split weights' state);
  * its peak memory over the training steps: on a GPU torch.cuda.max_memory_allocated (reset
    after set-up); on a CPU the peak resident set size (VmHWM, reset after set-up) less the
    resident size before set-up (the libraries), so the weights, gradients, optimizer state,
    activations and Horovod's fusion buffer (glibc's mmap threshold fixed, as `bench pipeline`
    does, so that the resident size follows live memory).
next to the plan's prediction for the same config and d (hvdtrain.tools.plan.memory_bytes: the
optimizer's parts, and the total; on a CPU, see `predicted`) and their ratio.
The default recipe is a GPT of 12 layers x 768 whose state dominates its memory.
"""
import json
import tempfile
from pathlib import Path

from hvdtrain.tools.bench_common import RESULT_TAG, add_worker_parser, parse_ints, run_workers, train_sampling
from hvdtrain.config import SHARD_LEVELS, load_config
from hvdtrain.errors import UserError

DEFAULT_RECIPE = "recipes/gpt2-small.yaml"
# The recipe's model with a short context and a small vocabulary: the optimizer state dominates.
DEFAULT_OVERRIDES = ["data.source=synthetic", "data.tokenizer=train", "data.hub_config=null",
                     "data.validation_split=null", "data.num_workers=0", "data.seq_len=64", "data.vocab_size=8192",
                     "data.synthetic_samples=512",
                     "train.micro_batch_size=1", "train.grad_accum=1", "train.global_batch_size=null",
                     "train.precision=fp32", "model.compile=false", "model.dropout=0.0"]
MIB = 2 ** 20
CPU_PLAN = ", sharded with Gloo's reduce-scatter working memory"


def run_overrides(args, level: str, out_dir: Path) -> list[str]:
    return [f"parallel.shard={level}", "parallel.shard_optimizer=false", f"train.max_steps={args.steps}",
            "log.every=1", "log.progress=false", "log.tensorboard=false", "log.step_breakdown=false",
            "checkpoint.every=0", "checkpoint.resume=false", "eval.every=0", "eval.batches=1", f"out_dir={out_dir}"]


def predicted(cfg, copies: int, device: str) -> dict:
    """The plan's bytes per worker: the optimizer's parts (moments, master weights) and the
    total, without the CUDA context and workspaces, which neither measure sees (a GPU's
    max_memory_allocated counts PyTorch's tensors alone; measured on one H200 at d=1, every
    level's peak was 0.57-0.61 of the plan with them and 0.93-0.97 without). On a CPU also
    with the fusion buffer resident only as far as a reduction writes it (Horovod allocates it
    whole on a GPU, as the plan counts it, but a CPU's pages become resident when written:
    `plan.fused_gradient_bytes`), and, sharded over more than one worker, as much again: the
    working memory of Gloo's reduce-scatter (which NCCL's, the plan's, does not have), measured
    as the peak's excess over the plan falling with horovod.fusion_threshold_mb (d=4: 144 MiB
    at the default 128 MiB, 34 MiB at 32 MiB), and absent from one worker's peak (docs/memory.md)."""
    from hvdtrain.tools import plan
    parts = plan.memory_bytes(cfg, cfg.train.micro_batch_size, cfg.model.activation_checkpointing,
                              copies=copies)["parts"]
    parts.pop("CUDA context and workspaces")
    if device != "cuda":
        written = plan.fused_gradient_bytes(cfg, plan.count_params(**plan.model_dims(cfg)))
        parts["Horovod fusion buffer"] = min(parts["Horovod fusion buffer"], written)
        if cfg.parallel.shard != "none" and copies > 1:
            parts["Gloo reduce-scatter working memory"] = written
    optimizer = sum(v for k, v in parts.items() if k.startswith(("optimizer state", "master weights")))
    return {"optimizer_bytes": optimizer, "peak_bytes": sum(parts.values())}


def run_memory_bench(args) -> int:
    config, overrides = args.config, args.overrides
    if config is not None and "=" in config and not Path(config).is_file():
        config, overrides = None, [config, *overrides]  # no CONFIG given, only overrides
    overrides = [*DEFAULT_OVERRIDES, *overrides] if config is None else ["data.source=synthetic", *overrides]
    config = config or DEFAULT_RECIPE
    copies = sorted(set(parse_ints(args.copies, "--copies")))
    parallel = load_config(config, overrides).parallel
    if parallel.pipeline_stages > 1:  # the plan's per-stage memory is `bench pipeline`'s to measure
        raise UserError(f"parallel.pipeline_stages: expected 1 for bench memory (got {parallel.pipeline_stages}); "
                        "`hvdtrain bench pipeline` measures each stage's memory")
    group = parallel.tensor_parallel  # the workers of one copy
    levels = args.levels.split(",")
    if not levels or any(level not in SHARD_LEVELS for level in levels):
        raise UserError(f"--levels: expected a comma-separated list of {', '.join(SHARD_LEVELS)}, got {args.levels!r}")
    if args.steps < 1 or args.threads < 1:
        raise UserError(f"--steps and --threads: expected integers >= 1, got {args.steps} and {args.threads}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-memory-") as tmp:
        layouts = [(d, level) for d in copies for level in levels]
        cfgs = {key: load_config(config, [*overrides, *run_overrides(args, key[1], Path(tmp))]) for key in layouts}
        for d, level in layouts:  # every config checked above, before any run starts
            own = run_overrides(args, level, Path(tmp) / f"d{d}-{level}")
            reports = run_workers(d * group, "memory", config, [*overrides, *own], args.threads)
            expected = predicted(cfgs[d, level], d, reports[0]["device"])
            worst = max(reports, key=lambda r: r["peak_bytes"])
            rows.append({"copies": d, "tensor_parallel": group, "level": level, "device": reports[0]["device"],
                         "optimizer_bytes": max(r["optimizer_bytes"] for r in reports),
                         "peak_bytes": worst["peak_bytes"], "predicted": expected})
    result = {"config": config, "overrides": overrides, "steps": args.steps, "threads": args.threads, "rows": rows}
    if args.json:
        print(json.dumps(result))
        return 0
    print_result(result)
    return 0


def print_result(result: dict):
    rows = result["rows"]
    memory = ("peak GPU memory (max_memory_allocated)" if rows[0]["device"] == "cuda"
              else "peak RSS over the RSS before set-up")
    group = rows[0]["tensor_parallel"]
    workers = "d" if group == 1 else f"d x t={group} workers (t: a copy's tensor-parallel group)"
    print(f"memory: {result['config']} {' '.join(result['overrides'])}\n"
          f"  per worker, the largest of the {workers}; {memory}; plan: hvdtrain.tools.plan.memory_bytes for the same "
          f"config and d, without the CUDA context{'' if rows[0]['device'] == 'cuda' else CPU_PLAN}")
    print(f"  {'d':>3} {'shard':>9} {'optimizer state':>16} {'plan':>10} {'ratio':>6} {'peak':>12} {'plan':>12} "
          f"{'ratio':>6}")
    for r in rows:
        p = r["predicted"]
        print(f"  {r['copies']:>3} {r['level']:>9} {r['optimizer_bytes'] / MIB:>12.1f} MiB "
              f"{p['optimizer_bytes'] / MIB:>6.1f} MiB {r['optimizer_bytes'] / p['optimizer_bytes']:>6.2f} "
              f"{r['peak_bytes'] / MIB:>8.1f} MiB {p['peak_bytes'] / MIB:>8.1f} MiB "
              f"{r['peak_bytes'] / p['peak_bytes']:>6.2f}")


# ---------------------------------------------------------------- the worker

def optimizer_bytes(optimizer) -> int:
    """Bytes of the tensors the optimizer keeps: its state, and a sharded optimizer's fp32
    master slices where they are not views into the weights. The state of a weight split by
    tensor parallelism is a DTensor whose numel is the whole weight's: its local tensor is what
    this worker keeps."""
    from hvdtrain.parallel.sharded_optimizer import ShardedOptimizer
    from hvdtrain.parallel.distributed import local
    tensors = [local(v) for state in optimizer.state.values() for v in state.values() if hasattr(v, "element_size")]
    if isinstance(optimizer, ShardedOptimizer):
        tensors += [s.master for s in optimizer.slices if s.master._base is None]
    return sum(t.numel() * t.element_size() for t in tensors)


def run_memory_worker(args) -> int:
    """One rank of `bench memory`, started by horovodrun: set_up and run_steps of `hvdtrain
    train`, then this rank's optimizer state and peak memory over the training steps."""
    peaks, state = [], []

    def sample(setup, peak_bytes, interval):
        peaks.append(peak_bytes())
        state.append(optimizer_bytes(setup.optimizer))

    setup, _ = train_sampling(load_config(args.config, args.overrides), sample)
    device = setup.world.device
    print(RESULT_TAG + json.dumps({"rank": setup.world.rank, "peak_bytes": max(peaks), "optimizer_bytes": max(state),
                                   "device": device.type}), flush=True)
    return 0


def add_cli(kinds):
    """Register `bench memory` (and its internal worker) on the `bench` subparsers."""
    p = kinds.add_parser("memory", help="per-worker optimizer state and peak memory at each sharding level, against "
                                        "the plan")
    p.add_argument("config", nargs="?", help=f"YAML recipe (default: {DEFAULT_RECIPE} with a short context and a "
                                             "small vocabulary); its data is replaced by synthetic data")
    p.add_argument("overrides", nargs="*", help="dotted overrides such as model.n_layer=6")
    p.add_argument("--copies", default="1,2,4", help="data-parallel copies d, one run per level each (default 1,2,4); "
                                                     "with parallel.tensor_parallel=t each copy is t workers")
    p.add_argument("--levels", default=",".join(SHARD_LEVELS), help=f"parallel.shard levels (default {','.join(SHARD_LEVELS)})")
    p.add_argument("--steps", type=int, default=3, help="steps per run (default 3)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per worker (default 1)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run_memory_bench)
    add_worker_parser(kinds, "memory", run_memory_worker)
