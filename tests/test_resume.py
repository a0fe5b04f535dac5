"""Resume: the same command continues exactly where training stopped, also with another
number of workers, and a kill during a checkpoint write leaves the previous one usable."""
import json

import pytest

from helpers import (WORKERS, assert_same_losses, assert_same_params, horovodrun, load_params, step_losses,
                     train_workers)
from hvdtrain.checkpointing import checkpoint

pytestmark = pytest.mark.workers

STEPS, HALF = 8, 4


@pytest.mark.parametrize("optimizer,precision,model", [
    ("adamw", "fp32", {}), pytest.param("lamb", "fp16", {}, marks=pytest.mark.deep),  # fp16's scale: below
    # grouped-query attention: both query heads share one key/value head
    pytest.param("adamw", "fp32", {"arch": "llama", "n_kv_head": 1}, marks=pytest.mark.deep),
    # the second layer attends to 8 of the 16 positions
    pytest.param("adamw", "fp32", {"arch": "modernbert", "local_attention": 8}, marks=pytest.mark.deep)],
    ids=["adamw-fp32", "lamb-fp16", "llama", "modernbert"])
def test_stop_and_resume_equals_straight_run(tmp_path, tiny_config, optimizer, precision, model):
    """LAMB under fp16: its step takes the GradScaler's found_inf itself, and its state resumes."""
    config = tiny_config({"model": model, "train": {"max_steps": STEPS, "optimizer": optimizer, "precision": precision},
                          "checkpoint": {"every": 2, "keep": 2}})
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train_workers(2, config, f"out_dir={straight}")
    train_workers(2, config, f"out_dir={resumed}", f"train.stop_at_step={HALF}")
    assert [p.name for p in checkpoint.list_checkpoints(resumed)] == ["step_00000002", "step_00000004"]
    proc = train_workers(2, config, f"out_dir={resumed}")
    assert "resuming at step 4" in proc.stdout
    assert_same_losses(step_losses(straight), step_losses(resumed), min_steps=STEPS)
    assert_same_params(load_params(straight, 0), load_params(resumed, 0))
    assert_same_params(load_params(resumed, 0), load_params(resumed, 1))
    # keep=2: only the two newest checkpoints remain
    assert [p.name for p in checkpoint.list_checkpoints(resumed)] == ["step_00000006", "step_00000008"]


def test_resume_with_two_workers_from_a_one_worker_checkpoint(tmp_path, tiny_config):
    """Global batch fixed at 8: 1 worker accumulates 2 micro batches, 2 workers 1 each; the
    data order continues from the checkpoint's stream position."""
    config = tiny_config({"train": {"max_steps": STEPS, "global_batch_size": 8}})
    straight, moved = tmp_path / "straight", tmp_path / "moved"
    train_workers(1, config, f"out_dir={straight}")
    train_workers(1, config, f"out_dir={moved}", f"train.stop_at_step={HALF}")
    train_workers(2, config, f"out_dir={moved}")
    losses = step_losses(moved)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert_same_losses(step_losses(straight), losses, min_steps=STEPS)
    assert_same_params(load_params(straight, 0), load_params(moved, 1), atol=1e-5)


def test_kill_during_checkpoint_write_keeps_previous_checkpoint(tmp_path, tiny_config):
    config = tiny_config({"train": {"max_steps": STEPS}, "checkpoint": {"every": 2, "keep": 3}})
    out = tmp_path / "run"
    # The worker SIGKILLs itself halfway through writing the step-4 checkpoint's state file.
    proc = horovodrun(2, [WORKERS / "die_during_checkpoint.py", config, f"out_dir={out}", "4"])
    assert proc.returncode != 0
    assert any(p.name.startswith(".tmp-step_00000004") for p in checkpoint.checkpoint_dir(out).iterdir())
    newest = checkpoint.newest_intact_checkpoint(out)
    assert newest.name == "step_00000002"
    assert checkpoint.find_problem(newest) is None
    state = checkpoint.read_state(newest)
    assert state["step"] == 2 and state["position"] == 2 * 8
    # The same command resumes from step 2 and finishes; the partial write is cleaned up.
    proc = train_workers(2, config, f"out_dir={out}")
    assert "resuming at step 2" in proc.stdout
    assert sorted(step_losses(out))[-1] == STEPS
    assert not [p for p in checkpoint.checkpoint_dir(out).iterdir() if p.name.startswith(".")]
    assert checkpoint.newest_intact_checkpoint(out).name == f"step_{STEPS:08d}"


@pytest.mark.parametrize("rule,factor", [("linear", 2.0), pytest.param("sqrt", 2 ** 0.5, marks=pytest.mark.deep)])
def test_lr_scaling_at_two_workers(tmp_path, tiny_config, rule, factor):
    from helpers import read_metrics
    config = tiny_config({"train": {"max_steps": 4, "warmup_steps": 2, "schedule": "constant", "lr": 1e-3,
                                    "lr_scaling": rule}})
    train_workers(2, config, f"out_dir={tmp_path}")
    records = read_metrics(tmp_path)[0]
    lr_after_warmup = [r["lr"] for r in records if r["step"] > 2]
    assert lr_after_warmup == pytest.approx([1e-3 * factor] * 2)
    assert records[0]["lr"] == pytest.approx(1e-3 * factor / 2)  # warmup step 1 of 2


