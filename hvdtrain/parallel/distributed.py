"""The Horovod layer: every distributed step of a run, explicit and in one place.

Mirrors Horovod's own PyTorch examples: init, pin the GPU, seed, scale the learning rate,
broadcast the starting state from rank 0, wrap the optimizer so gradients are averaged
with allreduce while backward runs, and average metrics across ranks.
"""
import functools
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hvdtrain.training import rng
from hvdtrain.config import Config, HorovodConfig
from hvdtrain.errors import UserError

try:  # A missing Horovod is reported by `init` as a user error (run `make setup`), not an ImportError.
    import horovod.torch as hvd
except ImportError:  # pragma: no cover - reported by `hvdtrain doctor` and `init`
    hvd = None


@dataclass
class World:
    rank: int
    size: int
    local_rank: int
    local_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def print(self, *args, **kwargs):
        """print on rank 0 only."""
        if self.rank == 0:
            print(*args, **kwargs, flush=True)


def horovod_env(cfg: Config) -> dict:
    """Horovod's tuning knobs are environment variables read by hvd.init().

    The timeline and the autotune log are files Horovod opens inside hvd.init(), before the
    run folder may exist (it is made only once every input has been checked). So the timeline
    starts in DYNAMIC mode and `start_timeline` opens it in the run folder later, and the
    autotune log goes to a temporary file that `keep_autotune_log` copies into the run folder."""
    h, env = cfg.horovod, {}
    if h.fusion_threshold_mb is not None:
        env["HOROVOD_FUSION_THRESHOLD"] = str(int(h.fusion_threshold_mb * 1024 * 1024))
    if h.cycle_time_ms is not None:
        env["HOROVOD_CYCLE_TIME"] = str(h.cycle_time_ms)
    if h.timeline or (cfg.profile.enabled and cfg.profile.timeline):
        env["HOROVOD_TIMELINE"] = "DYNAMIC"  # started and stopped by hvdtrain
    if h.autotune:
        env["HOROVOD_AUTOTUNE"] = "1"
        env["HOROVOD_AUTOTUNE_LOG"] = os.path.join(tempfile.gettempdir(), f"hvdtrain-autotune-{os.getpid()}.csv")
    if h.stall_timeout_s and not is_elastic_job() and "HOROVOD_GLOO_TIMEOUT_SECONDS" not in os.environ:
        # Gloo gives up on a worker that does not answer after 30 s, with an error that does not
        # say which: the stall watchdog (hvdtrain.training.run_guards) names it, so Gloo waits longer.
        env["HOROVOD_GLOO_TIMEOUT_SECONDS"] = str(int(h.stall_timeout_s) + 60)
    if not torch.cuda.is_available() and "HVDTRAIN_HOROVOD_SPIN_US" not in os.environ:
        # CPU workers share the host's cores: a rank waiting in hvd.synchronize spins 50 us, then
        # sleeps between polls, leaving its core to the rank it waits for (Horovod as
        # scripts/install.py patches it; unset, as on GPUs, the wait spins).
        env["HVDTRAIN_HOROVOD_SPIN_US"] = "50"
    if is_elastic_job() and "HOROVOD_CACHE_CAPACITY" not in os.environ:
        # Horovod's response cache goes out of step between the workers that lived through a
        # reset and one that joins: the next fused allreduce then has different sizes on two
        # ranks and Gloo aborts the new worker ("op.preamble.length <= op.nbytes"), every time a
        # host is added. Without the cache every tensor is negotiated through rank 0, each cycle.
        env["HOROVOD_CACHE_CAPACITY"] = "0"
    return env


def init(cfg: Config) -> World:
    """hvd.init(), pin this process to its local GPU, seed every RNG."""
    if hvd is None:
        raise UserError("Horovod is not installed in this environment; run `make setup` (or scripts/install.py)")
    os.environ.update(horovod_env(cfg))
    # Pipeline stages, split experts and split layers reduce gradients within process sets added after init.
    par = cfg.parallel
    dynamic = max(par.pipeline_stages, par.expert_parallel, par.tensor_parallel) > 1
    hvd.init(**({"process_sets": "dynamic"} if dynamic else {}))  # Horovod: init
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls outside autocast use TF32
        torch.backends.cudnn.allow_tf32 = True
        device = torch.device("cuda", hvd.local_rank())
    else:
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:  # share the host's cores between its workers
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    world = current_world(device)
    rng.seed_everything(cfg.train.seed, world.rank)
    return world


