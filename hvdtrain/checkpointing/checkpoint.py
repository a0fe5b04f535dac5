"""Checkpoints on disk: written atomically, verified when read, never code.

Layout: OUT_DIR/checkpoints/step_00000100/
  config.json            the transformers model config (to rebuild the model for export)
  model.safetensors      the weights under the model's own parameter names (tied tensors once)
  optimizer.safetensors  the optimizer's per-parameter state, keyed "<parameter name>::<key>"
                         (e.g. "transformer.h.0.mlp.c_fc.weight::exp_avg"), so it does not
                         depend on the order in which an optimizer lists its parameters
    With pipeline stages each stage writes its own part instead, model-00001-of-00002.safetensors
    and optimizer-00001-of-00002.safetensors ...; the names are the whole model's, so a
    checkpoint written with any layout loads into any other (and into one process for export).
    With a sharded optimizer (hvdtrain.parallel.sharded_optimizer) every rank writes a part: its slice
    of each parameter's fp32 weights and optimizer state, each a flat range of the whole tensor,
    under the whole tensor's name; the file's metadata ("hvdtrain.slices") gives each slice's
    offset and the whole tensor's shape. Readers put the slices back together (or read only the
    range they need: `read_ranges`), so such a checkpoint too loads into any layout.
  rng.safetensors        every rank's RNG states ("rank<R>/<generator>")
  state.json             step, data stream position, world size, grad scaler, the run's config
  manifest.json          size and checksum (XXH3) of every file above; written last

Nothing here is a pickle: every file is safetensors or JSON, so a checkpoint someone hands you
cannot run code when it is loaded (checkpoints of hvdtrain before this format held a pickled
state.pt; they are refused with one line rather than unpickled).

A checkpoint is written into a temporary folder, every file fsynced and checksummed by the
process that wrote it, the manifest last, then renamed into place (a rename is atomic). A crash
at any moment leaves the earlier checkpoints as they were; `recover_interrupted_writes`
finishes or discards what a crash left behind. When reading, the manifest is checked first: a
damaged checkpoint is set aside under another name (never deleted) and the run resumes from
the newest intact one.
"""
import json
import logging
import math
import mmap
import os
import re
import shutil
import time
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import load_file, save_file, save_model

from hvdtrain.errors import UserError
from hvdtrain.models.ties import tie_aliases
from hvdtrain.paths import written_whole

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step_(\d{8})$")
MODEL_FILE, OPTIMIZER_FILE, RNG_FILE = "model.safetensors", "optimizer.safetensors", "rng.safetensors"
STATE_FILE, MANIFEST_FILE, MODEL_CONFIG_FILE = "state.json", "manifest.json", "config.json"
LEGACY_STATE_FILE = "state.pt"  # the pickled state of hvdtrain's first checkpoint format
FORMAT = 2


def checkpoint_dir(out_dir) -> Path:
    return Path(out_dir) / "checkpoints"


def step_of(path: Path) -> int:
    """The step of a checkpoint folder, or of its temporary folder while it is written."""
    return int(STEP_DIR.match(path.name.removeprefix(".tmp-")).group(1))


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


