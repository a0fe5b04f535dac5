"""`parallel.layer_boundaries: auto`: the pipeline split from the layers' measured costs.

The even split (pipeline_plan.stage_bounds) counts every transformer layer, the embeddings and
the head as one unit of work each. They are not: a 128k vocabulary makes the head (and its
loss) weigh several layers, ModernBERT's global-attention layers (every third) cost more than its
local ones. SageMaker's model parallelism balances its partition on measured module costs; this
does the same for hvdtrain's stages, at the start of a run, on the run's own hardware:

    1. every rank builds its stage of the even split (weights only, no optimizer state) and
       times, at the run's micro batch, sequence length, precision and speed-ups (activation
       checkpointing, compiled blocks), the forward and backward of each piece it holds: the
       embeddings (first stage), each transformer layer, the final norm with the head and the
       loss (last stage); the fastest of REPEATS after a warm-up
    2. Horovod allgathers the pieces' times and parameter counts; each piece's time is the
       mean over the copies that measured it
    3. pipeline_plan.balanced_bounds: the split whose slowest stage is the fastest; on a GPU,
       among those whose every stage fits it as `hvdtrain plan` counts its memory (its
       stage_memory at the run's micro batches, checkpointing and sharding, within 90% of
       the GPU): a split that does not fit gives its largest stage fewer parameters

The costs are cached (rank 0 reads and writes `layer-costs/KEY.json` in the data cache's folder,
data.cache_dir, default ~/.cache/hvdtrain; KEY: the model's config, sequence length, micro batch,
precision, device and PyTorch version), so a resume or another layout of the same model measures
nothing. The start-up line says the split, each stage's time from the costs, and how far the
slowest is above the mean, beside the even split's. Delete the cache entry to measure again
(after a driver or hardware change).

`hvdtrain plan` has no measured costs: it balances "auto" on its FLOPs of the same pieces
(plan.planned_bounds), which do not tell ModernBERT's global layers from its local ones. The probe holds its
stage's weights whole in fp32 (no gradients or optimizer state): a stage that fits a GPU only
fully sharded (parallel.shard: full) may not fit as a probe; give its boundaries by hand there.
"""
import json
import time
from dataclasses import asdict

import torch

from hvdtrain.data.cache import atomic_path, cache_key, cache_root
from hvdtrain.parallel import distributed
from hvdtrain.parallel.pipeline import TokenLoss
from hvdtrain.parallel.pipeline_plan import balanced_bounds, stage_bounds, stage_totals

REPEATS = 3  # timed forward + backward passes per piece, after one warm-up; the fastest counts


def cache_path(cfg, device: torch.device):
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    key = cache_key(json.dumps(asdict(cfg.model), sort_keys=True), cfg.data.seq_len, cfg.data.vocab_size,
                    cfg.train.micro_batch_size, cfg.train.precision, name, torch.__version__)
    return cache_root(cfg.data) / "layer-costs" / f"{key}.json"


