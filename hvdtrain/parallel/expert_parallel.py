"""Expert parallelism: the experts of each mixture-of-experts layer split over e ranks, every
token sent to the ranks holding its experts and the results sent back with Horovod's alltoall
(docs/experts.md).

The workers form a grid ("dp", world / e) x ("ep", e) (parallel_dims.ParallelDims; with
pipeline stages, the layout's grid, each stage's copies so split): the e neighbouring ranks of
one expert group hold different experts of every layer (the group's rank i: experts
i·E/e .. (i+1)·E/e - 1) and read different samples, as every worker does; the ranks at the same
place of their groups hold the same experts. So

    dense weights    the same on every rank (of a stage); gradients allreduced over all ranks
                     (the stage's copies), as without
    expert weights   this rank's E/e experts of each layer; gradients allreduced over the
                     ranks holding the same experts (along "dp"), each of whose gradients
                     already sums what the tokens of its group's e ranks sent it

In each layer's forward (ExpertParallel.forward), per micro batch:

    1. every (token, chosen expert) pair, sorted by expert: so by the rank that holds it
    2. hvd.alltoall of the pairs' expert numbers and hidden states to those ranks
    3. transformers' own experts module, cut to this rank's experts, runs what arrived
    4. hvd.alltoall back (the splits reversed); weighted by the router and summed per token

Each exchange is an autograd function (`exchange`) whose backward is the reverse alltoall, so
backward needs nothing more. Every alltoall is named after its layer (Horovod matches a
collective across its ranks by name; an unnamed one is named by a count of this process's
collectives, which ranks that ran others, on other process sets, would not share). Each
gradient's allreduce starts as soon as backward has made it (gradient_reduction, for
ExpertParallelStep and PipelinedStep in hvdtrain.training.step_engine); a checkpoint holds every
expert under its name, its rows written by the ranks of the first group (write_part), so that it
loads at any e, and the Hugging Face export reads it as it reads any other.
"""
import functools
from dataclasses import dataclass, field

import torch

from hvdtrain.checkpointing import checkpoint
from hvdtrain.config import HorovodConfig
from hvdtrain.errors import UserError
from hvdtrain.parallel import distributed
from hvdtrain.parallel.parallel_dims import ParallelDims, add_process_sets
from hvdtrain.parallel.sharded_optimizer import Copies

try:  # as in distributed.py
    import horovod.torch as hvd
except ImportError:  # pragma: no cover
    hvd = None


@dataclass
class ExpertGroups:
    """This rank's place among the expert groups and its two Horovod process sets."""
    size: int                  # e: ranks in an expert group
    rank: int                  # this rank's place in its group, 0 .. e-1
    group_set: object          # this rank's expert group: the alltoall's process set
    same_experts_set: object   # the ranks holding the same experts: their gradients' process set
    added_sets: list = field(default_factory=list)  # what open_expert_groups added, removed by close()
    copy: int = 0              # which of the groups: this rank's place among those holding its experts
    copies: int = 1            # the ranks holding the same experts: world / e (a stage's copies / e)
    dense_set: object = None   # the copies of the dense weights: all ranks (the stage's copies); their gradients' process set

    def close(self):
        """Remove the process sets (every rank, the same order)."""
        for process_set in self.added_sets:
            hvd.remove_process_set(process_set)  # Horovod: remove a process set (collective)