def current_world(device: torch.device) -> World:
    """This worker's rank and the world's size now (an elastic reset changes them)."""
    return World(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), device)


def is_elastic_job() -> bool:
    """Started by `horovodrun --min-np/--max-np/--host-discovery-script` (hvdtrain launch --elastic)."""
    return os.environ.get("HOROVOD_ELASTIC") == "1"


def timeline_path(cfg: Config) -> Path | None:
    """horovod.timeline's file for the whole run (relative paths: inside out_dir), or None."""
    if not cfg.horovod.timeline:
        return None
    path = Path(cfg.horovod.timeline)
    return path if path.is_absolute() else Path(cfg.out_dir) / path


def start_timeline(path: Path):
    """Every rank calls it (the timeline is global); the coordinator writes the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    hvd.start_timeline(str(path), mark_cycles=False)  # Horovod: timeline, on every rank


def stop_timeline():
    """Waits for no other rank (the coordinator closes the file), so clean-up after a failure
    may call it."""
    hvd.stop_timeline()


def keep_autotune_log(cfg: Config, world: World):
    """Copy Horovod's autotune log (written by rank 0 to a temporary file) into the run folder."""
    log = os.environ.get("HOROVOD_AUTOTUNE_LOG")
    if cfg.horovod.autotune and world.is_main and log and os.path.isfile(log):
        shutil.copyfile(log, Path(cfg.out_dir) / "horovod_autotune.csv")


# ---------------------------------------------------------------- optimizer

def lr_scale(kind: str, world_size: int) -> float:
    """Goyal et al.: with a per-worker batch held fixed, the global batch grows with the world,
    so the rate grows linearly (or with the square root, a gentler rule for Adam)."""
    return {"none": 1.0, "linear": float(world_size), "sqrt": world_size ** 0.5}[kind]


def reduce_op(cfg: HorovodConfig):
    return {"average": hvd.Average, "sum": hvd.Sum}[cfg.op]


def compression(cfg: HorovodConfig):
    """horovod.compression as Horovod's Compression class."""
    return hvd.Compression.fp16 if cfg.compression == "fp16" else hvd.Compression.none


def wrap_optimizer(optimizer, model, cfg: HorovodConfig, backward_passes_per_step: int, process_set=None):
    """hvd.DistributedOptimizer: allreduce starts from backward hooks as each gradient is ready.

    backward_passes_per_step = gradient accumulation steps, so the allreduce fires once per
    optimizer step, after the last micro batch, not once per micro batch. With pipeline stages
    `process_set` holds the copies of this worker's stage, and only they reduce together."""
    # Horovod: DistributedOptimizer, allreduce of each gradient from its backward hook
    return hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression(cfg),
        op=reduce_op(cfg),
        gradient_predivide_factor=cfg.gradient_predivide_factor,
        backward_passes_per_step=backward_passes_per_step,
        **({"process_set": process_set} if process_set is not None else {}),
    )


