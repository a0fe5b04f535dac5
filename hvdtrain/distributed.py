"""The Horovod layer: every distributed step of a run, explicit and in one place.

Mirrors Horovod's own PyTorch examples: init, pin the GPU, seed, scale the learning rate,
broadcast the starting state from rank 0, wrap the optimizer so gradients are averaged
with allreduce while backward runs, and average metrics across ranks.
"""
import os
import random
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from hvdtrain.config import Config, HorovodConfig
from hvdtrain.errors import UserError

try:  # Imported lazily in the CLI's error path: doctor must work without Horovod.
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


def horovod_env(cfg: HorovodConfig, out_dir: str) -> dict:
    """Horovod's tuning knobs are environment variables read by hvd.init()."""
    env = {}
    if cfg.fusion_threshold_mb is not None:
        env["HOROVOD_FUSION_THRESHOLD"] = str(int(cfg.fusion_threshold_mb * 1024 * 1024))
    if cfg.cycle_time_ms is not None:
        env["HOROVOD_CYCLE_TIME"] = str(cfg.cycle_time_ms)
    if cfg.timeline:
        env["HOROVOD_TIMELINE"] = os.path.join(out_dir, cfg.timeline) if not os.path.isabs(cfg.timeline) else cfg.timeline
    if cfg.autotune:
        env["HOROVOD_AUTOTUNE"] = "1"
        env["HOROVOD_AUTOTUNE_LOG"] = os.path.join(out_dir, "horovod_autotune.csv")
    return env


def init(cfg: Config) -> World:
    """hvd.init(), pin this process to its local GPU, seed every RNG."""
    if hvd is None:
        raise UserError("Horovod is not installed in this environment; run `make setup` (or scripts/install.py)")
    os.environ.update(horovod_env(cfg.horovod, cfg.out_dir))
    hvd.init()
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())
        device = torch.device("cuda", hvd.local_rank())
    else:
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:  # share the host's cores between its workers
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    world = World(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), device)
    seed_everything(cfg.train.seed, world.rank)
    return world


def seed_everything(seed: int, rank: int):
    """Model init uses the same seed everywhere (and is broadcast anyway); dropout differs per rank."""
    torch.manual_seed(seed)
    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)


def reseed_for_training(seed: int, rank: int, step: int):
    """After the model is built: per-rank dropout streams, a function of (seed, rank, step) so a
    resume with another world size still gets well-defined streams."""
    torch.manual_seed(seed * 1_000_003 + rank * 7919 + step)


# ---------------------------------------------------------------- optimizer

def lr_scale(kind: str, world_size: int) -> float:
    """Goyal et al.: with a per-worker batch held fixed, the global batch grows with the world,
    so the rate grows linearly (or with the square root, a gentler rule for Adam)."""
    return {"none": 1.0, "linear": float(world_size), "sqrt": world_size ** 0.5}[kind]


def wrap_optimizer(optimizer, model, cfg: HorovodConfig, backward_passes_per_step: int):
    """hvd.DistributedOptimizer: allreduce starts from backward hooks as each gradient is ready.

    backward_passes_per_step = gradient accumulation steps, so the allreduce fires once per
    optimizer step, after the last micro batch, not once per micro batch."""
    compression = hvd.Compression.fp16 if cfg.compression == "fp16" else hvd.Compression.none
    op = {"average": hvd.Average, "adasum": hvd.Adasum, "sum": hvd.Sum}[cfg.op]
    return hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        op=op,
        gradient_predivide_factor=cfg.gradient_predivide_factor,
        backward_passes_per_step=backward_passes_per_step,
    )


def gradient_scale(op: str, world_size: int) -> float:
    """Factor that makes the reduced gradient the gradient of sum(token losses) / global tokens.

    Each rank's loss is sum(its token losses) / (tokens on all ranks). Allreduce with Sum then
    gives exactly the global gradient; Average divides by the world size, so we pre-multiply."""
    return float(world_size) if op in ("average", "adasum") else 1.0


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
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)


def broadcast_object(obj, name: str):
    return hvd.broadcast_object(obj, root_rank=0, name=name)


def allgather_object(obj, name: str) -> list:
    return hvd.allgather_object(obj, name=name)


def allreduce_sum(values: list[float], name: str) -> list[float]:
    """Sum a few Python numbers over ranks in one float64 allreduce (on CPU: cheap, no GPU sync)."""
    t = torch.tensor(values, dtype=torch.float64)
    return hvd.allreduce(t, op=hvd.Sum, name=name).tolist()


def allgather_floats(values: list[float], name: str) -> np.ndarray:
    """Per-rank values side by side: shape (world_size, len(values))."""
    t = torch.tensor([values], dtype=torch.float64)
    return hvd.allgather(t, name=name).numpy()


@contextmanager
def leader_first(world: World, what: str):
    """Run a block on local rank 0 first (e.g. tokenize and cache), then on the other ranks.

    A failure on the leader is passed to every rank, so nobody waits forever in a barrier."""
    name = f"leader_first.{what}"
    if world.local_rank == 0:
        try:
            yield
        except UserError:
            allreduce_sum([1.0], name=name)
            raise
        allreduce_sum([0.0], name=name)
    else:
        if allreduce_sum([0.0], name=name)[0] > 0:
            raise SystemExit(2)  # the leader prints the error
        yield


def check_all_ok(ok: bool, what: str):
    """Agree across ranks: if any rank failed `what`, every rank stops (exit 2)."""
    if allreduce_sum([0.0 if ok else 1.0], name=f"check.{what}")[0] > 0:
        raise SystemExit(2)
