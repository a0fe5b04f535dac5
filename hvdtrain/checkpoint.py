"""Checkpoints: written by rank 0, atomically, keeping the newest K.

Layout: OUT_DIR/checkpoints/step_00000100/{config.json, model.safetensors, state.pt}
  config.json        the transformers model config (to rebuild the model for export)
  model.safetensors  the weights (safetensors, shared/tied tensors handled by save_model)
  state.pt           optimizer, LR schedule, grad scaler, RNG states of every rank, the data
                     stream position, the step, the config and the world size it was written with

A checkpoint is written into a temporary folder, every file fsynced, then renamed into place
(a rename is atomic), so a crash or kill at any moment leaves either the old set of
checkpoints or the old set plus the new one, never a half-written checkpoint under a real name.
"""
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model

from hvdtrain.errors import UserError

STEP_DIR = re.compile(r"^step_(\d{8})$")
MODEL_FILE, STATE_FILE = "model.safetensors", "state.pt"


def checkpoint_dir(out_dir) -> Path:
    return Path(out_dir) / "checkpoints"


def list_checkpoints(out_dir) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_dir(out_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / MODEL_FILE).is_file() and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(out_dir) -> Path | None:
    found = list_checkpoints(out_dir)
    return found[-1] if found else None


def resolve_checkpoint(path) -> Path:
    """A checkpoint folder, or a run folder (its newest checkpoint)."""
    p = Path(path)
    if (p / STATE_FILE).is_file():
        return p
    newest = latest_checkpoint(p)
    if newest is None:
        raise UserError(f"'{path}' is neither a checkpoint folder nor a run folder with checkpoints")
    return newest


def run_dir_of(ckpt: Path) -> Path:
    """OUT_DIR of OUT_DIR/checkpoints/step_N."""
    return Path(ckpt).resolve().parent.parent


def _fsync(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(out_dir, step: int, model, state: dict, keep: int) -> Path:
    root = checkpoint_dir(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model.config.to_json_file(tmp / "config.json")
    save_model(model, str(tmp / MODEL_FILE))
    torch.save(state, tmp / STATE_FILE)
    for f in ("config.json", MODEL_FILE, STATE_FILE):
        _fsync(tmp / f)
    _fsync(tmp)
    if final.exists():  # the same step written again (e.g. a rerun): swap, never delete first
        old = root / f".old-{final.name}-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    _fsync(root)
    for stale in list_checkpoints(out_dir)[:-keep]:
        shutil.rmtree(stale)
    return final


def remove_partial_writes(out_dir):
    """Temporary folders left by a crash during a write: never loaded, so safe to delete."""
    root = checkpoint_dir(out_dir)
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith((".tmp-", ".old-")):
                shutil.rmtree(p, ignore_errors=True)


def load_state(path: Path) -> dict:
    # Our own file, holding numpy RNG state and the config: not a weights-only pickle.
    return torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)


def load_weights(model, path: Path):
    load_model(model, str(path / MODEL_FILE))
