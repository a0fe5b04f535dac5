"""The training state: everything a checkpoint saves and a resume restores, owned in one place.

    model, optimizer, grad scaler      the numbers being trained
    step, position                     optimizer steps taken; samples of the data stream consumed
    RNG states of every rank           so dropout continues exactly (hvdtrain.training.rng)
    the config and world size          to check a resume is compatible and to rebuild the model

`save` and `load_and_share` are collective: every rank calls them at the same point. Rank 0 reads
and writes the files (hvdtrain.checkpointing.checkpoint); what every rank must hold equal after a resume
(weights, optimizer state, loss scale, progress) is broadcast from rank 0, so the replicas
cannot drift apart.
"""
import logging
from pathlib import Path

from hvdtrain.checkpointing import checkpoint
from hvdtrain.parallel import distributed, expert_parallel, tensor_parallel
from hvdtrain.training import rng
from hvdtrain.config import Config
from hvdtrain.errors import UserError
from hvdtrain.observe.metrics import FILE_NAME
from hvdtrain.models.ties import tie_aliases
from hvdtrain.parallel.sharded_optimizer import ShardedOptimizer

log = logging.getLogger(__name__)

# A resume must continue the same model on the same sample stream: every key of the `model`
# and `data` sections must match the checkpoint's, except these, which change how the run
# executes, not what it computes. (A new key is thus checked unless it is added here.)
MAY_CHANGE_ON_RESUME = {"model.dropout", "model.compile", "model.activation_checkpointing", "data.num_workers",
                        "data.num_proc", "data.cache_dir"}
ALSO_MUST_MATCH = ("train.seed",)  # the sample order and the masks are drawn from it


def resume_problem(saved: dict, cfg: Config, path: Path) -> str | None:
    """Why the checkpoint at `path` (its saved config `saved`) cannot continue `cfg`, or None."""
    current = cfg.to_dict()
    keys = [f"{section}.{key}" for section in ("model", "data") for key in current[section]]
    for dotted in [k for k in keys if k not in MAY_CHANGE_ON_RESUME] + list(ALSO_MUST_MATCH):
        section, key = dotted.split(".")
        now, then = current[section][key], saved.get(section, {}).get(key)
        if now != then:
            return (f"config key '{dotted}' is {now!r} but the checkpoint {path} was written with {then!r}; "
                    f"use another out_dir to start afresh")
    return None


def find_resume_checkpoint(cfg: Config, world) -> Path | None:
    """The checkpoint this run continues from, decided on rank 0 (`resume_decision`) and told
    to every rank; collective. Plain and elastic jobs call it alike (an elastic job on its
    first entry into the elastic function)."""
    path, problem = None, None
    if world.is_main:
        try:
            path = resume_decision(cfg)
        except UserError as e:
            problem = str(e)
    path, problem = distributed.broadcast_object((path, problem), name="resume_checkpoint")  # Horovod: broadcast
    if problem:
        raise UserError(problem)
    return path


def resume_decision(cfg: Config) -> Path | None:
    """Where a run in cfg.out_dir starts: from its newest intact checkpoint, or afresh (None)
    in a folder that holds no run; any other case is refused (UserError).

    checkpoint.resume=false: a folder that holds a run is refused before it is touched,
    whatever state its files are in: a new run must neither delete nor append to another
    run's files, and a checkpoint being written there (`.tmp-step_N`) may be a live run's.
    checkpoint.resume=true: the folder's run is continued, so a crash's leftovers are
    recovered first and damaged checkpoints set aside. When its checkpoints are all damaged the
    run is refused rather than restarted at step 0 (as Megatron and torchtitan stop at a
    checkpoint they cannot load): starting that run again is the user's decision. A run that
    stopped before its first checkpoint (a requeued job killed early) starts again at step 0,
    saying so; its run log keeps none of the earlier attempt's step records."""
    out = Path(cfg.out_dir)
    run_files = [p for p in [out / FILE_NAME, *sorted(checkpoint.checkpoint_dir(out).glob("*"))] if p.exists()]
    if not cfg.checkpoint.resume:
        if run_files:
            raise UserError(f"out_dir '{out}' holds another run and checkpoint.resume is false; choose another "
                            f"out_dir, or move that run away first")
        return None
    checkpoint.recover_interrupted_writes(out)
    path = checkpoint.newest_intact_checkpoint(out)
    if path is None:
        damaged = sorted(p.name for p in checkpoint.checkpoint_dir(out).glob("damaged-*"))
        if damaged:
            raise UserError(f"out_dir '{out}' holds a run but no intact checkpoint to continue it from (set aside "
                            f"as damaged: {', '.join(damaged)}); to start it again from step 0, move that run away "
                            f"first, or choose another out_dir")
        if run_files:
            log.info(f"out_dir '{out}' holds a run that stopped before its first checkpoint: starting it again "
                     f"from step 0")
        return None
    problem = resume_problem(checkpoint.read_state(path)["config"], cfg, path)
    if problem:
        raise UserError(problem)
    return path


