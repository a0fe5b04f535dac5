"""The arithmetic of pipeline stages, without torch: which layers go where, what a schedule
needs, and its ideal bubble.

hvdtrain.parallel.pipeline (which imports torch) re-exports all of it under the same names; `hvdtrain
plan` imports it from here so that the CLI starts without torch.
"""
from hvdtrain.errors import UserError

# torch's schedules (get_schedule_class names, any case) whose backward runs through autograd, so
# that Horovod's gradient hooks fire while it runs. Zero-bubble schedules compute weight gradients
# by hand and are left out. Only the interleaved one runs several stages per rank.
SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")
INTERLEAVED = ("interleaved1f1b",)


def stage_bounds(n_layer: int, stages: int, stages_per_rank: int = 1,
                 boundaries: list[int] | None = None) -> list[int]:
    """Layer boundaries b of the stages * stages_per_rank pipeline stages: stage i owns the
    transformer layers b[i] .. b[i+1]-1, so b[0] = 0 and b[-1] = n_layer.

    The default split is even once the embedding (first stage) and the head (last stage) are
    each counted as one layer, as torchtitan weighs them: 4 layers on 2 stages give [0, 2, 4],
    6 layers on 4 stages [0, 1, 3, 5, 6]. `boundaries` (parallel.layer_boundaries) chooses the
    split by hand, in the same form; the first and the last stage may own no layer (embedding
    or head only), every other stage needs one. "auto" is the split a run measures at its
    start (hvdtrain.parallel.layer_costs, balanced_bounds; `hvdtrain plan` balances it on its
    FLOPs: plan.planned_bounds); here, where nothing is measured, it is the even split."""
    n = stages * stages_per_rank
    if n > n_layer:
        raise UserError(f"parallel.pipeline_stages={stages} x parallel.stages_per_rank={stages_per_rank} = {n} "
                        f"pipeline stages is more than the model's {n_layer} layers (model.n_layer)")
    if boundaries is None or boundaries == "auto":
        return _even_bounds(n_layer, n)
    b = list(boundaries)
    if len(b) != n + 1 or b[0] != 0 or b[-1] != n_layer or any(x > y for x, y in zip(b, b[1:])):
        raise UserError(f"parallel.layer_boundaries={b} must be {n + 1} rising layer indices from 0 to "
                        f"{n_layer} (stage i owns layers b[i] .. b[i+1]-1)")
    empty = [i for i in range(1, n - 1) if b[i] == b[i + 1]]
    if empty:
        raise UserError(f"parallel.layer_boundaries={b} gives stage {empty[0]} no layer")
    return b


def _even_bounds(n_layer: int, n: int) -> list[int]:
    if n == 1:
        return [0, n_layer]
    units, extra = divmod(n_layer + 2, n)  # + embedding + head
    sizes = [units + (i < extra) for i in range(n)]
    sizes[0] -= 1   # the embedding takes one unit of the first stage
    sizes[-1] -= 1  # the head one of the last
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return bounds


def stage_totals(bounds: list[int], values: list[float]) -> list[float]:
    """Per pipeline stage of the split `bounds`, the sum of `values` (one for the embeddings,
    one per transformer layer, one for the head, as balanced_bounds takes them) it holds."""
    n, n_layer = len(bounds) - 1, bounds[-1]
    return [sum(values[i] for i in _pieces(bounds[s], bounds[s + 1], s, n, n_layer)) for s in range(n)]


def _pieces(first: int, end: int, s: int, n: int, n_layer: int) -> list[int]:
    """The pieces stage s of n holds when it owns layers first .. end-1: 1 + layer, the
    embeddings (0) on the first stage, the head (n_layer + 1) on the last."""
    return list(range(first + 1, end + 1)) + ([0] if s == 0 else []) + ([n_layer + 1] if s == n - 1 else [])


def balanced_bounds(costs: list[float], params: list[int], n: int, limit: int | None = None) -> list[int]:
    """The boundaries (as stage_bounds gives them) of n pipeline stages that make the slowest
    stage the fastest it can be: `costs` and `params` are those of the embeddings (on the first
    stage), each transformer layer, and the head with its loss (on the last stage), L + 2 each.
    With `limit`, only among the splits where no stage holds more than `limit` parameters (the
    even split when none does). As stage_bounds, the first and last stage may own no layer,
    every other stage needs one. Linear partitioning by dynamic programming (exact: at most
    128 layers and 64 stages in hvdtrain's recipes); ties go to the split with the earlier
    boundaries, so every rank picks the same one."""
    n_layer = len(costs) - 2
    inf = float("inf")

    def stage(first: int, end: int, s: int) -> tuple[float, int]:  # stage s owning layers first .. end-1
        pieces = _pieces(first, end, s, n, n_layer)
        return sum(costs[i] for i in pieces), sum(params[i] for i in pieces)

    # best[s][j]: the slowest of stages 0 .. s-1 owning layers 0 .. j-1, and where stage s-1 starts
    best = [[(inf, -1)] * (n_layer + 1) for _ in range(n + 1)]
    best[0][0] = (0.0, -1)
    for s in range(n):
        for j in range(n_layer + 1):
            if s == n - 1 and j != n_layer:
                continue
            for i in range(j + 1):
                if best[s][i][0] == inf or (0 < s < n - 1 and i == j):
                    continue
                cost, held = stage(i, j, s)
                if limit is not None and held > limit:
                    continue
                slowest = max(best[s][i][0], cost)
                if slowest < best[s + 1][j][0]:
                    best[s + 1][j] = (slowest, i)
    if best[n][n_layer][0] == inf:  # no split within the limit
        return _even_bounds(n_layer, n)
    bounds, j = [n_layer], n_layer
    for s in range(n, 0, -1):
        j = best[s][j][1]
        bounds.append(j)
    return bounds[::-1]


def check_schedule(name: str, stages: int, stages_per_rank: int, microbatches: int):
    """The schedule's needs, without a process group: config checks can call it before launch."""
    if name.lower() not in SCHEDULES:
        raise UserError(f"parallel.schedule '{name}' is not one of {', '.join(SCHEDULES)}")
    interleaved = name.lower() in INTERLEAVED
    if interleaved and (stages < 2 or stages_per_rank < 2):
        raise UserError(f"parallel.schedule '{name}' needs parallel.pipeline_stages >= 2 and "
                        f"parallel.stages_per_rank >= 2 (got {stages} and {stages_per_rank})")
    if not interleaved and stages_per_rank != 1:
        raise UserError(f"parallel.schedule '{name}' runs one stage per rank; set parallel.stages_per_rank=1 "
                        f"or use interleaved1f1b")
    if microbatches < stages:
        raise UserError(f"parallel.microbatches={microbatches} must be at least parallel.pipeline_stages={stages}")
    rounds = max(1, microbatches // stages)
    if interleaved and microbatches % rounds:
        raise UserError(f"parallel.microbatches={microbatches} must be a multiple of {rounds} for '{name}' "
                        f"with {stages} pipeline stages (torch's rounds of micro batches)")


def ideal_bubble(stages: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The share of a run each rank spends idle: (p-1)/(m+p-1) for GPipe and 1F1B, and
    (p-1)/(v·m+p-1) for interleaved 1F1B with v stages per rank, whose bubble takes (p-1)/v
    micro batch slots, v times fewer, while the work stays m slots (Narayanan et al. 2021,
    "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", section
    2.2.2: bubble time fraction (1/v)·(p-1)/m)."""
    return (stages - 1) / (stages_per_rank * microbatches + stages - 1)
