"""Elastic training: a lost worker or host does not stop the run, and new workers join it.

Horovod Elastic (`horovodrun --min-np/--max-np`, what `hvdtrain launch --elastic` starts) keeps
the surviving processes alive when a worker dies, rolls them back to the last in-memory commit
and continues with the new set of workers; added workers join at the next commit. The training
function runs under `hvd.elastic.run`, so every collective happens inside it: on each (re)entry
everything that depends on the world size is derived again from the committed state (the
accumulation for the fixed global batch, the sampler at the committed stream position, the
token normaliser, the run log on whichever process is rank 0 now) and the step loop of
hvdtrain.training.train continues. The global batch and the data order do not change when the world
does, so the losses equal an undisturbed run (no sample is repeated or skipped: the redone steps
after a rollback read the same samples, and their records replace the first ones: hvdtrain.observe.run_log):
within fp32 rounding, as another world size sums the gradients in another order, and bitwise
for a job of two workers down to one, which sums them as the two did where its micro batches
are theirs (stands_in_for_two); each reset's record says which (gradient_sums).

What a commit holds (ElasticState): the model, the optimizer, the grad scaler, the step and the
stream position, in host memory on every worker. Its sync broadcasts rank 0's, like
hvdtrain.parallel.distributed.broadcast_state: the optimizer state only when rank 0 has one, so a fresh
AdamW never takes Horovod's dummy step. RNG streams are derived from (seed, rank, step) after
every reset, as on a resume with another world size.

Where the job starts is decided as in a plain run, on the job's first entry into the elastic
function (hvdtrain.training.training_state.find_resume_checkpoint: rank 0 decides or refuses, every
worker takes rank 0's checkpoint); workers that join later get the decision with the sync.
"""
import horovod.torch as hvd
import torch
from horovod.common.elastic import State
from horovod.common.exceptions import HostsUpdatedInterrupt

from hvdtrain.parallel import distributed
from hvdtrain.training import rng
from hvdtrain.config import Config, resolve_batch
from hvdtrain.data import build_data
from hvdtrain.errors import UserError
from hvdtrain.paths import check_writable_folder
from hvdtrain.training.step_engine import build_engine
from hvdtrain.training.train import Setup, build_model_and_optimizer, check_data, run_steps
from hvdtrain.training.training_state import TrainingState, find_resume_checkpoint


class ElasticState(State):
    """The in-memory commit of a TrainingState (see the module's docstring)."""

    def __init__(self, training: TrainingState):
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank)
        self.training = training
        self.last_reset = None  # (why, steps rolled back, world size before), for the run log
        # Whether the job took its resume decision (on its first entry), and the checkpoint it
        # resumed from: rank 0's, synced to workers that join later.
        self.resume_decided, self.resumed_from = False, None
        # The most workers the job has had: a job of 2 down to 1 sums its gradients as the 2 did
        # (hvdtrain.training.step_engine.StandInStep), so it goes on as if undisturbed, bitwise.
        self.largest_world = training.world.size
        self.save()

    def save(self):
        """The commit, in host memory: on a GPU a copy on the device would take as much memory
        again as the model and its optimizer state."""
        t = self.training
        self.saved = {"model": host_copy(t.model.state_dict()), "optimizer": host_copy(t.optimizer.state_dict()),
                      "scaler": t.scaler.state_dict(), "step": t.step, "position": t.position}

    def restore(self):
        """After a lost worker: back to the last commit; the interrupted step's gradients dropped.
        Loading puts every tensor back on its parameter's device (the optimizer casts its
        state to the parameter's device and dtype itself)."""
        t = self.training
        self.last_reset = ("a worker was lost", t.step - self.saved["step"], t.world.size)
        t.model.load_state_dict(self.saved["model"])
        t.optimizer.load_state_dict(self.saved["optimizer"])
        if self.saved["scaler"]:
            t.scaler.load_state_dict(self.saved["scaler"])
        t.step, t.position = self.saved["step"], self.saved["position"]

    def sync(self):
        """Rank 0's committed state on every worker, the new ones included."""
        t = self.training
        # Horovod: broadcasts from rank 0
        has_optimizer_state = hvd.broadcast_object(len(t.optimizer.state) > 0, root_rank=0, name="elastic.has_state")
        distributed.broadcast_state(t.model, t.optimizer, resumed=has_optimizer_state)
        progress = hvd.broadcast_object((t.step, t.position, t.scaler.state_dict(), self.resume_decided,
                                         self.resumed_from, self.largest_world), root_rank=0, name="elastic.progress")
        t.step, t.position, scaler, self.resume_decided, self.resumed_from, self.largest_world = progress
        if scaler and t.scaler.is_enabled():
            t.scaler.load_state_dict(scaler)
        self.save()


def host_copy(tree):
    """A copy of a state dict (nested dicts and lists) whose tensors are in host memory and
    share nothing with the live ones."""
    if torch.is_tensor(tree):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: host_copy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(host_copy(v) for v in tree)
    return tree  # numbers, strings, None: immutable


def check_elastic_config(cfg: Config):
    if cfg.train.global_batch_size is None:
        raise UserError("config key 'train.global_batch_size': an elastic job needs a fixed global batch "
                        "(the accumulation absorbs a change of the number of workers), got null")
    if cfg.parallel.pipeline_stages > 1:
        raise UserError("config key 'parallel.pipeline_stages': elastic jobs do not support pipeline stages "
                        f"(got {cfg.parallel.pipeline_stages}); use 1, or a fixed number of workers")
    if cfg.parallel.shard != "none":  # the shards would have to re-form after every reset
        raise UserError(f"config key 'parallel.shard': elastic jobs do not support sharding (got "
                        f"{cfg.parallel.shard!r}); use none, or a fixed number of workers")
    if cfg.parallel.expert_parallel > 1:  # the expert groups would have to re-form after every reset
        raise UserError(f"config key 'parallel.expert_parallel': elastic jobs do not support expert parallelism "
                        f"(got {cfg.parallel.expert_parallel}); use 1, or a fixed number of workers")
    if cfg.parallel.tensor_parallel > 1:  # the tensor-parallel groups would have to re-form after every reset
        raise UserError(f"config key 'parallel.tensor_parallel': elastic jobs do not support tensor parallelism "
                        f"(got {cfg.parallel.tensor_parallel}); use 1, or a fixed number of workers")


