"""The weights of `parallel.shard: full` (ZeRO stage 3, FSDP's idea over Horovod): between uses
a parameter holds no values, only its shape; this copy's fp32 master slice of it (the
hvdtrain.parallel.sharded_optimizer.ShardedOptimizer's) is the weights' one home.

The model is cut into units, in the order the forward runs them (`units_of`): the embeddings
(the family's first_only modules), each transformer block, the head (last_only: the final norm
and the output projection, with a masked LM's transform). Module hooks on the units:

    forward pre-hook     gather this unit (wait for its prefetch, or allgather now), free every
                         other unit but the next, start the next unit's allgather (prefetch)
    backward pre-hook    the same in backward order: gather this unit again (its backward needs
                         the weights autograd saved), free the others but the one before, start
                         its allgather. Under activation checkpointing the recompute runs inside
                         the block's backward, after this hook: the block is already there.
    (after backward)     the gradients are the ShardedOptimizer's: each parameter's
                         reduce-scattered from its post-accumulate-grad hook, as soon as its
                         backward ends, and the full gradient freed (as with "gradients");
                         Horovod's tensor fusion runs them about one collective per unit
                         (measured, docs/memory.md), without holding a unit's gradients
                         until its last one is complete, as a grouped reduce-scatter would
                         `free_all` once the micro batch's backward (or an evaluation) is done

A gather is one Horovod grouped allgather of the unit's master slices (async: its handle is
kept until the unit is needed; with expert parallelism two, the experts' weights gathered over
the copies holding the same experts, the rest over all) in the parameters' dtype (sharded_optimizer.on_the_wire: bf16
weights move 2 bytes a parameter), copied into the parameters. Freeing gives a parameter's
storage back (`untyped_storage().resize_(0)`, as torch's first FSDP did): the tensors autograd
saved for backward share that storage, so the next gather refills what they see. A parameter
two units use (GPT-2's wte, also the output projection) is freed when neither holds it. At most
three units are whole at a time: the one running, the next one arriving, and (at a unit's first
hook) the one before, until it is freed.

With pipeline stages (1F1B interleaves forwards and backwards of different micro batches) the
rule is the same: a unit is gathered before each use and freed at another unit's hook.

With tensor parallelism a split parameter is a DTensor: what is sharded, gathered and freed is
its local tensor, this rank's slice of the layer, over the copies holding the same slices (the
ShardedOptimizer's); the model is then built whole on each rank and split, not a unit at a time.

Parameters in no unit (none in hvdtrain's families) stay whole.
"""
import ctypes
import warnings

import torch

from hvdtrain.models import family_of
from hvdtrain.models.common import switch
from hvdtrain.parallel.sharded_optimizer import off_the_wire, on_the_wire, shard_range
from hvdtrain.parallel.tensor_parallel import is_split, local

# The embeddings' inputs are token ids: their backward pre-hook fires on the outputs' gradients
# alone, which is what it is for here; torch warns about it on every run.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect "
                                          "to module outputs since no inputs require gradients")

try:  # as in distributed.py
    import horovod.torch as hvd
except ImportError:  # pragma: no cover
    hvd = None


def units_of(model: torch.nn.Module) -> list[tuple[str, list[torch.nn.Module]]]:
    """(name, modules) of the model's (or pipeline stage's) units, in forward order: the
    embeddings, each transformer block, the head; those the stage does not hold left out. The
    modules are those the hooks go on: a block, and each module of the embeddings and the head
    that holds parameters of its own."""
    parts = getattr(model, "parts", None) or family_of(model).modeling().PARTS
    layers = model.layers if hasattr(model, "layers") else model.get_submodule(parts.layers)

    def present(paths):
        found = []
        for path in paths:
            try:
                module = model.get_submodule(path)
            except AttributeError:  # a pipeline stage without it
                continue
            if module is not None:
                found.append(module)
        return found

    def owners(modules):  # the embeddings' and head's parts may be called one by one (a masked LM's transform)
        return [m for top in modules for m in top.modules() if next(m.parameters(recurse=False), None) is not None]

    units = [("embeddings", owners(present(parts.first_only)))]
    units += [(f"block {name}", [block]) for name, block in layers.named_children()]
    units.append(("head", owners(present(parts.last_only))))
    return [(name, modules) for name, modules in units if modules]


def materialise_slices(blueprint, model: torch.nn.Module, rank: int, size: int, dtype: torch.dtype,
                       device: torch.device, level: str) -> dict[int, torch.Tensor]:
    """The build of a sharded model (parallel.shard `level`, copy `rank` of `size`): `model` (a
    Blueprint's model or stage, on the meta device) made real one unit at a time
    (Blueprint.materialise's groups) in fp32 on the host, and each unit, once filled, put where
    training keeps it before the next is made: this copy's fp32 master slices on `device`
    (where they are not views into fp32 weights), and the weights there in `dtype`; with "full"
    the weights hold no values (ShardedWeights gathers them when they are used). Returns the
    master slices by id(parameter), for the ShardedOptimizer. At most one unit is whole in fp32
    on the host at a time, and with "full" on the device never: a model larger than the host or
    the GPU can start. Parameters in no unit, and those not trained, are made whole on the host
    as without sharding (model.to moves them)."""
    masters = {}

    def take(params):
        for p in params:
            if not p.requires_grad:  # not the optimizer's
                continue
            if level == "full" or dtype != torch.float32:  # else the optimizer views the fp32 weights
                start, end = shard_range(p.numel(), rank, size)
                masters[id(p)] = p.detach().view(-1)[start:end].to(device, torch.float32, copy=True)
            if level == "full":
                p.data = torch.empty(p.shape, dtype=dtype, device=device)
                p.data.untyped_storage().resize_(0)
            else:
                p.data = p.data.to(device, dtype)
        _trim_host_heap()

    groups = [[p for m in modules for p in m.parameters()] for _, modules in units_of(model)]
    blueprint.materialise(model, groups, take)
    return masters


