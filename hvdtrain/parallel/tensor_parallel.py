"""Tensor parallelism (Megatron-LM's): each transformer layer's matrices split over t neighbouring
ranks, with PyTorch's own tensor-parallel API (docs/tensor-parallel.md).

The workers form a grid ("dp", world / t) x ("tp", t), with pipeline stages ("pp", p) x
("dp", world / (t·p)) x ("tp", t) (parallel_dims.Layout): the t neighbouring ranks of one
tensor-parallel group read the same samples and hold different slices of every layer (of their
stage); the ranks at the same place of their groups hold the same slices. In each layer
(the family's ModelParts.tensor_plan):

    attention   query/key/value projections column-wise (each rank: n_head / t query heads and
                n_kv_head / t key/value heads), the output projection row-wise
    MLP         up (and gate) projections column-wise, the down projection row-wise

torch.distributed.tensor.parallel's ColwiseParallel / RowwiseParallel make these weights DTensors
over a one-dimensional DeviceMesh of the group's torch.distributed process group: the row-wise
output is summed over the group (an allreduce in forward), the column-wise input's gradient too
(in backward). Everything else (embeddings, norms, the head) is whole on every rank, and its
gradient equal on every rank of a group.

    gradients   allreduced over the world / t ranks holding the same slices, by Horovod, each
                started by a hook as the step's last backward makes it, or after backward
                (parallel.reduce_gradients, "after" by default on GPUs; always with pipeline
                stages, after the schedule's run) (gradient_reduction): Horovod takes plain tensors, so
                a DTensor's gradient is reduced as its local tensor (`to_local()`, the same
                storage)
    norm        every slice's squares summed over the group, the whole parameters' counted
                once (clip_grad_norm_)
    fp16        each rank unscales its local tensors (LocalGradScaler); the group skips a step
                when one of its ranks found inf
    checkpoint  the whole tensors, gathered over the group (whole_tensors) and written by rank 0
                as without tensor parallelism, so that any t resumes any other and the Hugging
                Face export reads it as any other; a resume reads them whole and keeps each
                rank's slice (placed)
"""
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from hvdtrain.errors import UserError
from hvdtrain.models import family_of
from hvdtrain.models.common import transformer_blocks
from hvdtrain.parallel import distributed, parallel_dims
from hvdtrain.parallel.distributed import local  # noqa: F401 (this module's API too)

STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


@dataclass
class TensorGroups:
    """This rank's tensor-parallel group: its place in the layout's grid (parallel_dims.Layout's
    "tp" and "dp" coordinates) and the communicators opened for it (parallel_dims.Groups)."""
    layout: parallel_dims.Layout
    groups: parallel_dims.Groups

    @property
    def size(self) -> int:
        """t: ranks in a tensor-parallel group."""
        return self.layout.tp

    @property
    def rank(self) -> int:
        """This rank's place in its group, 0 .. t-1."""
        return self.layout.tp_rank

    @property
    def dp(self) -> int:
        """Copies of this rank's slices (and stage): world / (t x pipeline stages)."""
        return self.layout.dp

    @property
    def dp_rank(self) -> int:
        """Which copy, 0 .. dp-1: the data shard this group reads."""
        return self.layout.dp_rank

    @property
    def mesh(self) -> DeviceMesh:
        """The group's ranks (torch.distributed), for DTensor."""
        return self.groups.tensor

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group()

    @property
    def copies_set(self) -> object:
        """The ranks holding the same slices: their gradients' Horovod process set."""
        return self.groups.process_set

    def close(self):
        """Remove the process sets and the torch.distributed groups (all ranks, same order)."""
        self.groups.close()


def open_tensor_groups(rank: int, world_size: int, t: int, device: torch.device) -> TensorGroups:
    """torch.distributed inside horovodrun, a group per t neighbouring ranks (within one host)
    and the Horovod process sets of the copies (parallel_dims.open_groups)."""
    layout = parallel_dims.layout_for(rank, world_size, 1, tp=t)
    return TensorGroups(layout, parallel_dims.open_groups(layout, "nccl" if device.type == "cuda" else "gloo"))


# ---------------------------------------------------------------- the model