def expert_grid(world_size: int, e: int) -> ParallelDims:
    """The workers without pipeline stages: ("dp", world / e) x ("ep", e)."""
    if world_size % e:
        raise UserError(f"config key 'parallel.expert_parallel': {e} does not divide the {world_size} workers")
    return ParallelDims((("dp", world_size // e), ("ep", e)))


def open_expert_groups(grid: ParallelDims, rank: int, dense_set=None) -> ExpertGroups:
    """The process sets of the expert groups (along the grid's "ep": the alltoalls) and of the
    ranks holding the same experts (along "dp"), added by every rank in the same order (Horovod
    needs hvd.init(process_sets="dynamic"); parallel_dims.add_process_sets). `dense_set`: the
    process set of the copies of the dense weights (with pipeline stages, the stage's, which
    parallel_dims.open_groups added); Horovod's global one by default."""
    dense_set = dense_set or hvd.global_process_set
    at, sizes = grid.coords(rank), dict(grid.dims)
    if sizes["dp"] == 1:  # the copies are one expert group: their set (Horovod refuses to add one twice)
        group_set, added = dense_set, []
    else:
        group_set, added = add_process_sets(grid, "ep", rank)  # Horovod: process sets
    same_experts_set, more = add_process_sets(grid, "dp", rank)
    return ExpertGroups(sizes["ep"], at["ep"], group_set, same_experts_set, added + more, at["dp"], sizes["dp"],
                        dense_set)


# ---------------------------------------------------------------- the experts' forward

class ExpertParallel:
    """Mixed into a transformers experts module (MixtralExperts: 3-d weights, one row per
    expert, and forward(hidden_states, top_k_index, top_k_weights)) by `split_experts`, which
    swaps the module's class as torch's fully_shard does, so that its parameters keep their
    names. Its weights are this rank's rows; `num_experts` counts them."""
    expert_groups: ExpertGroups
    exchange_name: str  # the module's name in the model, which names its alltoalls

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        groups, local, name = self.expert_groups, self.num_experts, self.exchange_name
        k = top_k_index.shape[1]
        # 1. the (token, expert) pairs sorted by expert, so by rank; how many go to each rank.
        #    A pair of weight 0 (a capacity factor dropped it) would add nothing: it stays.
        experts = top_k_index.flatten()
        pairs = torch.nonzero(top_k_weights.flatten() != 0).squeeze(1)
        order = pairs[torch.argsort(experts[pairs], stable=True)]
        token = order // k
        sent_experts = experts[order]
        # (Horovod takes the splits on the host: on a GPU this waits for the router)
        splits = torch.bincount(sent_experts // local, minlength=groups.size).to("cpu", torch.int32)
        # Under autocast (train.precision bf16/fp16) the experts' matmuls take their inputs in
        # 16 bits and give 16-bit outputs: so they travel in 16 bits, half the bytes, the same values.
        sent = hidden_states[token]
        if torch.is_autocast_enabled(sent.device.type):
            sent = sent.to(torch.get_autocast_dtype(sent.device.type))
        # 2. Horovod: alltoall of the pairs' expert numbers, then (autograd) of their hidden states
        received_experts, _ = hvd.alltoall(sent_experts, splits=splits, name=f"{name}.experts",
                                           process_set=groups.group_set)
        received, received_splits = exchange(sent, splits, groups.group_set, f"{name}.tokens")
        # 3. this rank's experts, each row to its own one, weighted later by the sender
        local_index = (received_experts - groups.rank * local).unsqueeze(1)
        outputs = super().forward(received, local_index, torch.ones_like(local_index, dtype=received.dtype))
        if not received.shape[0]:
            # Nothing arrived: transformers returns zeros that autograd links neither to `received`,
            # which would skip this rank's two backward alltoalls while its group waits in them, nor
            # to this rank's experts, whose gradients' reductions (started from their hooks) the
            # ranks holding the same experts would wait in: zeros linked to both.
            outputs = received * 0 + sum(weight.sum() for weight in self.parameters()) * 0
        # 4. Horovod: alltoall back to the senders (autograd), in the order they were sent
        returned, _ = exchange(outputs, received_splits, groups.group_set, f"{name}.results")
        weighted = returned * top_k_weights.flatten()[order].unsqueeze(1)
        return torch.zeros_like(hidden_states).index_add_(0, token, weighted.to(hidden_states.dtype))


def exchange(tensor: torch.Tensor, splits: torch.Tensor, process_set, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Horovod's alltoall (autograd: backward sends the gradients back the same way): the rows
    of `tensor`, splits[i] of them to the group's rank i; (what arrived, its splits)."""
    return Exchange.apply(tensor, splits, process_set, name)


class Exchange(torch.autograd.Function):
    """hvd.alltoall named `name` forward and `name`.backward backward, with the splits reversed
    (Horovod's own autograd alltoall names only its forward). bf16, which Horovod's PyTorch
    types do not include, travels as its bits, int16 (the same bytes)."""

    @staticmethod
    def forward(ctx, tensor, splits, process_set, name):
        received, received_splits = hvd.alltoall(as_sent(tensor), splits=splits, name=name, process_set=process_set)
        ctx.received_splits, ctx.process_set, ctx.name, ctx.dtype = received_splits, process_set, name, tensor.dtype
        ctx.mark_non_differentiable(received_splits)
        return received.view(tensor.dtype), received_splits

    @staticmethod
    def backward(ctx, grad, _):
        sent_back, _ = hvd.alltoall(as_sent(grad.contiguous()), splits=ctx.received_splits, name=f"{ctx.name}.backward",
                                    process_set=ctx.process_set)
        return sent_back.view(ctx.dtype), None, None, None


def as_sent(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in a type Horovod sends: bf16 as its int16 bits."""
    return tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor


@functools.cache
def expert_parallel_class(cls: type) -> type:
    """`cls` with ExpertParallel's forward in front of its own (one class per experts class)."""
    return type(f"ExpertParallel{cls.__name__}", (ExpertParallel, cls), {})


def build_own_experts(blueprint, model: torch.nn.Module, is_experts, groups: ExpertGroups):
    """Make `model` (a model_build.Blueprint's, its parameters on the meta device) real with
    this rank's experts only: the weights of one experts module at a time made whole on the
    host (Blueprint.materialise's groups, which give them the values the whole model's build
    does) and cut to this rank's rows before the next module's are made, so that at most one
    layer's experts are ever whole, not the model's; then split_experts."""
    def keep_own_rows(weights):
        for weight in weights:
            weight.data = own_rows(weight.data, groups)
    modules = experts_modules(model, is_experts, groups)
    blueprint.materialise(model, [list(module.parameters(recurse=False)) for _, module in modules], keep_own_rows)
    split_experts(model, is_experts, groups)


def split_experts(model: torch.nn.Module, is_experts, groups: ExpertGroups):
    """Keep this rank's experts of every experts module of `model` (`is_experts(module)`: the
    family's ModelParts.is_experts), whose weights are real and the same on every rank (or
    already cut to this rank's rows: build_own_experts)."""
    for module_name, module in experts_modules(model, is_experts, groups):
        for name, weight in list(module.named_parameters(recurse=False)):
            if weight.shape[0] == module.num_experts:  # whole
                setattr(module, name, torch.nn.Parameter(own_rows(weight, groups)))
        module.num_experts //= groups.size
        module.expert_groups, module.exchange_name = groups, f"experts.{module_name}"
        module.__class__ = expert_parallel_class(type(module))


def experts_modules(model: torch.nn.Module, is_experts, groups: ExpertGroups) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every experts module of `model`; a one-line error where e does not
    divide its experts."""
    found = [(name, module) for name, module in model.named_modules() if is_experts(module)]
    for _, module in found:
        if module.num_experts % groups.size:
            raise UserError(f"config key 'parallel.expert_parallel': {groups.size} does not divide the "
                            f"{module.num_experts} experts of each layer (model.experts)")
    return found


def own_rows(weight: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
    """This rank's experts' rows (a copy) of a whole expert weight, whose rows are its experts."""
    local = weight.shape[0] // groups.size
    return weight.detach()[groups.rank * local:(groups.rank + 1) * local].clone()


def expert_weight_names(model: torch.nn.Module) -> set[str]:
    """The names of the weights split_experts cut to this rank's experts."""
    return {f"{module_name}.{name}" for module_name, module in model.named_modules()
            if isinstance(module, ExpertParallel) for name, _ in module.named_parameters(recurse=False)}


# ---------------------------------------------------------------- gradients

def gradient_reduction(model, expert_names: set[str], groups: ExpertGroups, cfg: HorovodConfig,
                       backward_passes: int, during: bool = True) -> distributed.GradientReduction:
    """Each gradient allreduced during the step's last backward (`during`; else after it): the
    dense weights' over their copies (all ranks, or the stage's), the experts' over the ranks
    holding the same experts. With op average each expert gradient sums what e ranks' tokens
    sent it, so it is divided by e more: both kinds then average over all the copies."""
    def reduced_over(name: str) -> tuple[object, int]:
        return (groups.same_experts_set, groups.size) if name in expert_names else (groups.dense_set, 1)
    return distributed.GradientReduction(model, reduced_over, cfg, backward_passes, during)


def parameters_by_kind(model, expert_names: set[str]) -> tuple[list, list]:
    """(dense weights, expert weights) of `model`, in its order."""
    named = list(model.named_parameters())
    return [p for n, p in named if n not in expert_names], [p for n, p in named if n in expert_names]


def clip_grad_norm_(model, expert_names: set[str], groups: ExpertGroups, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over the whole model: the dense gradients (equal on every
    rank) counted once, every expert's once (its group's ranks hold different ones)."""
    dense, experts = parameters_by_kind(model, expert_names)
    return distributed.clip_split_grad_norm_([p.grad for p in dense if p.grad is not None],
                                             [p.grad for p in experts if p.grad is not None],
                                             functools.partial(sum_over_group, groups=groups), max_norm)


def sum_over_group(squares: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
    """The sum of the expert group's squared norms of their experts' gradients."""
    # Horovod: allreduce (sum) over the expert group
    return hvd.allreduce(squares, op=hvd.Sum, name="grads.expert_norm", process_set=groups.group_set)


def share_found_inf(scaler: torch.amp.GradScaler, optimizer, groups: ExpertGroups):
    """fp16: every rank's grad scaler sees inf when one of its group found one in its experts,
    so that all skip the same steps (the dense gradients are equal everywhere)."""
    flags = list(scaler._found_inf_per_device(optimizer).values())  # one per device, from unscale_
    # Horovod: allreduce (max) over the expert group
    found = hvd.allreduce(torch.stack(flags).amax(), op=hvd.Max, name="grads.found_inf", process_set=groups.group_set)
    for flag in flags:
        flag.copy_(found)


# ---------------------------------------------------------------- checkpoints

def write_part(tmp, index: int, count: int, model, optimizer, expert_names: set[str], groups: ExpertGroups) -> dict:
    """A rank of the first expert group (of a stage), as part `index` of `count`: its experts'
    rows of every expert weight and of their optimizer state, as slices of the whole tensors
    (checkpoint.write_slices), and (its rank 0) the dense weights and their state; their
    manifest entries."""
    def slices(tensors: dict, name_of) -> dict:
        out = {}
        for key, tensor in tensors.items():
            if name_of(key) in expert_names and tensor.dim():
                whole = (tensor.shape[0] * groups.size, *tensor.shape[1:])
                out[key] = (tensor.flatten(), groups.rank * tensor.numel(), whole)
            elif name_of(key) in expert_names or groups.rank == 0:  # a step count: every part has it
                out[key] = tensor
        return out

    weights = slices(model.state_dict(), lambda key: key)
    state = slices(checkpoint.optimizer_tensors(optimizer, model), lambda key: key.split("::", 1)[0])
    return checkpoint.write_slices(tmp, index, count, weights, state)


def expert_copies(model, expert_names: set[str], groups: ExpertGroups, op: str) -> dict[int, Copies]:
    """parallel.shard (a ShardedOptimizer's `elsewhere`): each expert weight is sharded over the
    ranks holding the same experts, its reduced gradient averaged over e ranks more (horovod.op
    average: as gradient_reduction's), and its rows start at this rank's first expert's in the
    whole tensor."""
    out = {}
    for name, p in model.named_parameters():
        if name in expert_names:
            out[id(p)] = Copies(groups.same_experts_set, groups.copy, groups.copies,
                                1.0 / groups.size if op == "average" else 1.0, groups.rank * p.numel(),
                                (p.shape[0] * groups.size, *p.shape[1:]))
    return out


def local_rows(model, expert_names: set[str], groups: ExpertGroups):
    """What checkpoint.load_weights and load_optimizer read of each saved tensor (their `part`):
    of an expert weight (or its optimizer state) this rank's rows, the values [start, end) of
    the flattened whole tensor, in the local weight's shape; of the others, all (None)."""
    shapes = {name: p.shape for name, p in model.named_parameters() if name in expert_names}

    def rows(name: str):
        if name not in shapes:
            return None
        size = shapes[name].numel()
        return groups.rank * size, (groups.rank + 1) * size, shapes[name]
    return rows