def allreduce_grads(params, process_set, name: str, op=None, compression=None, gradient_predivide_factor: float = 1.0,
                    postscale: float = 1.0):
    """Reduce the gradients of `params` over `process_set` in one grouped Horovod allreduce, after
    backward: the mode for a plain (not Distributed) optimizer (pipeline stages whose copies
    reduce after the schedule's run, where NCCL cannot run two communicators at once). A missing gradient is
    sent as zeros (every copy must send the same list); the rest as allreduce_tensors. Horovod
    takes plain tensors: a split layer's gradient (a DTensor: parallel.tensor_parallel) is
    reduced as its local tensor, the same storage."""
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    allreduce_tensors([local(p.grad) for p in params], process_set, name, op, compression, gradient_predivide_factor,
                      postscale)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's values: a DTensor's local tensor (the same storage), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def allreduce_tensors(tensors: list, process_set, name: str, op=None, compression=None,
                      gradient_predivide_factor: float = 1.0, postscale: float = 1.0):
    """Reduce `tensors` in place over `process_set` in one grouped Horovod allreduce. op:
    hvd.Average by default. A `process_set` of None is a set of this rank alone: nothing is sent.

    `compression` (hvd.Compression.fp16: sent as fp16) and `gradient_predivide_factor` f
    (horovod.compression and horovod.gradient_predivide_factor) work as in
    hvd.DistributedOptimizer: with Average each copy's gradient is divided by f before the sum
    and the sum multiplied by f / copies after it, which keeps an fp16 sum from overflowing.
    The result is multiplied by `postscale` too."""
    op = hvd.Average if op is None else op
    compression = hvd.Compression.none if compression is None else compression
    if process_set is None or not tensors:
        if postscale != 1.0:
            torch._foreach_mul_(tensors, postscale)
        return
    compressed, contexts = zip(*[compression.compress(t) for t in tensors])
    predivide = gradient_predivide_factor if op == hvd.Average else 1.0
    # Horovod: grouped allreduce within the process set
    hvd.grouped_allreduce_(list(compressed), op=op, name=name, process_set=process_set,
                           prescale_factor=1.0 / predivide, postscale_factor=predivide * postscale)
    for tensor, sent, context in zip(tensors, compressed, contexts):
        if sent is not tensor:  # reduced in a compressed copy: back into the tensor
            tensor.copy_(compression.decompress(sent, context))


class GradientReduction:
    """Each gradient allreduced over its own process set as soon as the step's last backward has
    made it, while backward goes on (as hvd.DistributedOptimizer's hooks do, which reduce over
    one process set only), with horovod.op, compression and predivide factor as
    hvd.DistributedOptimizer has them. `reduced_over(name)` gives a parameter's (process set,
    divisor): with op average its reduced gradient is divided by the divisor too (expert
    parallelism's experts: hvdtrain.parallel.expert_parallel.gradient_reduction). A split
    layer's gradient (a DTensor: parallel.tensor_parallel) is reduced as its local tensor, the
    same storage. `wait()` ends them, after submitting the gradients no backward made (a weight
    unused this step; a rank's experts that no token reached), as zeros: every rank of a set
    reduces every name. With `during` False no hook is registered and `wait()` submits them all
    after backward (parallel.reduce_gradients "after": NCCL beside another library's
    collectives in backward)."""

    def __init__(self, model, reduced_over, cfg: HorovodConfig, backward_passes: int, during: bool = True):
        self.op, self.compression = reduce_op(cfg), compression(cfg)
        self.predivide = cfg.gradient_predivide_factor if self.op == hvd.Average else 1.0
        self.backward_passes, self.during = backward_passes, during
        self.params = {}  # name -> (parameter, its process set, its postscale)
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            process_set, divisor = reduced_over(name)
            self.params[name] = (p, process_set, 1.0 / divisor if self.op == hvd.Average else 1.0)
            if during:
                p.register_post_accumulate_grad_hook(functools.partial(self._made, name))
        self.passes = dict.fromkeys(self.params, 0)
        self.in_flight = {}  # name -> (handle, the (compressed) local gradient sent, its context)

    def _made(self, name: str, p: torch.Tensor):
        self.passes[name] += 1
        if self.passes[name] == self.backward_passes:
            self._start(name)

    def _start(self, name: str):
        p, process_set, postscale = self.params[name]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        sent, context = self.compression.compress(local(p.grad))
        # Horovod: allreduce within the process set, started while backward goes on
        handle = hvd.allreduce_async_(sent, name=f"grads.{name}", op=self.op, process_set=process_set,
                                      prescale_factor=1.0 / self.predivide,
                                      postscale_factor=self.predivide * postscale)
        self.in_flight[name] = (handle, sent, context)

    def wait(self):
        """Every gradient reduced (the step's reduce_gradients)."""
        for name in self.params:  # in the model's order on every rank
            if name not in self.in_flight:
                self._start(name)
        for name, (handle, sent, context) in self.in_flight.items():
            hvd.synchronize(handle)  # Horovod: wait for the allreduce
            grad = local(self.params[name][0].grad)
            if sent.data_ptr() != grad.data_ptr():  # reduced in a compressed copy: back into the gradient
                grad.copy_(self.compression.decompress(sent, context))
        self.in_flight.clear()
        self.passes = dict.fromkeys(self.params, 0)