def _timed(run, device: torch.device) -> float:
    """The fastest of REPEATS calls of `run` (forward and backward), after one warm-up."""
    best = float("inf")
    for repeat in range(REPEATS + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if repeat:
            best = min(best, time.perf_counter() - start)
    return best


def measure_stage(stage, layout, bounds: list[int], cfg, device: torch.device, autocast) -> dict[int, tuple]:
    """{piece: (seconds, parameters)} of the pieces `stage` (this rank's StageModule of the
    split `bounds`) holds: 0 the embeddings, 1 + i layer i, n_layer + 1 the head and loss."""
    micro, seq, n_layer = cfg.train.micro_batch_size, cfg.data.seq_len, bounds[-1]
    dtype = next(stage.parameters()).dtype
    hidden = stage.config.hidden_size
    generator = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, stage.config.vocab_size, (micro, seq), generator=generator).to(device)
    labels = ids.clone()
    if stage.parts.masked_head is not None:  # a masked LM's loss sees its masked positions only
        keep = torch.rand((micro, seq), generator=generator) < cfg.data.mlm_probability
        labels[~keep.to(device)] = -100

    def backward_from(make_output):
        x = torch.randn(micro, seq, hidden, generator=generator).to(device, dtype).requires_grad_()

        def run():
            with autocast:
                out = make_output(x)
            (out if out.dim() == 0 else out.float().square().mean()).backward()
            stage.zero_grad(set_to_none=True)
            x.grad = None
        return run

    def params(modules) -> int:
        return sum(p.numel() for p in {id(p): p for m in modules for p in m.parameters()}.values())

    costs = {}
    if layout.is_first:
        embeddings = [stage.get_submodule(path) for path in stage.parts.first_only if _has(stage, path)]
        costs[0] = (_timed(backward_from(lambda _: stage.embed(ids)), device), params(embeddings))
    for i in (int(k) for k in stage.layers.keys()):
        layer = stage.layers[str(i)]
        costs[1 + i] = (_timed(backward_from(lambda x, i=i: stage.run_layers(range(i, i + 1), x)), device),
                        params([layer]))
    if layout.is_last:
        loss = TokenLoss(stage, 1.0)
        head = [stage.get_submodule(path) for path in stage.parts.last_only if _has(stage, path)]
        costs[n_layer + 1] = (_timed(backward_from(lambda x: loss(stage.final_norm(x), labels)), device),
                              params([*head, stage.output_projection]))
    return costs


def _has(stage, path: str) -> bool:
    try:
        return stage.get_submodule(path) is not None
    except AttributeError:
        return False


def _read_cache(path):
    """The cached costs, or None when there are none (or the file is not what this module
    writes: they are measured again and the file replaced)."""
    try:
        cached = json.loads(path.read_text())
        return cached if isinstance(cached, dict) and {"costs", "params"} <= cached.keys() else None
    except (OSError, ValueError):
        return None


def auto_bounds(cfg, n_layer: int, layout, world, build_probe, autocast, fits=None) -> list[int]:
    """The split of parallel.layer_boundaries=auto of `n_layer` layers for `layout` (the same
    on every rank): from the cached costs, or measured now on a probe of this rank's
    even-split stage (`build_probe(bounds)`: the StageModule, on the device, freed when this
    returns). `fits(bounds)`: whether every stage of a split fits the device (None: no bound,
    as on a CPU); a split that does not gives its largest stage fewer parameters until one
    fits, or is the even split."""
    n = layout.num_stages
    even = stage_bounds(n_layer, layout.stages, layout.stages_per_rank)
    path = cache_path(cfg, world.device)
    cached = _read_cache(path) if world.is_main else None
    # Horovod: broadcast from rank 0 (each host may have its own cache)
    cached = distributed.broadcast_object(cached, name="layer_costs.cached")
    source = "cached" if cached else "measured"
    if cached is None:
        probe = build_probe(even)
        mine = measure_stage(probe, layout, even, cfg, world.device, autocast)
        del probe
        # Horovod: allgather of every rank's pieces
        measured = distributed.allgather_object(mine, name="layer_costs.measured")
        costs, params = [], []
        for piece in range(n_layer + 2):
            found = [m[piece] for m in measured if piece in m]
            costs.append(sum(seconds for seconds, _ in found) / len(found))
            params.append(found[0][1])
        cached = {"costs": costs, "params": params}
        if world.is_main:
            with atomic_path(path) as tmp:
                tmp.write_text(json.dumps(cached))
    costs, params = cached["costs"], cached["params"]

    bounds = balanced_bounds(costs, params, n)
    while fits is not None and not fits(bounds) and bounds != even:  # fewer parameters on the largest stage
        bounds = balanced_bounds(costs, params, n, limit=max(stage_totals(bounds, params)) - 1)
    times = stage_totals(bounds, costs)

    def imbalance(t):
        return max(t) / (sum(t) / len(t))

    milliseconds = ", ".join(f"{t * 1e3:.1f}" for t in times)
    world.print(f"hvdtrain: parallel.layer_boundaries auto: {bounds} from the layers' costs, {source} ({path}); "
                f"stage times {milliseconds} ms a micro batch, slowest {imbalance(times):.2f}x the mean (even split {even}: "
                f"{imbalance(stage_totals(even, costs)):.2f}x)")
    return bounds