def test_resume_with_a_bigger_global_batch_continues_the_stream(tmp_path, tiny_config):
    """Stopped after 4 steps of 8 samples (stream position 32), resumed with 16 per step: steps
    5-8 read positions 32-95, so the sampler must start at its own step 2, not 4."""
    from helpers import hvdtrain, read_metrics
    config = tiny_config({"train": {"max_steps": STEPS, "global_batch_size": 8}})
    out = tmp_path / "run"
    assert hvdtrain("train", config, f"out_dir={out}", f"train.stop_at_step={HALF}").returncode == 0
    proc = hvdtrain("train", config, f"out_dir={out}", "train.global_batch_size=16", "train.micro_batch_size=8")
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = read_metrics(out)[0]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["global_batch"] for r in records] == [8] * HALF + [16] * HALF
    assert checkpoint.read_state(checkpoint.newest_intact_checkpoint(out))["position"] == HALF * 8 + HALF * 16


def rewrite_checkpoint_file(folder, name, text):
    """Change one file of a checkpoint and its manifest entry, as a run that wrote it would have."""
    import json
    (folder / name).write_text(text)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": (folder / name).stat().st_size, "xxh3_64": checkpoint.checksum(folder / name)}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_fp16_resume_gives_every_rank_the_saved_loss_scale(tmp_path, tiny_config):
    """The checkpoint's grad scaler says 1024 (as after overflows); the default is 65536. Every
    rank must resume with 1024, or the averaged gradients are unscaled by different factors and
    the replicas drift apart. (No clipping: it would hide the difference in scale.)"""
    import json
    config = tiny_config({"train": {"max_steps": STEPS, "precision": "fp16", "grad_clip": 0.0},
                          "checkpoint": {"every": 2}})
    out = tmp_path / "run"
    train_workers(2, config, f"out_dir={out}", f"train.stop_at_step={HALF}")
    newest = checkpoint.newest_intact_checkpoint(out)
    state = checkpoint.read_state(newest)
    assert state["scaler"]["scale"] == 65536.0
    state["scaler"]["scale"] = 1024.0
    rewrite_checkpoint_file(newest, "state.json", json.dumps(state))
    train_workers(2, config, f"out_dir={out}")
    assert_same_params(load_params(out, 0), load_params(out, 1))
    assert checkpoint.read_state(checkpoint.newest_intact_checkpoint(out))["scaler"]["scale"] == 1024.0


@pytest.mark.deep
def test_resume_with_dropout_equals_straight_run(tmp_path, tiny_config):
    """Dropout draws from each rank's RNG: the resumed run must draw exactly what the straight
    run drew (the data loader must not consume the restored RNG)."""
    config = tiny_config({"model": {"dropout": 0.1}, "train": {"max_steps": STEPS}, "checkpoint": {"every": 2}})
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train_workers(2, config, f"out_dir={straight}")
    train_workers(2, config, f"out_dir={resumed}", f"train.stop_at_step={HALF}")
    train_workers(2, config, f"out_dir={resumed}")
    assert step_losses(straight) == step_losses(resumed)
    assert_same_params(load_params(straight, 0), load_params(resumed, 0))


def test_damaged_newest_checkpoint_is_set_aside_and_the_run_resumes_before_it(tmp_path, tiny_config):
    import os
    config = tiny_config({"train": {"max_steps": STEPS}, "checkpoint": {"every": 2, "keep": 3}})
    straight, out = tmp_path / "straight", tmp_path / "run"
    train_workers(2, config, f"out_dir={straight}")
    train_workers(2, config, f"out_dir={out}", f"train.stop_at_step={HALF}")
    newest = checkpoint.newest_intact_checkpoint(out)
    os.truncate(newest / "optimizer.safetensors", 100)
    proc = train_workers(2, config, f"out_dir={out}")
    assert "resuming at step 2" in proc.stdout
    assert "optimizer.safetensors has 100 bytes" in proc.stdout + proc.stderr
    assert (checkpoint.checkpoint_dir(out) / "damaged-step_00000004").is_dir()
    assert_same_losses(step_losses(straight), step_losses(out), min_steps=STEPS)


@pytest.mark.deep
def test_horovod_timeline_and_autotune_log_land_in_a_new_run_folder(tmp_path, tiny_config):
    import json
    out = tmp_path / "run"
    train_workers(2, tiny_config({"train": {"max_steps": 3}}), f"out_dir={out}", "horovod.timeline=timeline.json",
                  "horovod.autotune=true")
    events = json.loads((out / "timeline.json").read_text())  # closed: the run stopped the timeline
    assert any("ALLREDUCE" in str(e) for e in events)
    assert (out / "horovod_autotune.csv").read_text().startswith("hierarchical_allreduce,")


