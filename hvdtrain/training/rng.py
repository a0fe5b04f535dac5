"""Random number generators: seeding at start and the state a checkpoint saves and restores.

Model initialisation uses the same seed on every rank (and rank 0's weights are broadcast
anyway); dropout then draws from per-rank streams. A checkpoint holds every rank's RNG state,
as tensors only (no pickled objects), so a resume with the same world size continues each
rank's streams exactly; with another world size the streams are derived again from
(seed, rank, step).
"""
import random

import numpy as np
import torch


def seed_everything(seed: int, rank: int):
    """Before the model is built: the same torch seed everywhere, per-rank Python/NumPy seeds."""
    torch.manual_seed(seed)
    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)


def reseed_for_training(seed: int, rank: int, step: int):
    """After the model is built: per-rank dropout streams, a function of (seed, rank, step) so a
    resume with another world size still gets well-defined streams."""
    torch.manual_seed(seed * 1_000_003 + rank * 7919 + step)


def capture() -> dict[str, torch.Tensor]:
    """This process's RNG states as tensors (what safetensors can hold)."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(keys.astype(np.int64)),
        "numpy_rest": torch.tensor([pos, has_gauss, gauss], dtype=torch.float64),
        "python": torch.tensor([version, *py_state], dtype=torch.int64),
        "python_gauss": torch.tensor([py_gauss is not None, py_gauss or 0.0], dtype=torch.float64),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore(state: dict[str, torch.Tensor]):
    torch.set_rng_state(state["torch"])
    pos, has_gauss, gauss = state["numpy_rest"].tolist()
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), int(pos), int(has_gauss), gauss))
    version, *py_state = state["python"].tolist()
    has_py_gauss, py_gauss = state["python_gauss"].tolist()
    random.setstate((version, tuple(py_state), py_gauss if has_py_gauss else None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
