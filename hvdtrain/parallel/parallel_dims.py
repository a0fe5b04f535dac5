"""The layout of the workers: one grid from which every rank's coordinates, process group and
process set derive (torchtitan's ParallelDims is the model).

The world is a grid of named dimensions, outermost first: "pp" (pipeline stages), "dp"
(data-parallel copies, of a stage's experts where they are split), "ep" (the ranks of an expert
group, which hold different experts of each layer and read different samples: with "dp", the
copies of the stage's dense weights) and "tp" (the ranks of a tensor-parallel group, innermost,
so that a layer's ranks are neighbours on one node, as Megatron and torchtitan place them), so
rank = ((stage * dp + dp_rank) * ep + ep_rank) * tp + tp_rank. A parallelism to come adds a
dimension here, not a branch at every use: the ranks that share a collective are those that
differ along some dimensions only (`ParallelDims.group`), and every group of them is opened on
every rank in the same order (`ParallelDims.groups`), as torch.distributed's new_group and
Horovod's add_process_set require.

    hvd.init(process_sets="dynamic")                  # process sets are added after init
    layout = layout_for(hvd.rank(), hvd.size(), stages, tp=t)
    groups = open_groups(layout, "gloo")              # "nccl" on GPUs
    ... the pipeline (hvdtrain.parallel.pipeline), the split layers
    ... (hvdtrain.parallel.tensor_parallel) and Horovod's reductions use them ...
    groups.close()
"""
import dataclasses
import itertools
import math
import os
import socket
import sys
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hvdtrain.errors import UserError

try:  # as in distributed.py; the layout and its arithmetic work without Horovod
    import horovod.torch as hvd
except ImportError:  # pragma: no cover
    hvd = None


# ---------------------------------------------------------------- the grid

@dataclass(frozen=True)
class ParallelDims:
    """Named dimensions and their sizes, outermost first; their product is the world size."""
    dims: tuple[tuple[str, int], ...]

    @property
    def world_size(self) -> int:
        return math.prod(size for _, size in self.dims)

    def coords(self, rank: int) -> dict[str, int]:
        """Where `rank` sits along every dimension."""
        out = {}
        for name, size in reversed(self.dims):
            rank, out[name] = divmod(rank, size)
        return {name: out[name] for name, _ in self.dims}

    def rank_at(self, **coords: int) -> int:
        """The rank at these coordinates (a dimension not named: 0)."""
        rank = 0
        for name, size in self.dims:
            rank = rank * size + coords.get(name, 0)
        return rank

    def group(self, dims: str | tuple[str, ...], rank: int) -> list[int]:
        """The ranks that differ from `rank` along `dims` (a name or several) alone, in rank order."""
        names = (dims,) if isinstance(dims, str) else dims
        at, sizes = self.coords(rank), dict(self.dims)
        along = [name for name, _ in self.dims if name in names]  # outermost first: rank order
        return [self.rank_at(**{**at, **dict(zip(along, values))})
                for values in itertools.product(*(range(sizes[name]) for name in along))]

    def groups(self, dims: str | tuple[str, ...]) -> list[list[int]]:
        """Every group along `dims`, each once, in rank order of its first member: the order in
        which every rank opens them."""
        names = (dims,) if isinstance(dims, str) else dims
        firsts = [r for r in range(self.world_size) if all(self.coords(r)[name] == 0 for name in names)]
        return [self.group(dims, r) for r in firsts]


# ---------------------------------------------------------------- this rank's place in it

