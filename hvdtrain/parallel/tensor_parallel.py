"""Tensor parallelism (Megatron-LM's): each transformer layer's matrices split over t neighbouring
ranks, with PyTorch's own tensor-parallel API (docs/tensor-parallel.md).

The workers form a grid ("dp", world / t) x ("tp", t) (parallel_dims.ParallelDims): the t
neighbouring ranks of one tensor-parallel group read the same samples and hold different slices
of every layer; the ranks at the same place of their groups hold the same slices. In each layer
(the family's ModelParts.tensor_plan):

    attention   query/key/value projections column-wise (each rank: n_head / t query heads and
                n_kv_head / t key/value heads), the output projection row-wise
    MLP         up (and gate) projections column-wise, the down projection row-wise

torch.distributed.tensor.parallel's ColwiseParallel / RowwiseParallel make these weights DTensors
over a one-dimensional DeviceMesh of the group's torch.distributed process group: the row-wise
output is summed over the group (an allreduce in forward), the column-wise input's gradient too
(in backward). Everything else (embeddings, norms, the head) is whole on every rank, and its
gradient equal on every rank of a group.

    gradients   allreduced over the world / t ranks holding the same slices, by Horovod, after
                backward (reduce_gradients): Horovod takes plain tensors, so a DTensor's
                gradient is reduced as its local tensor (`to_local()`, the same storage)
    norm        every slice's squares summed over the group, the whole parameters' counted
                once (clip_grad_norm_)
    checkpoint  the whole tensors, gathered over the group (whole_tensors) and written by rank 0
                as without tensor parallelism, so that any t resumes any other and the Hugging
                Face export reads it as any other; a resume reads them whole and keeps each
                rank's slice (placed)
"""
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from hvdtrain.checkpointing import checkpoint
from hvdtrain.errors import UserError
from hvdtrain.parallel import distributed, parallel_dims
from hvdtrain.parallel.parallel_dims import ParallelDims

try:  # as in distributed.py
    import horovod.torch as hvd
except ImportError:  # pragma: no cover
    hvd = None

STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


@dataclass
class TensorGroups:
    """This rank's place in the dp x tp grid, its tensor-parallel mesh and its Horovod process set."""
    size: int                   # t: ranks in a tensor-parallel group
    rank: int                   # this rank's place in its group, 0 .. t-1
    dp: int                     # copies: world / t
    dp_rank: int                # which copy, 0 .. dp-1: the data shard this group reads
    mesh: DeviceMesh            # the group's ranks (torch.distributed), for DTensor
    copies_set: object          # the ranks holding the same slices: their gradients' process set
    added_sets: list = field(default_factory=list)  # what open_tensor_groups added, removed by close()

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group()

    def close(self):
        """Remove the process sets and the torch.distributed groups (all ranks, same order)."""
        for process_set in self.added_sets:
            hvd.remove_process_set(process_set)  # Horovod: remove a process set (collective)
        dist.destroy_process_group()  # torch.distributed: destroy the groups