def reduction_options(cfg: HorovodConfig) -> dict:
    """horovod.op, compression and gradient_predivide_factor as allreduce_tensors' arguments."""
    return {"op": reduce_op(cfg), "compression": compression(cfg),
            "gradient_predivide_factor": cfg.gradient_predivide_factor}


class StepTotals:
    """What every rank tells every other once per step, in one small allreduce that runs in the
    background while the model computes (no extra synchronisation point before the forward
    pass): its target tokens, for TokenNormalizer, and its stop vote: a rank asked to stop
    (preemption, hvdtrain.training.stopping) tells every other, so all stop at the same step.

    With pipeline stages every stage of a pipeline reads the same samples, so the count summed
    over all workers holds each target `stages` times."""

    def __init__(self, stages: int = 1):
        self.stages = stages

    def start(self, local_targets: int, stop_vote: bool = False):
        # Horovod: allreduce (sum) in the background, waited for in `wait`
        self.handle = allreduce_sum_async([local_targets, float(stop_vote)], name="targets")

    def wait(self) -> tuple[float, bool]:
        """The step's target tokens on all ranks, and whether any rank voted to stop."""
        total_targets, stop_votes = wait_sum(self.handle)  # Horovod: wait for the allreduce
        return max(1.0, total_targets / self.stages), stop_votes > 0


class TokenNormalizer:
    """Makes the reduced gradient the gradient of (sum of token losses) / (target tokens of the
    whole optimizer step on all ranks), so np=2 equals np=1 and accumulation equals a bigger
    micro batch even when ranks hold different numbers of targets (masked LM).

    The global token count (StepTotals) is allreduced while the model computes: backward runs
    on the loss times a constant `loss_scale` that is the same on every rank, and once the
    allreduce of gradients and of the count are both done, `finish` multiplies the gradients by
    the exact correction. With pipeline stages, `reduced_over` is the number of copies of a
    stage (their gradients are averaged)."""

    def __init__(self, op: str, reduced_over: int, expected_tokens: int):
        self.op, self.reduced_over = op, reduced_over
        self.loss_scale = 1.0 / expected_tokens

    def finish(self, grads: list[torch.Tensor], global_targets: float):
        """Correct the reduced gradients `grads` (the model's, or a sharded optimizer's slices)
        for the step's `global_targets` (StepTotals.wait)."""
        # Average divided the sum over the copies by their number; Sum did not.
        factor = (self.reduced_over if self.op == "average" else 1) / (self.loss_scale * global_targets)
        torch._foreach_mul_(grads, factor)