def stands_in_for_two(cfg: Config, world_size: int, largest_world: int) -> bool:
    """Whether the one worker left of a job of two can stand in for both (StandInStep); see
    why_one_cannot_stand_in_for_two."""
    return world_size == 1 and largest_world == 2 and why_one_cannot_stand_in_for_two(cfg) is None


def why_one_cannot_stand_in_for_two(cfg: Config) -> str | None:
    """Why one worker's micro batches are not exactly those of two (the first worker's, then
    the second's), or None when they are: the global batch must be even, and the one worker must
    accumulate twice as many micro batches as each of the two (hvdtrain.data.sampler cuts every
    share evenly): 16 in micro batches of 4 (2 x 2, then 4), not 24 in micro batches of 8 (2 of 6
    on each of two, 3 of 8 on one)."""
    global_batch = cfg.train.global_batch_size
    one, _ = resolve_batch(cfg, 1)
    two, _ = resolve_batch(cfg, 2)
    if global_batch % 2:
        return f"the global batch {global_batch} is odd"
    if one != 2 * two:
        return (f"one worker accumulates {one} micro batches where each of two accumulated {two} "
                f"(train.global_batch_size={global_batch}, train.micro_batch_size={cfg.train.micro_batch_size})")
    return None


def gradient_sums(cfg: Config, world_size: int, largest_world: int) -> str:
    """What a reset's record says of the run from now on: bitwise the undisturbed run (one
    worker standing in for two), or equal to it within rounding, and why."""
    if stands_in_for_two(cfg, world_size, largest_world):
        return "summed as the 2 workers did (bitwise the undisturbed run)"
    if world_size == 1 and largest_world == 2:
        why = f"the worker left cannot sum as the 2 did: {why_one_cannot_stand_in_for_two(cfg)}"
    else:
        why = f"a world of {world_size} sums in another order"
    return f"summed in another order: equal to the undisturbed run within rounding ({why})"


def train_elastic(cfg: Config) -> torch.nn.Module:
    """`train` for an elastic job: set-up without collectives, then the loop under hvd.elastic.run."""
    check_elastic_config(cfg)
    check_writable_folder(cfg.out_dir, "out_dir")
    world = distributed.init(cfg)  # Horovod: hvd.init
    device = world.device
    grad_accum, _ = resolve_batch(cfg, world.size)
    data = build_data(cfg, cfg.train.seed)  # each process for itself: the cache's writes are atomic
    model, optimizer, scaler, aliases, peak_lr, _ = build_model_and_optimizer(cfg, data, device, grad_accum,
                                                                               world.size)
    state = TrainingState(model, optimizer, scaler, world, cfg, aliases=aliases)

    @hvd.elastic.run
    def run(elastic_state: ElasticState) -> torch.nn.Module:
        # Everything that depends on the world, derived again on every (re)entry.
        now = distributed.current_world(device)
        state.world = now
        if not elastic_state.resume_decided:  # the job's first entry: the decision of a plain run
            elastic_state.resumed_from = find_resume_checkpoint(cfg, now)  # Horovod: broadcast
            state.load_and_share(elastic_state.resumed_from)  # Horovod: broadcast
            elastic_state.resume_decided = True
            elastic_state.save()  # a worker lost from here on rolls back to the resumed state
        grad_accum, global_batch = resolve_batch(cfg, now.size)
        optimizer.set_backward_passes_per_step(grad_accum)  # also forgets half-counted backward passes
        optimizer._handles.clear()  # allreduces of an interrupted step belong to the old world
        distributed.zero_grad(optimizer)
        rng.reseed_for_training(cfg.train.seed, now.rank, state.step)
        check_data(cfg, now, now.size, global_batch, grad_accum)  # Horovod: allgather
        elastic_state.largest_world = max(elastic_state.largest_world, now.size)
        events = []
        # Horovod: allgather
        reset = [r for r in hvd.allgather_object(elastic_state.last_reset, name="elastic.reset") if r]
        if reset:  # known to the workers that lived through it
            why, rolled_back, before = reset[0]
            events.append({"step": state.step, "event": "reset", "reason": why, "old_world_size": before,
                           "world_size": now.size, "steps_rolled_back": rolled_back,
                           "gradients": gradient_sums(cfg, now.size, elastic_state.largest_world)})
        elastic_state.last_reset = None
        engine = build_engine(cfg, device, model, optimizer, scaler, grad_accum, now.size,
                              stand_in=stands_in_for_two(cfg, now.size, elastic_state.largest_world))
        setup = Setup(now, data, model, optimizer, scaler, state, grad_accum, global_batch, peak_lr, now.rank,
                      now.size, engine, resumed_from=elastic_state.resumed_from if state.step else None)

        def commit():
            size = now.size
            try:
                elastic_state.commit()  # Horovod: the elastic commit (checks for host changes)
            except HostsUpdatedInterrupt:
                elastic_state.last_reset = ("the hosts changed", 0, size)
                raise

        return run_steps(cfg, setup, commit=commit, events=events)

    return run(ElasticState(state))
