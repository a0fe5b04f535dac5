"""Checkpoint files without workers: the format holds no pickle, a crash between the renames of
a rewritten step is recovered, damaged checkpoints are found and set aside, and the optimizer
state round-trips by parameter name."""
import os
import pickle

import pytest
import torch

from hvdtrain.checkpointing import checkpoint
from hvdtrain.training import rng
from hvdtrain.errors import UserError
from hvdtrain.config import ModelConfig, TrainConfig
from hvdtrain.models.common import Vocab, build_model
from hvdtrain.optim.optimizers import build_optimizer


def tiny_model_and_optimizer():
    torch.manual_seed(0)
    model = build_model(ModelConfig(n_layer=1, d_model=16, n_head=2, dropout=0.0), Vocab(size=64, pad_id=0), 8)
    optimizer = build_optimizer(model, TrainConfig(), 1e-3, torch.device("cpu"))
    model(input_ids=torch.randint(0, 64, (2, 8))).logits.sum().backward()
    optimizer.step()
    return model, optimizer


def write(out_dir, step, model, optimizer, keep=5):
    state = {"step": step, "position": step * 8, "world_size": 1, "scaler": {}, "config": {}}
    return checkpoint.save_checkpoint(out_dir, step, model, optimizer, state, [rng.capture()], keep=keep)


def test_round_trip_by_parameter_name(tmp_path):
    model, optimizer = tiny_model_and_optimizer()
    path = write(tmp_path, 3, model, optimizer)
    assert checkpoint.find_problem(path) is None
    assert sorted(f.name for f in path.iterdir()) == sorted(
        ["config.json", "model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json", "manifest.json"])
    fresh_model, fresh_optimizer = tiny_model_and_optimizer()
    torch.nn.init.zeros_(fresh_model.transformer.wte.weight)
    fresh_optimizer.state.clear()
    checkpoint.load_weights(fresh_model, path)
    checkpoint.load_optimizer(fresh_optimizer, fresh_model, path)
    assert torch.equal(fresh_model.transformer.wte.weight, model.transformer.wte.weight)
    for a, b in zip(optimizer.state_dict()["state"].values(), fresh_optimizer.state_dict()["state"].values()):
        assert a.keys() == b.keys() and all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a)
    assert checkpoint.read_state(path)["position"] == 24
    assert checkpoint.read_rngs(path, 1)[0].keys() == rng.capture().keys()


def crashed(out_dir, model, optimizer):
    """What a crash between the renames of a rewrite of step 4 leaves: .old-step_4 (the old
    version) and .tmp-step_4 (the new one, complete), no step_4. Both are written elsewhere and
    moved in (a write into out_dir would recover what it finds first)."""
    root = checkpoint.checkpoint_dir(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    write(out_dir / "old", 4, model, optimizer).rename(root / ".old-step_00000004")
    write(out_dir / "new", 4, model, optimizer).rename(root / ".tmp-step_00000004")


def test_crash_between_the_renames_keeps_the_complete_version(tmp_path):
    """A rewrite of step 4 renames step_4 -> .old-step_4, then .tmp-step_4 -> step_4."""
    model, optimizer = tiny_model_and_optimizer()
    root = checkpoint.checkpoint_dir(tmp_path)
    # The new version was complete when the crash came: it wins.
    crashed(tmp_path, model, optimizer)
    checkpoint.recover_interrupted_writes(tmp_path)
    assert [p.name for p in root.iterdir()] == ["step_00000004"]
    assert checkpoint.find_problem(root / "step_00000004") is None
    # The new version was not complete (no manifest yet): the old one is put back.
    (root / "step_00000004").rename(root / ".old-step_00000004")
    incomplete = write(tmp_path / "elsewhere", 4, model, optimizer)
    (incomplete / "manifest.json").unlink()
    incomplete.rename(root / ".tmp-step_00000004")
    checkpoint.recover_interrupted_writes(tmp_path)
    assert [p.name for p in root.iterdir()] == ["step_00000004"]
    assert checkpoint.find_problem(root / "step_00000004") is None


def test_a_step_written_again_after_a_crash_between_its_renames_leaves_nothing_behind(tmp_path):
    """An elastic job's rank 0 killed between the renames of a rewrite of step 4: the new rank 0
    redoes the steps since the last commit and writes step 4 again, without a relaunch (which
    recovers first). The write recovers itself: no `.old-`/`.tmp-` folder was left for ever."""
    model, optimizer = tiny_model_and_optimizer()
    root = checkpoint.checkpoint_dir(tmp_path)
    crashed(tmp_path, model, optimizer)
    write(tmp_path, 4, model, optimizer)
    assert [p.name for p in root.iterdir()] == ["step_00000004"]
    assert checkpoint.find_problem(root / "step_00000004") is None


def test_keep_never_deletes_the_checkpoint_just_written(tmp_path):
    model, optimizer = tiny_model_and_optimizer()
    for step in (10, 20):
        write(tmp_path, step, model, optimizer, keep=1)
    newest = write(tmp_path, 2, model, optimizer, keep=1)  # a lower step than what the folder holds
    assert newest.is_dir()


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_manifest"])
def test_damaged_newest_checkpoint_is_set_aside(tmp_path, damage):
    model, optimizer = tiny_model_and_optimizer()
    write(tmp_path, 2, model, optimizer)
    newest = write(tmp_path, 4, model, optimizer)
    target = newest / "model.safetensors"
    if damage == "truncate":
        os.truncate(target, target.stat().st_size // 2)
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    else:
        (newest / "manifest.json").unlink()
    assert checkpoint.find_problem(newest) is not None
    with pytest.raises(UserError, match="step_00000004"):
        checkpoint.resolve_checkpoint(newest)
    assert checkpoint.newest_intact_checkpoint(tmp_path).name == "step_00000002"
    assert (newest.parent / "damaged-step_00000004").is_dir()  # kept, under a name never loaded


class MakesAMarker:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickled_state_is_never_unpickled(tmp_path):
    """A checkpoint of the old format (or a crafted one) holds state.pt: refused, not loaded."""
    marker = tmp_path / "marker"
    folder = checkpoint.checkpoint_dir(tmp_path / "run") / "step_00000002"
    folder.mkdir(parents=True)
    (folder / "state.pt").write_bytes(pickle.dumps({"step": MakesAMarker(str(marker))}))
    for call in (lambda: checkpoint.newest_intact_checkpoint(tmp_path / "run"),
                 lambda: checkpoint.resolve_checkpoint(tmp_path / "run")):
        with pytest.raises(UserError, match="pickle"):
            call()
    assert not marker.exists()