def launch(launcher: str, tmp_path, config, out, *overrides):
    """`hvdtrain train` (a plain run of one worker) or `hvdtrain launch --elastic` (two workers)."""
    from helpers import discovery, hvdtrain
    if launcher == "plain":
        return hvdtrain("train", config, f"out_dir={out}", *overrides, timeout=240)
    return hvdtrain("launch", "--elastic", "-np", "2", "--min-np", "1", "--max-np", "2", "--host-discovery-script",
                    discovery(tmp_path, ["localhost:1", "127.0.0.1:1"]), "--network-interface", "lo", config,
                    f"out_dir={out}", *overrides, timeout=240)


def folder_bytes(out) -> dict:
    """Every folder and file under `out`, with each file's bytes."""
    return {p.relative_to(out): p.read_bytes() if p.is_file() else None for p in out.rglob("*")}


def assert_refused(proc, words: list[str]):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(lines) == 1 and all(w in lines[0] for w in words), proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr


ELASTIC_READY = {"train": {"max_steps": STEPS, "global_batch_size": 8}, "checkpoint": {"every": 2}}


@pytest.mark.deep
@pytest.mark.parametrize("launcher", ["plain", "elastic"])
def test_resume_false_refuses_a_folder_with_a_live_run_and_touches_nothing(tmp_path, tiny_config, launcher):
    """The run in the folder is still going: its checkpoint of step 6 is being written. A plain
    and an elastic job refuse alike, before anything there is touched."""
    from helpers import hvdtrain
    config = tiny_config(ELASTIC_READY)
    out = tmp_path / "run"
    assert hvdtrain("train", config, f"out_dir={out}", f"train.stop_at_step={HALF}").returncode == 0
    in_flight = checkpoint.checkpoint_dir(out) / ".tmp-step_00000006"
    in_flight.mkdir()
    (in_flight / "model.safetensors").write_bytes(b"being written")
    before = folder_bytes(out)
    proc = launch(launcher, tmp_path, config, out, "checkpoint.resume=false")
    assert_refused(proc, [f"out_dir '{out}' holds another run", "checkpoint.resume is false"])
    assert folder_bytes(out) == before


@pytest.mark.deep
@pytest.mark.parametrize("launcher", ["plain", "elastic"])
def test_no_intact_checkpoint_is_refused_naming_what_was_set_aside(tmp_path, tiny_config, launcher):
    """Every checkpoint damaged: the run is not restarted at step 0 into the same metrics.jsonl;
    the same command says so again (the checkpoints stay set aside)."""
    import os

    from hvdtrain.observe.metrics import FILE_NAME
    from helpers import hvdtrain
    config = tiny_config(ELASTIC_READY)
    out = tmp_path / "run"
    assert hvdtrain("train", config, f"out_dir={out}", f"train.stop_at_step={HALF}").returncode == 0
    for path in checkpoint.list_checkpoints(out):
        os.truncate(path / "model.safetensors", 100)
    records, exported = (out / FILE_NAME).read_bytes(), folder_bytes(out / "hf")
    words = [f"out_dir '{out}' holds a run but no intact checkpoint", "damaged-step_00000002",
             "damaged-step_00000004", "move that run away"]
    for _ in range(2):
        assert_refused(launch(launcher, tmp_path, config, out), words)
        assert (out / FILE_NAME).read_bytes() == records
        assert folder_bytes(out / "hf") == exported and not checkpoint.list_checkpoints(out)


@pytest.mark.deep
def test_a_run_stopped_before_its_first_checkpoint_starts_again_at_step_0(tmp_path, tiny_config):
    """A requeued job killed before its first checkpoint (its metrics.jsonl and a half-written
    checkpoint are there): the same command starts it again from step 0, saying so, and the run
    log holds each step once, with an uninterrupted run's losses."""
    from helpers import hvdtrain
    config = tiny_config({"train": {"max_steps": STEPS}, "checkpoint": {"every": 4}})
    out, straight = tmp_path / "run", tmp_path / "straight"
    assert hvdtrain("train", config, f"out_dir={straight}").returncode == 0
    assert hvdtrain("train", config, f"out_dir={out}", "train.stop_at_step=3", "checkpoint.every=0").returncode == 0
    for path in checkpoint.list_checkpoints(out):  # the pause's checkpoint: as if it had never been written
        path.rename(path.with_name(".tmp-" + path.name))
    proc = hvdtrain("train", config, f"out_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"out_dir '{out}' holds a run that stopped before its first checkpoint: starting it again from step 0" \
        in proc.stdout
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == list(range(1, STEPS + 1))  # as written: each step once
    assert_same_losses(step_losses(straight), step_losses(out), min_steps=STEPS)