def _trim_host_heap():
    """Give the host memory of the unit just freed back to the system (glibc's malloc_trim).
    Without it glibc keeps the freed blocks in its heap, and the master slices allocated
    between them (on a CPU run) fragment it: measured, building 16 x 1024 at d=2 rose by 613
    MB instead of 447 (403 of them the masters)."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only
    if trim is not None:
        trim(0)


def values(param: torch.nn.Parameter) -> torch.Tensor:
    """The tensor whose storage holds `param`'s values on this rank, without autograd: a split
    parameter's (a DTensor's) local tensor, its slice of the layer."""
    return local(param.data)


class _Unit:
    def __init__(self, index: int, name: str, modules: list[torch.nn.Module], slices: list):
        self.index, self.name, self.modules, self.slices = index, name, modules, slices
        # its slices by the Horovod process set of the copies they are sharded over: one gather each
        self.by_copies = {}
        for s in slices:
            self.by_copies.setdefault(s.copies.process_set, []).append(s)
        self.handles = []       # its allgathers, started and not yet waited for
        self.gathered = False   # its parameters hold their values (for this unit)


class ShardedWeights:
    """Installs the gather/free hooks on `model`'s units over `optimizer`'s master slices and
    frees the weights. `free_all()` before each step and after each evaluation; `close()` at
    the run's end."""

    def __init__(self, model: torch.nn.Module, optimizer):
        self.optimizer = optimizer
        by_param = optimizer.by_param
        self.units, covered = [], set()
        for name, modules in units_of(model):
            params = {id(p): p for m in modules for p in m.parameters() if id(p) in by_param}
            covered.update(params)
            self.units.append(_Unit(len(self.units), name, modules, [by_param[i] for i in params]))
        self.holders = {id(s.param): 0 for u in self.units for s in u.slices}  # units holding each gathered
        self.prefetch = switch("HVDTRAIN_PREFETCH") == "on"
        for s in optimizer.slices:
            if id(s.param) in covered:
                values(s.param).untyped_storage().resize_(0)
        for unit in self.units:
            for module in unit.modules:
                module.register_forward_pre_hook(lambda *_, u=unit: self._forward(u))
                module.register_full_backward_pre_hook(lambda *_, u=unit: self._backward(u))

    # ------------------------------------------------------------ hooks

    def _forward(self, unit: _Unit):
        if torch._C._current_graph_task_id() != -1:  # a recompute inside backward: just be there
            self._gather(unit)
            return
        self._use(unit, nxt=unit.index + 1)

    def _backward(self, unit: _Unit):
        self._use(unit, nxt=unit.index - 1)

    def _use(self, unit: _Unit, nxt: int):
        self._gather(unit)
        for other in self.units:
            if other is not unit and other.index != nxt:
                self._free(other)
        if self.prefetch and 0 <= nxt < len(self.units):
            self._start(self.units[nxt])

    # ------------------------------------------------------------ gather and free

    def _start(self, unit: _Unit):
        if unit.gathered or unit.handles:
            return
        for i, (process_set, slices) in enumerate(unit.by_copies.items()):
            # Horovod: grouped allgather of the unit's master slices over their copies, in the background
            unit.handles.append(hvd.grouped_allgather_async([on_the_wire(s) for s in slices],
                                                            name=f"shard.unit.{unit.index}.{i}",
                                                            process_set=process_set))

    @torch.no_grad()
    def _gather(self, unit: _Unit):
        if unit.gathered:
            return
        self._start(unit)
        for slices, handle in zip(unit.by_copies.values(), unit.handles):
            wholes = hvd.synchronize(handle)  # Horovod: wait for the unit's allgather
            for s, whole in zip(slices, wholes):
                if self.holders[id(s.param)] == 0:  # else another unit holds it, with the same values
                    data = values(s.param)
                    data.untyped_storage().resize_(data.numel() * data.element_size())
                    data.view(-1).copy_(off_the_wire(whole, data.dtype))
                self.holders[id(s.param)] += 1
        unit.handles = []
        unit.gathered = True

    def _free(self, unit: _Unit):
        for handle in unit.handles:  # a prefetch no one waited for: its result is dropped
            hvd.synchronize(handle)
        unit.handles = []
        if not unit.gathered:
            return
        for s in unit.slices:
            self.holders[id(s.param)] -= 1
            if self.holders[id(s.param)] == 0:
                values(s.param).untyped_storage().resize_(0)
        unit.gathered = False

    def free_all(self):
        for unit in self.units:
            self._free(unit)

    def close(self):
        """At the run's end: every unit freed, and each parameter left as an empty tensor (its
        values are in the checkpoint and the exported folder), which fails plainly if read."""
        self.free_all()
        for unit in self.units:
            for s in unit.slices:
                if not is_split(s.param):
                    s.param.data = torch.empty(0, dtype=s.param.dtype, device=s.param.device)
            # A split one (a DTensor) keeps its shape over the freed storage, which a read would
            # run past (a crash, not an error): an empty plain parameter takes its place.
            for module in unit.modules:
                for owner in module.modules():
                    for name, param in list(owner.named_parameters(recurse=False)):
                        if is_split(param):
                            empty = torch.empty(0, dtype=param.dtype, device=param.device)
                            setattr(owner, name, torch.nn.Parameter(empty, param.requires_grad))