def checksum(path: Path) -> str:
    """xxHash's XXH3 (64 bits) of a file, read through a memory map (no copies): about 0.1 s per
    GB here, where CRC-32 over read() chunks took 1.4 s. It detects damage, not tampering."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return xxhash.xxh3_64(b"").hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return xxhash.xxh3_64(mapped).hexdigest()


def parameter_names(optimizer, model) -> list[str]:
    """The names of the optimizer's parameters in the order its state_dict numbers them."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def optimizer_tensors(optimizer, model, whole=lambda tensor: tensor) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state by parameter name; `whole(tensor)`: the whole tensor
    of a split one (tensor parallelism: a DTensor's, gathered)."""
    ordered = parameter_names(optimizer, model)
    return {f"{ordered[index]}::{key}": whole(torch.as_tensor(value)).detach().cpu().contiguous()
            for index, values in optimizer.state_dict()["state"].items() for key, value in values.items()}


def part_names(index: int, count: int) -> tuple[str, str]:
    """(model file, optimizer file) of part `index` of `count` (pipeline stages write one each)."""
    if count == 1:
        return MODEL_FILE, OPTIMIZER_FILE
    suffix = f"-{index + 1:05d}-of-{count:05d}.safetensors"
    return "model" + suffix, "optimizer" + suffix


def begin_checkpoint(out_dir, step: int) -> Path:
    """The empty temporary folder the writers of step `step` write into. Called on one rank,
    before the others write. What an interrupted write left is recovered first: an elastic
    job's new rank 0 writes again where a lost rank 0 was killed, with no relaunch between."""
    root = checkpoint_dir(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    recover_interrupted_writes(out_dir)
    tmp = root / f".tmp-step_{step:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    with written_whole(f"the checkpoint of step {step} in {root}", tmp):
        tmp.mkdir()
    return tmp


def sealed(path: Path) -> dict:
    """`path` flushed to disk; its manifest entry (size and checksum)."""
    _fsync(path)
    return {"bytes": path.stat().st_size, "xxh3_64": checksum(path)}


def write_part(tmp: Path, index: int, count: int, model, optimizer) -> dict[str, dict]:
    """This writer's weights and optimizer state (the whole model's, or one stage's), on disk;
    their manifest entries. Each writer seals its own files, so the one that writes the
    manifest reads no other writer's weights."""
    model_file, optimizer_file = part_names(index, count)
    with written_whole(f"the checkpoint of step {step_of(tmp)} in {tmp.parent}", tmp):
        save_model(model, str(tmp / model_file))
        save_file(optimizer_tensors(optimizer, model), str(tmp / optimizer_file))
        return {name: sealed(tmp / name) for name in (model_file, optimizer_file)}


SLICES_KEY = "hvdtrain.slices"  # safetensors metadata: {tensor name: [flat start, [whole shape]]}


def write_slices(tmp: Path, index: int, count: int, weights: dict, state: dict) -> dict[str, dict]:
    """write_part for a rank of a sharded optimizer: `weights` and `state` map names to a whole
    tensor, or to (flat slice, its start in the flattened whole tensor, the whole tensor's shape)."""
    model_file, optimizer_file = part_names(index, count)
    with written_whole(f"the checkpoint of step {step_of(tmp)} in {tmp.parent}", tmp):
        for tensors, name in ((weights, model_file), (state, optimizer_file)):
            slices = {k: [v[1], list(v[2])] for k, v in tensors.items() if isinstance(v, tuple)}
            plain = {k: (v[0] if isinstance(v, tuple) else v).detach().cpu().contiguous() for k, v in tensors.items()}
            save_file(plain, str(tmp / name), metadata={SLICES_KEY: json.dumps(slices)})
        return {name: sealed(tmp / name) for name in (model_file, optimizer_file)}


def _test_pause(point: str):
    """Test aid for the fault campaign (scripts/bench_faults.py): HVDTRAIN_TEST_CHECKPOINT_PAUSE=
    "POINT:SECONDS" sleeps at POINT of every write ("manifest": every file but the manifest written;
    "rename": the manifest written, not yet renamed into place; "swap": a rewrite of a step between
    its two renames, the old version moved aside, the new one not yet in place), so that a kill
    lands there."""
    wanted, _, seconds = os.environ.get("HVDTRAIN_TEST_CHECKPOINT_PAUSE", "").partition(":")
    if wanted == point:
        time.sleep(float(seconds))


def finish_checkpoint(tmp: Path, step: int, model_config, state: dict, rngs: list[dict], keep: int,
                      parts: dict[str, dict]) -> Path:
    """After every part is written (`parts`: the manifest entries their writers gave): the
    run's state, the manifest last, the rename into place; keep the newest `keep` checkpoints.
    Called on one rank."""
    root = tmp.parent
    final = root / f"step_{step:08d}"
    with written_whole(f"the checkpoint of step {step} in {root}", tmp):
        model_config.to_json_file(tmp / MODEL_CONFIG_FILE)
        save_file({f"rank{r}/{k}": v.contiguous() for r, rng in enumerate(rngs) for k, v in rng.items()},
                  str(tmp / RNG_FILE))
        (tmp / STATE_FILE).write_text(json.dumps({"format": FORMAT, **state}, indent=1))
        files = {**parts, **{name: sealed(tmp / name) for name in (MODEL_CONFIG_FILE, RNG_FILE, STATE_FILE)}}
        files = dict(sorted(files.items()))
        _test_pause("manifest")
        # The manifest last: a folder with a valid manifest is a complete checkpoint.
        (tmp / MANIFEST_FILE).write_text(json.dumps({"format": FORMAT, "step": step, "files": files}, indent=1))
        _fsync(tmp / MANIFEST_FILE)
        _fsync(tmp)
    _test_pause("rename")
    if final.exists():  # the same step written again (e.g. a rerun): swap, never delete first
        old = root / f".old-{final.name}"
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        _test_pause("swap")
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    _fsync(root)
    for stale in list_checkpoints(root.parent)[:-keep]:
        if stale != final:  # never the checkpoint just written, whatever else the folder holds
            shutil.rmtree(stale)
    return final


def save_checkpoint(out_dir, step: int, model, optimizer, state: dict, rngs: list[dict], keep: int) -> Path:
    """The whole checkpoint of a model held by one process."""
    tmp = begin_checkpoint(out_dir, step)
    parts = write_part(tmp, 0, 1, model, optimizer)
    return finish_checkpoint(tmp, step, model.config, state, rngs, keep, parts)


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
            if tmp.is_dir() and find_problem(tmp) is None:
                tmp.rename(final)
            else:
                old.rename(final)
    for leftover in root.glob(".tmp-step_*"):
        shutil.rmtree(leftover, ignore_errors=True)
    for leftover in root.glob(".old-step_*"):
        shutil.rmtree(leftover, ignore_errors=True)


# ---------------------------------------------------------------- reading

def find_problem(path: Path) -> str | None:
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
        if checksum(f) != expected["xxh3_64"]:
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
        why = find_problem(path)
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
    why = find_problem(found)
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


def _slices(part) -> dict:
    """The slices a part file holds (see write_slices): {name: [flat start, whole shape]}."""
    return json.loads((part.metadata() or {}).get(SLICES_KEY, "{}"))


def _read_tensors(path: Path, prefix: str, wanted) -> dict[str, torch.Tensor]:
    """The tensors named in `wanted` (a predicate on names) from every part file `prefix`*,
    slices (of a sharded optimizer's ranks) put back together into whole tensors."""
    out, pieces = {}, {}
    for f in sorted(path.glob(f"{prefix}*.safetensors")):
        with safe_open(str(f), framework="pt") as part:
            slices = _slices(part)
            for key in part.keys():
                if wanted(key):
                    if key in slices:
                        pieces.setdefault(key, []).append((*slices[key], part.get_tensor(key)))
                    else:
                        out[key] = part.get_tensor(key)
    for key, found in pieces.items():
        shape = found[0][1]
        whole = torch.empty(math.prod(shape), dtype=found[0][2].dtype)
        for start, _, piece in found:
            whole[start:start + piece.numel()] = piece
        if sum(piece.numel() for _, _, piece in found) != whole.numel():
            raise UserError(f"the checkpoint {path} holds only part of '{key}' (a rank's part file is missing)")
        out[key] = whole.view(shape)
    return out


def saved_keys(path: Path, prefix: str) -> set[str]:
    """The names of the tensors in the checkpoint's `prefix`* part files (no values read)."""
    keys = set()
    for f in path.glob(f"{prefix}*.safetensors"):
        with safe_open(str(f), framework="pt") as part:
            keys.update(part.keys())
    return keys


def read_ranges(path: Path, prefix: str, ranges: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    """For each name: the values [start, end) of the flattened tensor, from every part file
    `prefix`*, reading no more than those (whole tensors of any layout, or the slices of a
    sharded optimizer's ranks). A 0-dimensional tensor (a step count) is read whole."""
    out, filled = {name: None for name in ranges}, dict.fromkeys(ranges, 0)
    for f in sorted(path.glob(f"{prefix}*.safetensors")):
        with safe_open(str(f), framework="pt") as part:
            slices = _slices(part)
            for key in set(part.keys()) & set(ranges):
                start, end = ranges[key]
                stored = part.get_slice(key)
                shape = stored.get_shape()
                if not shape:  # a scalar: the same on every rank
                    out[key] = part.get_tensor(key)
                    continue
                if key in slices:  # a flat slice [s0, s0 + n) of the whole tensor
                    s0 = slices[key][0]
                    lo, hi = max(start, s0), min(end, s0 + shape[0])
                    if lo >= hi:
                        continue
                    piece, at = stored[lo - s0:hi - s0], lo
                else:  # the whole tensor: the rows that hold the range
                    row = math.prod(shape[1:])
                    first = start // row
                    piece = stored[first:-(-end // row)].flatten()[start - first * row:end - first * row]
                    at = start
                if out[key] is None:
                    out[key] = torch.empty(end - start, dtype=piece.dtype)
                out[key][at - start:at - start + piece.numel()] = piece
                filled[key] += piece.numel()
    for key, (start, end) in ranges.items():
        if out[key] is not None and out[key].dim() and filled[key] != end - start:
            raise UserError(f"the checkpoint {path} holds only part of '{key}' (a rank's part file is missing)")
    return out


def read_weights(path: Path, names, aliases: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """The whole tensors `names` of the checkpoint's weights, from its parts (slices put back
    together); a tied tensor saved under another of its names (`aliases`) is found there."""
    wanted = set(names) | {a for n in names for a in aliases.get(n, [])}
    saved = _read_tensors(path, "model", wanted.__contains__)
    found = {}
    for name in names:
        source = next((n for n in [name, *aliases.get(name, [])] if n in saved), None)
        if source is None:
            raise UserError(f"the checkpoint {path} has no weights for '{name}'; it was written for another model")
        found[name] = saved[source]
    return found


def whole(name: str):
    """load_weights' and load_optimizer's default `part`: every tensor whole."""
    return None


def _read_parts(path: Path, prefix: str, keys: dict[str, str], part) -> dict[str, torch.Tensor]:
    """The tensors `keys` (key -> the parameter it belongs to) of the checkpoint's `prefix`
    files: whole, or where `part(parameter)` gives a range, only those values of the flat
    tensor (read_ranges), put in the parameter's local shape `part` gave."""
    ranged = {key: part(name) for key, name in keys.items() if part(name) is not None}
    found = _read_tensors(path, prefix, lambda k: k in keys and k not in ranged)
    for key, values in read_ranges(path, prefix, {k: r[:2] for k, r in ranged.items()}).items():
        if values is not None:
            found[key] = values if not values.dim() else values.view(ranged[key][2])
    return found


def as_saved(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """load_weights' and load_optimizer's default `place`: every tensor as it was read."""
    return tensor


def load_weights(model, path: Path, aliases: dict[str, list[str]] | None = None, part=whole, place=as_saved):
    """Fill `model` (a whole model or one pipeline stage) from the checkpoint's parts, by name.
    `part(name)`: None for a tensor the model holds whole, or (start, end, shape): the values
    [start, end) of the flattened saved tensor that it holds in that shape (expert parallelism:
    this rank's experts, read without the others'). `place(name, tensor)`: what the model holds
    of the tensor read (tensor parallelism: a DTensor of its slice)."""
    aliases = tie_aliases(model) if aliases is None else aliases
    names = list(model.state_dict())
    found = read_weights(path, [n for n in names if part(n) is None], aliases)
    found |= _read_parts(path, "model", {n: n for n in names if part(n) is not None}, part)
    missing = [n for n in names if n not in found]
    if missing:
        raise UserError(f"the checkpoint {path} has no weights for '{missing[0]}'; it was written for another model")
    try:
        model.load_state_dict({name: place(name, tensor) for name, tensor in found.items()}, strict=True)
    except RuntimeError as e:
        raise UserError(f"the checkpoint {path} does not fit this model ({str(e).strip().splitlines()[-1].strip()})") from None


def load_optimizer(optimizer, model, path: Path, aliases: dict[str, list[str]] | None = None, part=whole,
                   place=as_saved):
    """Fill a freshly built optimizer with the state saved by parameter name in `path`
    (`part` and `place`, given the parameter's name, as load_weights')."""
    aliases = tie_aliases(model) if aliases is None else aliases
    names = parameter_names(optimizer, model)
    sources = {a: n for n in names for a in [n, *aliases.get(n, [])]}  # a saved name -> the parameter's
    keys = {key: sources[key.split("::", 1)[0]] for key in saved_keys(path, "optimizer")
            if key.split("::", 1)[0] in sources}
    by_name = {}
    for key, value in _read_parts(path, "optimizer", keys, part).items():
        name, field = key.split("::", 1)
        by_name.setdefault(name, {})[field] = place(sources[name], value)
    state = {}
    for index, name in enumerate(names):
        source = next((n for n in [name, *aliases.get(name, [])] if n in by_name), None)
        if source is not None:
            state[index] = by_name[source]
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})