class TrainingState:
    """With pipeline stages (`layout` given) `model` is this worker's stage, under the whole
    model's parameter names: each stage reads and writes its own part of a checkpoint, so no
    weight passes through rank 0, and a checkpoint of any layout loads into any other. With a
    sharded optimizer (hvdtrain.parallel.sharded_optimizer) every worker reads and writes its own slices.
    `aliases`: the whole model's tied parameter names (tie_aliases). With split experts
    (`expert_groups`: hvdtrain.parallel.expert_parallel) every worker reads its experts' rows
    and the ranks of the first expert group write them. With split layers (`tensor_groups`:
    hvdtrain.parallel.tensor_parallel) every worker reads the whole tensors and keeps its
    slices; the first copy's ranks gather them whole and its first rank writes them. The ranks of
    a tensor-parallel group draw the same random numbers (dropout of the whole activations)."""

    def __init__(self, model, optimizer, scaler, world, cfg: Config, layout=None, aliases=None, expert_groups=None,
                 tensor_groups=None):
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.world, self.cfg, self.layout, self.expert_groups = world, cfg, layout, expert_groups
        self.tensor_groups = tensor_groups
        self.aliases = aliases if aliases is not None else tie_aliases(model)
        self.sharded = isinstance(optimizer, ShardedOptimizer)
        self.step = 0
        self.position = 0

    def load_and_share(self, path: Path | None):
        """Start from `path` (a checkpoint) or afresh; collective. Without pipeline stages rank 0
        reads the checkpoint and broadcasts; with them, or sharded, every worker reads its stage's
        part, or its slices (the copies start equal anyway: the same seed, the same files). (An
        elastic job's rollback to its in-memory commit is local: hvdtrain.parallel.elastic.ElasticState.restore.)"""
        saved = None
        every_rank_reads = (self.layout is not None or self.sharded or self.expert_groups is not None
                            or self.tensor_groups is not None)
        part = (checkpoint.whole if self.expert_groups is None else expert_parallel.local_rows(
            self.model, expert_parallel.expert_weight_names(self.model), self.expert_groups))
        place = checkpoint.as_saved if self.tensor_groups is None else tensor_parallel.placed(self.model, self.tensor_groups)
        if path is not None and (self.world.is_main or every_rank_reads):
            # parallel.shard=full: the weights are the master slices (the optimizer's load); the
            # model holds no values to load, and its buffers are its constructors'
            if not (self.sharded and self.optimizer.level == "full"):
                checkpoint.load_weights(self.model, path, self.aliases, part, place)
            if self.sharded:
                self.optimizer.load(path, self.aliases, None if self.tensor_groups is None else place)
            else:
                checkpoint.load_optimizer(self.optimizer, self.model, path, self.aliases, part, place)
        if path is not None and self.world.is_main:
            saved = checkpoint.read_state(path)
            saved["rngs"] = checkpoint.read_rngs(path, saved["world_size"])
        if not every_rank_reads:
            # Horovod: broadcast parameters (and optimizer state) from rank 0
            distributed.broadcast_state(self.model, self.optimizer, resumed=path is not None)
        saved = distributed.broadcast_object(saved, name="training_state")  # Horovod: broadcast from rank 0
        seed, rank = self.cfg.train.seed, self.world.rank
        # the random streams: one per rank, or per tensor-parallel group (its ranks, neighbours, drop alike)
        stream = rank // self.cfg.parallel.tensor_parallel
        if saved is None:
            rng.reseed_for_training(seed, stream, 0)
            return
        self.step, self.position = saved["step"], saved["position"]
        if saved["scaler"] and self.scaler.is_enabled():  # the same loss scale on every rank
            self.scaler.load_state_dict(saved["scaler"])
        if saved["world_size"] == self.world.size:
            rng.restore(saved["rngs"][rank])
        else:  # another world size: no rank's stream continues, derive new ones
            rng.reseed_for_training(seed, stream, self.step)

    def save(self):
        """Write a checkpoint of the current step; collective (every rank gives its RNG state,
        each writer its part, fsynced and checksummed, rank 0 the rest and the manifest once
        all parts are on disk)."""
        rngs = distributed.allgather_object(rng.capture(), name="rng")  # Horovod: allgather
        tmp = checkpoint.begin_checkpoint(self.cfg.out_dir, self.step) if self.world.is_main else None
        tmp = distributed.broadcast_object(tmp, name="checkpoint_folder")  # Horovod: broadcast from rank 0
        if self.tensor_groups is not None:  # the first copy (of each stage) gathers the whole tensors, its first rank writes
            part = {}
            # sharded: each copy's slices of its local tensors, gathered over the copies
            local_state = self.optimizer.gathered() if self.sharded else None  # Horovod: allgather
            if self.tensor_groups.dp_rank == 0:
                weights, state = local_state or (  # torch.distributed: allgather of each split tensor over the group
                    self.model.state_dict(),
                    checkpoint.optimizer_tensors(self.optimizer, self.model, tensor_parallel.whole_tensor))
                weights, state = tensor_parallel.whole_state(weights, state, self.model, self.tensor_groups)
                index, count = (0, 1) if self.layout is None else (self.layout.stage, self.layout.stages)
                if self.tensor_groups.rank == 0:
                    part = checkpoint.write_slices(tmp, index, count, weights, state)
        elif self.sharded:  # every worker: its slices
            part = self.optimizer.write_part(tmp, self.world.rank, self.world.size)
        elif self.expert_groups is not None:  # the first expert group (of each stage): its experts' rows (its rank 0: the rest)
            groups = self.expert_groups
            stage, stages = (0, 1) if self.layout is None else (self.layout.stage, self.layout.stages)
            part = (expert_parallel.write_part(tmp, stage * groups.size + groups.rank, stages * groups.size, self.model,
                                               self.optimizer, expert_parallel.expert_weight_names(self.model), groups)
                    if groups.copy == 0 else {})
        else:
            if self.layout is None:
                index, count, writer = 0, 1, self.world.is_main
            else:  # the first copy of each stage
                index, count, writer = self.layout.stage, self.layout.stages, self.layout.dp_rank == 0
            part = checkpoint.write_part(tmp, index, count, self.model, self.optimizer) if writer else {}
        # Once every part is on disk, rank 0 has their manifest entries (not their bytes).
        parts = distributed.allgather_object(part, name="checkpoint_parts")  # Horovod: allgather
        if self.world.is_main:
            checkpoint.finish_checkpoint(
                tmp, self.step, self.model.config,
                {"step": self.step, "position": self.position, "world_size": self.world.size,
                 "scaler": self.scaler.state_dict(), "config": self.cfg.to_dict()},
                rngs, keep=self.cfg.checkpoint.keep, parts={k: v for p in parts for k, v in p.items()})
        # Nobody leaves before the checkpoint is in place: a worker that exits right after (a
        # preempted run) must not make the launcher kill rank 0 while it renames.
        distributed.barrier("checkpoint_done")  # Horovod: barrier