def clip_split_grad_norm_(whole: list, split: list, sum_split, max_norm: float, sum_parts=None,
                          uncounted: list = ()) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over a model split over a group of ranks: `whole`
    gradients are equal on every rank of it (counted once), each rank holds its own `split` ones
    (their squares summed over the group by `sum_split`, a collective returning the sum); every
    gradient multiplied by the same coefficient, as clip_grads_with_norm_ does. `sum_parts`: a
    collective summing the squares over the ranks holding the model's other parts (the stages of
    a pipeline); `uncounted`: gradients clipped but counted elsewhere (a tied weight's copy on
    the last stage). Plain tensors (a DTensor's local one). Returns the total norm before clipping."""
    norm = torch.nn.utils.get_total_norm
    squares = norm(whole) ** 2 + sum_split(norm(split) ** 2)
    total = (squares if sum_parts is None else sum_parts(squares)).sqrt()
    torch._foreach_mul_(whole + split + list(uncounted), (max_norm / (total + 1e-6)).clamp(max=1.0))
    return total


def share_found_inf(scaler: torch.amp.GradScaler, optimizer, group: dist.ProcessGroup):
    """fp16: make the grad scaler of every rank of `group` (the stages of a pipeline, the ranks
    of a tensor-parallel group) see inf when any one's unscale_ found one in the gradients it
    holds, so that all skip the same steps and their scalers back off (and restart their
    growth count) as the whole model's one scaler does. The scaler's own flags are replaced in
    place by their maximum over the group: no host read. Call after scaler.unscale_ and after
    the data-parallel reduction (it spreads inf/nan to every copy)."""
    flags = list(scaler._found_inf_per_device(optimizer).values())  # one per device, from unscale_
    found = torch.stack(flags).amax()
    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)  # torch.distributed: allreduce (max)
    for flag in flags:
        flag.copy_(found)


def zero_grad(optimizer):
    """optimizer.zero_grad(set_to_none=True) for Horovod's wrapper, whose zero_grad() takes no
    arguments. Same guard as Horovod: never between backward and synchronize."""
    if getattr(optimizer, "_handles", None):
        raise RuntimeError("zero_grad() called after backward() but before synchronize()/step()")
    torch.optim.Optimizer.zero_grad(optimizer, set_to_none=True)


# ---------------------------------------------------------------- broadcast and reductions

def broadcast_state(model, optimizer, resumed: bool):
    """Rank 0's parameters and optimizer state win, at start and after every resume.

    A fresh optimizer has no state on any rank yet: Horovod's broadcast_optimizer_state would
    then take a dummy step with zero gradients to create it, which applies weight decay and
    advances Adam's step count. So the optimizer state is broadcast only when rank 0 has one."""
    if resumed:
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)  # Horovod: broadcast from rank 0
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # Horovod: broadcast from rank 0


def broadcast_object(obj, name: str):
    return hvd.broadcast_object(obj, root_rank=0, name=name)  # Horovod: broadcast from rank 0


def allgather_object(obj, name: str) -> list:
    return hvd.allgather_object(obj, name=name)  # Horovod: allgather


def allreduce_sum(values: list[float], name: str) -> list[float]:
    """Sum a few Python numbers over ranks in one float64 allreduce (on CPU: no GPU sync)."""
    return wait_sum(allreduce_sum_async(values, name))


def allreduce_sum_async(values: list[float], name: str):
    t = torch.tensor(values, dtype=torch.float64)
    if hvd.size() == 1:  # nothing to reduce; skips a Horovod cycle
        return t
    return hvd.allreduce_async(t, op=hvd.Sum, name=name)  # Horovod: allreduce (sum), waited for by wait_sum


def wait_sum(handle) -> list[float]:
    return (handle if torch.is_tensor(handle) else hvd.synchronize(handle)).tolist()  # Horovod: wait


def allgather_floats(values: list[float], name: str) -> np.ndarray:
    """Per-rank values side by side: shape (world_size, len(values))."""
    t = torch.tensor([values], dtype=torch.float64)
    return hvd.allgather(t, name=name).numpy()  # Horovod: allgather


def barrier(name: str, failed: bool = False) -> bool:
    """Wait until every rank has come here; returns whether any of them came `failed`."""
    # Horovod: a one-number allreduce (sum) as the barrier, carrying the failure flags
    return allreduce_sum([float(failed)], name=name)[0] > 0


@contextmanager
def leader_first(world: World, what: str):
    """Run a block on local rank 0 first (e.g. tokenize and cache), then on the other ranks.

    A failure on the leader is passed to every rank, so nobody waits forever in a barrier."""
    name = f"leader_first.{what}"
    if world.local_rank == 0:
        try:
            yield
        except UserError:
            barrier(name, failed=True)
            raise
        barrier(name)
    else:
        if barrier(name):
            raise SystemExit(2)  # the leader prints the error
        yield