def check_divisible(config, t: int):
    """The heads (and key/value heads) split evenly over t ranks, or a one-line error."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for key, value in (("model.n_head", heads), ("model.n_kv_head", kv_heads)):
        if value % t:
            raise UserError(f"config key 'parallel.tensor_parallel': {t} does not divide {key} ({value}); "
                            f"each rank holds {key} / t heads")


def parallelize(model: torch.nn.Module, groups: TensorGroups):
    """Split each layer of `model` (with its weights) over the group, as its family's
    TensorPlan says: Conv1D layers made nn.Linear, fused outputs reordered (saved_forms), the
    per-rank counts divided, then torch's ColwiseParallel / RowwiseParallel."""
    plan, t = family_of(model).modeling().PARTS.tensor_plan, groups.size
    check_divisible(model.config, t)
    for _, layer in numbered_blocks(model):
        for path in plan.conv1d:
            _as_linear(layer, path)
        for path, blocks in plan.fused.items():
            with torch.no_grad():
                for param in layer.get_submodule(path).parameters():
                    param.copy_(param[fused_order(param.shape[0], blocks, t)])
        for dotted in plan.per_rank:
            path, name = dotted.rsplit(".", 1)
            owner = layer.get_submodule(path)
            setattr(owner, name, getattr(owner, name) // t)
        for path, style in plan.styles.items():
            features = layer.get_submodule(path).weight.shape[0 if style == "colwise" else 1]
            if features % t:
                raise UserError(f"config key 'parallel.tensor_parallel': {t} does not divide the "
                                f"{features} features that {path} splits")
        # torch.distributed.tensor.parallel: the weights become DTensors sharded over the mesh
        parallelize_module(layer, groups.mesh, {path: STYLES[style]() for path, style in plan.styles.items()})


def numbered_blocks(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(index in the whole model, layer) of each transformer layer `model` holds: all of a
    whole model's, a pipeline stage's own (hvdtrain.parallel.pipeline.StageModule keys them by index)."""
    blocks = transformer_blocks(model)
    return ([(int(i), layer) for i, layer in blocks.items()] if isinstance(blocks, torch.nn.ModuleDict)
            else list(enumerate(blocks)))


def _as_linear(layer: torch.nn.Module, path: str):
    """transformers' Conv1D at `path` (y = x W + b, W stored [in, out]) as the nn.Linear it
    computes (W stored [out, in]), which torch's parallel styles split."""
    conv = layer.get_submodule(path)
    linear = torch.nn.Linear(*conv.weight.shape, bias=conv.bias is not None, device=conv.weight.device,
                             dtype=conv.weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.T)
        if conv.bias is not None:
            linear.bias.copy_(conv.bias)
    parent, name = path.rsplit(".", 1)
    setattr(layer.get_submodule(parent), name, linear)


def fused_order(rows: int, blocks: int, t: int) -> torch.Tensor:
    """The order of a fused colwise layer's rows in training: rank 0's part of every block
    (block 0's rows 0 .. rows/(blocks·t) - 1, then block 1's, ...), then rank 1's, ...; so each
    rank's contiguous slice holds its heads of query, key and value."""
    size = rows // blocks
    part = size // t
    return torch.tensor([b * size + r * part + i for r in range(t) for b in range(blocks) for i in range(part)])


def saved_forms(model: torch.nn.Module, t: int) -> dict[str, tuple[int, bool]]:
    """The split parameters whose training form differs from their saved one (a checkpoint
    and a Hugging Face folder hold transformers' layout): name -> (fused blocks, whether a
    Conv1D's weight, saved transposed)."""
    parts = family_of(model).modeling().PARTS
    plan, forms = parts.tensor_plan, {}
    for i, _ in numbered_blocks(model):
        for path in set(plan.fused) | set(plan.conv1d):
            prefix = f"{parts.layers}.{i}.{path}"
            forms[f"{prefix}.weight"] = (plan.fused.get(path, 1), path in plan.conv1d)
            forms[f"{prefix}.bias"] = (plan.fused.get(path, 1), False)
    return forms


def to_saved(tensor: torch.Tensor, form: tuple[int, bool], t: int) -> torch.Tensor:
    """A whole tensor in training form, in the saved one (saved_forms)."""
    blocks, transposed = form
    if blocks > 1:
        tensor = tensor[torch.argsort(fused_order(tensor.shape[0], blocks, t))]
    return tensor.T.contiguous() if transposed else tensor


def from_saved(tensor: torch.Tensor, form: tuple[int, bool], t: int) -> torch.Tensor:
    """A whole saved tensor in training form (the inverse of to_saved)."""
    blocks, transposed = form
    tensor = tensor.T if transposed else tensor
    return tensor[fused_order(tensor.shape[0], blocks, t)] if blocks > 1 else tensor.contiguous()


def is_split(tensor: torch.Tensor) -> bool:
    """A DTensor with a slice on each rank (not a whole tensor on each)."""
    return isinstance(tensor, DTensor) and any(p.is_shard() for p in tensor.placements)


# ---------------------------------------------------------------- gradients

class LocalGradScaler(torch.amp.GradScaler):
    """fp16's grad scaler for a model with split weights. torch's unscale kernel refuses one list
    of DTensor and plain gradients (torch 2.13), so this one unscales every gradient as its
    local tensor (the same storage), overriding the method that FSDP's ShardedGradScaler
    overrides too. Each rank then found inf in its own slices only: the step engine shares the
    flag over the group (distributed.share_found_inf). The gradients are the fp32 weights' (fp16
    is autocast's), on this worker's one device."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        by_dtype = defaultdict(list)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    by_dtype[p.grad.dtype].append(local(p.grad))
        with torch.no_grad():
            for grads in by_dtype.values():  # as torch's: multiplied by inv_scale, found_inf set on inf/NaN
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        return {found_inf.device: found_inf}


def gradient_reduction(model, groups: TensorGroups, horovod_cfg, backward_passes: int,
                       during: bool) -> distributed.GradientReduction:
    """Every gradient allreduced over the copies holding the same slices, as its local tensor,
    each as soon as the step's last backward has made it, while backward goes on (`during`), or
    all after backward."""
    return distributed.GradientReduction(model, lambda name: (groups.copies_set, 1), horovod_cfg, backward_passes,
                                         during)


def clip_grad_norm_(model, groups: TensorGroups, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over the whole model: the squares of the split weights'
    slices summed over the group, the whole ones (equal on every rank) counted once."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]

    def sum_over_group(squares):
        dist.all_reduce(squares, group=groups.group)  # torch.distributed: allreduce (sum) over the group
        return squares
    # on the local tensors (a row-wise bias is a whole DTensor): one list of DTensor and plain
    # gradients would not go through torch's foreach kernels
    return distributed.clip_split_grad_norm_([local(g) for g in grads if not is_split(g)],
                                             [local(g) for g in grads if is_split(g)], sum_over_group, max_norm)


# ---------------------------------------------------------------- checkpoints

def whole_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (allgathered over its group: every rank of it calls this,
    in the same order), or the tensor itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def whole_state(weights: dict, state: dict, model, groups: TensorGroups) -> tuple[dict, dict]:
    """(weights, optimizer state) by name, whole and in the saved form, on the host, from
    `weights` and `state` by name, DTensors where split (every rank of the group calls this, in
    the same order); a tied weight once, under its first name (a resume finds it by the others)."""
    forms, t = saved_forms(model, groups.size), groups.size

    def saved(name: str, tensor: torch.Tensor) -> torch.Tensor:
        tensor = whole_tensor(tensor).detach().cpu()
        return to_saved(tensor, forms[name], t) if name in forms and tensor.dim() else tensor

    whole, seen = {}, set()
    for name, tensor in weights.items():
        if local(tensor).data_ptr() not in seen:
            seen.add(local(tensor).data_ptr())
            whole[name] = saved(name, tensor)
    return whole, {key: saved(key.split("::", 1)[0], value) for key, value in state.items()}


def like(param: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`values` of the shape of `param`'s local tensor as `param` holds them: a DTensor of its
    placements where it is split (nothing is sent), else as they are."""
    if not isinstance(param, DTensor):
        return values
    return DTensor.from_local(values, param.device_mesh, param.placements, run_check=False)


def placed(model, groups: TensorGroups):
    """A checkpoint.load_weights / load_optimizer / ShardedOptimizer.load `place` for `model`: a
    whole saved tensor of a split parameter (or of its optimizer state, of the same size; in its
    saved shape or flat) becomes a DTensor of the parameter's placements, in training form, each
    rank keeping its slice."""
    params, forms = dict(model.named_parameters()), saved_forms(model, groups.size)

    def place(name: str, tensor: torch.Tensor) -> torch.Tensor:
        param = params.get(name)
        if not isinstance(param, DTensor) or tensor.numel() != param.numel() or not tensor.dim():
            return tensor
        if name in forms:  # (read whole, or flat: a sharded optimizer's ranges)
            transposed = forms[name][1]
            tensor = from_saved(tensor.reshape(param.shape[::-1] if transposed else param.shape), forms[name],
                                groups.size)
        else:
            tensor = tensor.reshape(param.shape)
        # every rank read the same whole tensor: each keeps its slice, nothing is sent
        return distribute_tensor(tensor.to(param.device), param.device_mesh, param.placements, src_data_rank=None)

    return place