def open_tensor_groups(rank: int, world_size: int, t: int, device: torch.device) -> TensorGroups:
    """torch.distributed inside horovodrun (parallel_dims.init_torch_distributed), a group per
    t neighbouring ranks and the Horovod process sets of the copies; every rank makes every
    group in the same order."""
    if world_size % t:
        raise UserError(f"config key 'parallel.tensor_parallel': {t} does not divide the {world_size} workers")
    grid = ParallelDims((("dp", world_size // t), ("tp", t)))
    parallel_dims.init_torch_distributed("nccl" if device.type == "cuda" else "gloo")
    mine = None
    for ranks in grid.groups("tp"):
        group = dist.new_group(ranks)  # torch.distributed: new group (collective)
        if rank in ranks:
            mine = group
    copies_set, added = parallel_dims.add_process_sets(grid, "dp", rank)  # Horovod: process sets
    at = grid.coords(rank)
    return TensorGroups(t, at["tp"], grid.dims[0][1], at["dp"], DeviceMesh.from_group(mine, device.type),
                        copies_set, added)


# ---------------------------------------------------------------- the model

def check_divisible(config, t: int):
    """The heads (and key/value heads) split evenly over t ranks, or a one-line error."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for key, value in (("model.n_head", heads), ("model.n_kv_head", kv_heads)):
        if value % t:
            raise UserError(f"config key 'parallel.tensor_parallel': {t} does not divide {key} ({value}); "
                            f"each rank holds {key} / t heads")


def parallelize(model: torch.nn.Module, layers: torch.nn.ModuleList, plan: dict[str, str], groups: TensorGroups):
    """Split each of `layers` (the model's, with its weights) over the group: `plan` maps a
    linear layer's path within a layer to "colwise" or "rowwise" (ModelParts.tensor_plan)."""
    check_divisible(model.config, groups.size)
    for layer in layers:
        for path in plan:
            features = layer.get_submodule(path).weight.shape[0 if plan[path] == "colwise" else 1]
            if features % groups.size:
                raise UserError(f"config key 'parallel.tensor_parallel': {groups.size} does not divide the "
                                f"{features} features that {path} splits")
        # torch.distributed.tensor.parallel: the weights become DTensors sharded over the mesh
        parallelize_module(layer, groups.mesh, {path: STYLES[style]() for path, style in plan.items()})


def is_split(tensor: torch.Tensor) -> bool:
    """A DTensor with a slice on each rank (not a whole tensor on each)."""
    return isinstance(tensor, DTensor) and any(p.is_shard() for p in tensor.placements)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's values: a DTensor's local tensor (the same storage), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


# ---------------------------------------------------------------- gradients

def reduce_gradients(model, groups: TensorGroups, horovod_cfg):
    """Allreduce every gradient over the copies holding the same slices (one grouped Horovod
    allreduce, after backward), as local tensors."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:  # every copy must send the same list
            p.grad = torch.zeros_like(p)
    # Horovod: grouped allreduce of the local gradients over the copies
    distributed.allreduce_tensors([local(p.grad) for p in params], groups.copies_set, "grads.tensor_parallel",
                                  **distributed.reduction_options(horovod_cfg))


def clip_grad_norm_(model, groups: TensorGroups, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over the whole model: the squares of the split weights'
    slices summed over the group, the whole ones (equal on every rank) counted once."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm
    split_squares = norm([local(g) for g in grads if is_split(g)]) ** 2
    dist.all_reduce(split_squares, group=groups.group)  # torch.distributed: allreduce (sum) over the group
    total = (norm([local(g) for g in grads if not is_split(g)]) ** 2 + split_squares).sqrt()
    # as torch.nn.utils.clip_grads_with_norm_ does, on the local tensors (it takes parameters,
    # and one list of DTensor and plain gradients would not go through its foreach kernel)
    torch._foreach_mul_([local(g) for g in grads], (max_norm / (total + 1e-6)).clamp(max=1.0))
    return total


# ---------------------------------------------------------------- checkpoints

def whole_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (allgathered over its group: every rank of it calls this,
    in the same order), or the tensor itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def whole_state(model, optimizer) -> tuple[dict, dict]:
    """(weights, optimizer state) by name, whole (every rank of the group calls this, in the
    same order); a tied weight once, under its first name (a resume finds it by the others)."""
    weights, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if local(tensor).data_ptr() not in seen:
            seen.add(local(tensor).data_ptr())
            weights[name] = whole_tensor(tensor)
    return weights, checkpoint.optimizer_tensors(optimizer, model, whole_tensor)


def placed(model):
    """A checkpoint.load_weights / load_optimizer `place` for `model`: a whole saved tensor of a
    split parameter (or of its optimizer state, of the same shape) becomes a DTensor of the
    parameter's placements, each rank keeping its slice."""
    params = dict(model.named_parameters())

    def place(name: str, tensor: torch.Tensor) -> torch.Tensor:
        param = params.get(name)
        if not isinstance(param, DTensor) or tuple(tensor.shape) != tuple(param.shape):
            return tensor
        # every rank read the same whole tensor: each keeps its slice, nothing is sent
        return distribute_tensor(tensor.to(param.device), param.device_mesh, param.placements, src_data_rank=None)

    return place