@dataclass(frozen=True)
class Layout:
    """Where this rank sits in the `stages x dp x tp` grid (with split experts the dp copies of
    a stage are dp / ep groups of ep ranks: the grid's "dp" x "ep").

    With `stages_per_rank` > 1 (interleaved schedules) the model is cut into
    stages * stages_per_rank pipeline stages and pipeline position s runs the stages
    s, s + stages, s + 2 * stages, ... (torch's loop order)."""
    stages: int               # p: ranks in one pipeline
    dp: int                   # copies of each stage (of its dense weights)
    stage: int                # this rank's position in its pipeline, 0 .. p-1
    dp_rank: int              # which copy, 0 .. dp-1
    stages_per_rank: int = 1
    tp: int = 1               # t: ranks of a tensor-parallel group, which hold the slices of each layer
    tp_rank: int = 0          # this rank's place in its group, 0 .. t-1
    ep: int = 1               # e: ranks of an expert group, among the copies (each holds 1/e of the experts)

    @property
    def grid(self) -> ParallelDims:
        return ParallelDims((("pp", self.stages), ("dp", self.dp // self.ep), ("ep", self.ep), ("tp", self.tp)))

    def at(self, dp_rank: int) -> dict[str, int]:
        """Copy `dp_rank`'s coordinates along "dp" and "ep"."""
        return {"dp": dp_rank // self.ep, "ep": dp_rank % self.ep}

    @property
    def rank(self) -> int:
        return self.grid.rank_at(pp=self.stage, **self.at(self.dp_rank), tp=self.tp_rank)

    @property
    def is_first(self) -> bool:
        """This rank holds the embeddings and reads input_ids."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """This rank holds the head and computes the loss."""
        return self.stage == self.stages - 1

    @property
    def num_stages(self) -> int:
        """Pipeline stages the model is cut into."""
        return self.stages * self.stages_per_rank

    @property
    def stage_ids(self) -> list[int]:
        """The pipeline stages this rank runs, in model order."""
        return [self.stage + k * self.stages for k in range(self.stages_per_rank)]

    def stage_ranks(self, stage: int) -> list[int]:
        """The ranks holding copies of pipeline position `stage` (and of this rank's slices):
        one data-parallel group."""
        return self.grid.group(COPIES, self.grid.rank_at(pp=stage, tp=self.tp_rank))

    def pipeline_ranks(self, dp_rank: int) -> list[int]:
        """The ranks of pipeline `dp_rank` (at this rank's slices), first stage first."""
        return self.grid.group("pp", self.grid.rank_at(**self.at(dp_rank), tp=self.tp_rank))


COPIES = ("dp", "ep")  # the dimensions along which the ranks hold copies of the same dense weights


def layout_for(rank: int, world_size: int, stages: int, stages_per_rank: int = 1, tp: int = 1, ep: int = 1) -> Layout:
    if stages < 1 or world_size % stages:
        raise UserError(f"parallel.pipeline_stages={stages} does not divide the {world_size} workers")
    if stages_per_rank < 1:
        raise UserError(f"parallel.stages_per_rank={stages_per_rank} must be at least 1")
    if tp < 1 or (world_size // stages) % tp:
        raise UserError(f"config key 'parallel.tensor_parallel': {tp} does not divide the {world_size // stages} "
                        f"workers{' of each pipeline stage' if stages > 1 else ''}")
    dp = world_size // (stages * tp)
    if ep < 1 or dp % ep:
        raise UserError(f"config key 'parallel.expert_parallel': {ep} does not divide the {dp} data-parallel "
                        f"copies{' of each pipeline stage' if stages > 1 else ''}")
    layout = Layout(stages=stages, dp=dp, stage=0, dp_rank=0, stages_per_rank=stages_per_rank, tp=tp, ep=ep)
    at = layout.grid.coords(rank)
    return dataclasses.replace(layout, stage=at["pp"], dp_rank=at["dp"] * ep + at["ep"], tp_rank=at["tp"])


# ---------------------------------------------------------------- process groups

@dataclass
class Groups:
    """The communicators of one rank; every rank created all of them, in the same order."""
    pipeline: dist.ProcessGroup | None  # this rank's pipeline (along "pp"), for send/recv and the grad norm; None when p = 1
    tied: dist.ProcessGroup | None      # {first, last stage} of this pipeline; None on other ranks or when p = 1
    process_set: object                 # Horovod process set of the copies (along "dp" and "ep") of this stage and slices
    tensor: DeviceMesh | None = None    # this rank's tensor-parallel group (along "tp"), for DTensor; None when t = 1
    added_sets: list = field(default_factory=list)  # what open_groups added, removed by close()

    def close(self):
        """Remove the process sets and the torch.distributed group (all ranks, same order)."""
        for process_set in self.added_sets:
            hvd.remove_process_set(process_set)  # Horovod: remove a process set (collective)
        dist.destroy_process_group()  # torch.distributed: destroy the groups


def open_groups(layout: Layout, backend: str) -> Groups:
    """Open torch.distributed inside horovodrun workers, then the groups of the layout: with
    pipeline stages a torch.distributed group per pipeline (the ranks along "pp") and one of its
    two ends (the tied embedding); with split layers a torch.distributed group per tensor-parallel
    group (along "tp", as a DeviceMesh), which must lie within one host; a Horovod process set per
    set of copies (along "dp" and "ep").

    Needs `hvd.init(process_sets="dynamic")` (or HOROVOD_DYNAMIC_PROCESS_SETS=1 before hvd.init):
    the data-parallel process sets are added here. No launcher flags or MASTER_* variables are
    needed: rank 0 opens a TCP store on a port the OS picks and sends its address to the others
    with Horovod. The store's host is MASTER_ADDR if set, else the host name horovodrun gave
    rank 0 (HOROVOD_HOSTNAME), else this machine's name; other hosts must reach it by that name."""
    grid, rank = layout.grid, layout.rank
    if layout.tp > 1:
        check_tensor_groups_share_hosts(layout.tp)  # Horovod: allgather
    init_torch_distributed(backend)
    # dist.new_group and hvd.add_process_set are collective: every rank makes every group, same order.
    pipeline = tied = tensor = None
    if layout.stages > 1:
        pipeline = _new_groups(grid, "pp", rank)
        for ranks in grid.groups("pp"):
            group = dist.new_group([ranks[0], ranks[-1]])  # torch.distributed: new group (collective)
            if rank in (ranks[0], ranks[-1]):
                tied = group
    if layout.tp > 1:
        tensor = DeviceMesh.from_group(_new_groups(grid, "tp", rank), "cuda" if backend == "nccl" else "cpu")
    process_set, added = add_process_sets(grid, COPIES, rank)  # Horovod: process sets
    return Groups(pipeline, tied, process_set, tensor, added)


def _new_groups(grid: ParallelDims, dim: str, rank: int) -> dist.ProcessGroup:
    """A torch.distributed group for every group along `dim` (every rank makes each, in the
    same order); this rank's."""
    mine = None
    for ranks in grid.groups(dim):
        group = dist.new_group(ranks)  # torch.distributed: new group (collective)
        if rank in ranks:
            mine = group
    return mine


def check_tensor_groups_share_hosts(t: int):
    """Horovod numbers the ranks host by host: each group of t neighbouring ranks is one host's
    when t divides every host's count of workers; else a one-line error."""
    counts = set(hvd.allgather_object(hvd.local_size(), name="tensor_parallel.hosts"))  # Horovod: allgather
    if any(count % t for count in counts):
        raise UserError(f"config key 'parallel.tensor_parallel': {t} does not divide the workers of each host "
                        f"({' or '.join(map(str, sorted(counts)))}): a group's workers must share a host's links")


def init_torch_distributed(backend: str):
    """Open torch.distributed inside horovodrun workers (its default group: every rank). No
    launcher flags or MASTER_* variables are needed: see _rendezvous_store."""
    # init_process_group installs an excepthook that writes "[rankN]: " before every line of a
    # traceback; horovodrun already tags each line with its rank, and hvdtrain.launching.relay must see
    # the traceback as the worker's Python printed it to show it.
    excepthook = sys.excepthook
    # torch.distributed: init over a store whose address comes by Horovod broadcast
    dist.init_process_group(backend, store=_rendezvous_store(), rank=hvd.rank(), world_size=hvd.size())
    sys.excepthook = excepthook


def add_process_sets(grid: ParallelDims, dims: str | tuple[str, ...], rank: int) -> tuple[object, list]:
    """A Horovod process set for every group along `dims`, added by every rank in the same order
    (Horovod needs hvd.init(process_sets="dynamic")): (this rank's set, the sets added). A set
    of all ranks is Horovod's global one (it refuses a second); a set of one rank is added as
    any other (its collectives send nothing), as open_groups adds a stage's only copy."""
    mine, added = None, []
    for ranks in grid.groups(dims):
        if len(ranks) == grid.world_size:
            process_set = hvd.global_process_set
        else:
            process_set = hvd.add_process_set(ranks)  # Horovod: add a process set (collective)
            added.append(process_set)
        if rank in ranks:
            mine = process_set
    return mine, added


def _rendezvous_store() -> dist.TCPStore:
    """A TCPStore on rank 0; horovodrun's own rendezvous server lives in the launcher, not on rank 0."""
    rank, world_size = hvd.rank(), hvd.size()
    if rank == 0:
        host = os.environ.get("MASTER_ADDR") or os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
        store = dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False)
        hvd.broadcast_object((host, store.port), root_rank=0, name="pipeline.store")  # Horovod: broadcast
        return store
    host, port = hvd.broadcast_object(None, root_rank=0, name="pipeline.store")  # Horovod: broadcast
    return dist.TCPStore(host, port, world_size, is_master=False)
