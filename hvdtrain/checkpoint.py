"""Checkpoints on disk: written atomically, verified when read, never code.

Layout: OUT_DIR/checkpoints/step_00000100/
  config.json            the transformers model config (to rebuild the model for export)
  model.safetensors      the weights (safetensors; tied tensors stored once)
  optimizer.safetensors  the optimizer's per-parameter state, keyed "<parameter name>::<key>"
                         (e.g. "transformer.h.0.mlp.c_fc.weight::exp_avg"), so it does not
                         depend on the order in which an optimizer lists its parameters
  rng.safetensors        every rank's RNG states ("rank<R>/<generator>")
  state.json             step, data stream position, world size, grad scaler, the run's config
  manifest.json          size and CRC-32 of every file above; written last

Nothing here is a pickle: every file is safetensors or JSON, so a checkpoint someone hands you
cannot run code when it is loaded (checkpoints of hvdtrain before this format held a pickled
state.pt; they are refused with one line rather than unpickled).

A checkpoint is written into a temporary folder, every file fsynced, the manifest last, then
renamed into place (a rename is atomic). A crash at any moment leaves the earlier checkpoints
as they were; `recover_interrupted_writes` finishes or discards what a crash left behind. When
reading, the manifest is checked first: a damaged checkpoint is set aside under another name
(never deleted) and the run resumes from the newest intact one.
"""
import json
import logging
import os
import re
import shutil
import zlib
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model

from hvdtrain.errors import UserError
from hvdtrain.paths import written_whole

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step_(\d{8})$")
MODEL_FILE, OPTIMIZER_FILE, RNG_FILE = "model.safetensors", "optimizer.safetensors", "rng.safetensors"
STATE_FILE, MANIFEST_FILE, MODEL_CONFIG_FILE = "state.json", "manifest.json", "config.json"
LEGACY_STATE_FILE = "state.pt"  # the pickled state of hvdtrain's first checkpoint format
FORMAT = 2
CHUNK = 16 << 20


def checkpoint_dir(out_dir) -> Path:
    return Path(out_dir) / "checkpoints"


def step_of(path: Path) -> int:
    return int(STEP_DIR.match(path.name).group(1))


def list_checkpoints(out_dir) -> list[Path]:
    """Checkpoint folders (complete or not), oldest first."""
    root = checkpoint_dir(out_dir)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)), key=step_of)


# ---------------------------------------------------------------- writing

def _fsync(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def parameter_names(optimizer, model) -> list[str]:
    """The names of the optimizer's parameters in the order its state_dict numbers them."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def optimizer_tensors(optimizer, model) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state by parameter name."""
    ordered = parameter_names(optimizer, model)
    return {f"{ordered[index]}::{key}": torch.as_tensor(value).detach().cpu().contiguous()
            for index, values in optimizer.state_dict()["state"].items() for key, value in values.items()}


def save_checkpoint(out_dir, step: int, model, optimizer, state: dict, rngs: list[dict], keep: int) -> Path:
    """Write step `step` of a run; keep the newest `keep` checkpoints. Called on one rank."""
    root = checkpoint_dir(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    with written_whole(f"the checkpoint of step {step} in {root}", tmp):
        tmp.mkdir()
        model.config.to_json_file(tmp / MODEL_CONFIG_FILE)
        save_model(model, str(tmp / MODEL_FILE))
        save_file(optimizer_tensors(optimizer, model), str(tmp / OPTIMIZER_FILE))
        save_file({f"rank{r}/{k}": v.contiguous() for r, rng in enumerate(rngs) for k, v in rng.items()},
                  str(tmp / RNG_FILE))
        (tmp / STATE_FILE).write_text(json.dumps({"format": FORMAT, **state}, indent=1))
        files = {}
        for name in (MODEL_CONFIG_FILE, MODEL_FILE, OPTIMIZER_FILE, RNG_FILE, STATE_FILE):
            _fsync(tmp / name)
            files[name] = {"bytes": (tmp / name).stat().st_size, "crc32": _crc32(tmp / name)}
        # The manifest last: a folder with a valid manifest is a complete checkpoint.
        (tmp / MANIFEST_FILE).write_text(json.dumps({"format": FORMAT, "step": step, "files": files}, indent=1))
        _fsync(tmp / MANIFEST_FILE)
        _fsync(tmp)
    if final.exists():  # the same step written again (e.g. a rerun): swap, never delete first
        old = root / f".old-{final.name}"
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    _fsync(root)
    for stale in list_checkpoints(out_dir)[:-keep]:
        if stale != final:  # never the checkpoint just written, whatever else the folder holds
            shutil.rmtree(stale)
    return final


def recover_interrupted_writes(out_dir):
    """Finish or discard what a crash during `save_checkpoint` left behind.

    A crash between the two renames of a rewritten step leaves `.old-step_N` (the previous
    version) and `.tmp-step_N` (the new one) with no `step_N`: the new one is kept when it is
    complete (its manifest verifies), else the old one is put back. Other temporary folders
    were never complete checkpoints and are removed."""
    root = checkpoint_dir(out_dir)
    if not root.is_dir():
        return
    for old in root.glob(".old-step_*"):
        final, tmp = root / old.name[len(".old-"):], root / (".tmp-" + old.name[len(".old-"):])
        if not final.exists():
            if tmp.is_dir() and problem(tmp) is None:
                tmp.rename(final)
            else:
                old.rename(final)
    for leftover in root.glob(".tmp-step_*"):
        shutil.rmtree(leftover, ignore_errors=True)
    for leftover in root.glob(".old-step_*"):
        shutil.rmtree(leftover, ignore_errors=True)


# ---------------------------------------------------------------- reading

def problem(path: Path) -> str | None:
    """What is wrong with the checkpoint folder `path` (one line), or None when it is intact."""
    if (path / LEGACY_STATE_FILE).is_file() and not (path / MANIFEST_FILE).is_file():
        return (f"{path} was written by an earlier hvdtrain whose {LEGACY_STATE_FILE} is a pickle, which can run "
                f"code when loaded; it is not read (export its weights with that version, or start a new run)")
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return f"{path}: {MANIFEST_FILE} is missing (the write did not finish)"
    except (ValueError, KeyError, TypeError):
        return f"{path / MANIFEST_FILE} is damaged (not the JSON hvdtrain writes)"
    for name, expected in files.items():
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != expected["bytes"]:
            return f"{f} has {f.stat().st_size} bytes, the manifest says {expected['bytes']} (truncated or replaced)"
        if _crc32(f) != expected["crc32"]:
            return f"{f} does not match its checksum in the manifest (damaged)"
    return None


def set_aside(path: Path, why: str) -> Path:
    """Rename a damaged checkpoint so that it is neither loaded nor counted, and keep it."""
    target = path.with_name(f"damaged-{path.name}")
    n = 1
    while target.exists():
        target, n = path.with_name(f"damaged-{path.name}.{n}"), n + 1
    path.rename(target)
    log.warning(f"warning: {why}; set aside as {target}")
    return target


def newest_intact_checkpoint(out_dir) -> Path | None:
    """The newest checkpoint that verifies; damaged newer ones are set aside on the way. A
    checkpoint of the earlier pickled format is refused (it is not damaged, only unsafe to read)."""
    for path in reversed(list_checkpoints(out_dir)):
        why = problem(path)
        if why is None:
            return path
        if (path / LEGACY_STATE_FILE).is_file():
            raise UserError(why)
        set_aside(path, why)
    return None


def resolve_checkpoint(path) -> Path:
    """A checkpoint folder, or a run folder (its newest checkpoint), verified; for export."""
    p = Path(path)
    if not p.is_dir():
        raise UserError(f"'{path}' does not exist or is not a folder")
    if STEP_DIR.match(p.name) or (p / MANIFEST_FILE).is_file() or (p / LEGACY_STATE_FILE).is_file():
        found = p
    else:
        checkpoints = list_checkpoints(p)
        if not checkpoints:
            raise UserError(f"'{path}' is neither a checkpoint folder nor a run folder with checkpoints")
        found = checkpoints[-1]
    why = problem(found)
    if why is not None:
        raise UserError(why)
    return found


def run_dir_of(ckpt: Path) -> Path:
    """OUT_DIR of OUT_DIR/checkpoints/step_N."""
    return Path(ckpt).resolve().parent.parent


def read_state(path: Path) -> dict:
    return json.loads((path / STATE_FILE).read_text())


def read_rngs(path: Path, world_size: int) -> list[dict[str, torch.Tensor]]:
    tensors = load_file(str(path / RNG_FILE))
    rngs = [{} for _ in range(world_size)]
    for key, value in tensors.items():
        rank, name = key.split("/", 1)
        rngs[int(rank[len("rank"):])][name] = value
    return rngs


def load_weights(model, path: Path):
    try:
        load_model(model, str(path / MODEL_FILE))
    except (SafetensorError, RuntimeError) as e:
        raise UserError(f"{path / MODEL_FILE} does not fit this model ({str(e).splitlines()[0]})") from None


def load_optimizer(optimizer, model, path: Path):
    """Fill a freshly built optimizer with the state saved by name in `path`."""
    by_name = {}
    for key, value in load_file(str(path / OPTIMIZER_FILE)).items():
        name, field = key.split("::", 1)
        by_name.setdefault(name, {})[field] = value
    state = {index: by_name[name] for index, name in enumerate(parameter_names(optimizer, model)) if name in by_name}
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})
