"""Experiment trackers (hvdtrain/observe/trackers.py): W&B in offline mode and MLflow with a local
file store, written by a real 2-worker launch and its resume and read back with the trackers'
own code: MlflowClient, and wandb's protobuf records (wandb 0.31 has no Python reader of its
run files left; their framing is LevelDB's log format, read below)."""
import json
import shutil

import pytest

from hvdtrain.config import load_config
from hvdtrain.errors import UserError
from hvdtrain.observe.trackers import Trackers

wandb = pytest.importorskip("wandb", reason="the test extra installs wandb (pip install -e .[test])")
mlflow_tracking = pytest.importorskip("mlflow.tracking", reason="the test extra installs mlflow-skinny")
from helpers import hvdtrain  # noqa: E402

BLOCK, HEADER = 32768, 7  # LevelDB log blocks and chunk headers (crc32, length, type)
FULL, LAST = 1, 4


def wandb_records(path) -> list:
    """The Record messages of a run-<id>.wandb file, in order."""
    from wandb.proto import wandb_internal_pb2
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    records, pos, pending = [], HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if left < HEADER or (length == 0 and kind == 0):  # the rest of a block is padding
            pos += left
            continue
        pending += data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(run_dirs) -> tuple[list[int], dict, list[dict]]:
    """(the logged steps in order, the run's config, each step's values) over the offline run folders."""
    steps, config, rows = [], {}, []
    for folder in run_dirs:
        for record in wandb_records(next(folder.glob("run-*.wandb"))):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                values = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                          for item in record.history.item}
                steps.append(record.history.step.num)
                rows.append(values)
            elif kind in ("run", "config"):  # the config as the run starts, and later updates
                update = record.run.config.update if kind == "run" else record.config.update
                config.update({item.key: json.loads(item.value_json) for item in update})
    return steps, config, rows


@pytest.mark.workers
def test_a_launch_and_its_resume_are_one_run_in_wandb_and_in_mlflow(tmp_path, tiny_config, monkeypatch):
    out = tmp_path / "run"
    config = tiny_config({"train": {"max_steps": 4}, "checkpoint": {"every": 2, "keep": 3},
                          "log": {"wandb": {"enabled": True, "project": "p", "tags": ["tiny"]},
                                  "mlflow": {"enabled": True, "experiment": "e"}}})
    env = {"WANDB_MODE": "offline"}
    first = hvdtrain("launch", "--gloo", "-np", "2", config, f"out_dir={out}", env=env)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    ids = json.loads((out / "trackers.json").read_text())
    # The run resumes at step 2 (the checkpoint of step 4 is gone): steps 3 and 4 are computed again.
    shutil.rmtree(out / "checkpoints" / "step_00000004")
    second = hvdtrain("launch", "--gloo", "-np", "2", config, f"out_dir={out}", "train.max_steps=6", env=env)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert "resuming at step 2" in second.stdout
    assert "log.wandb" not in first.stdout + second.stdout and "log.mlflow" not in first.stdout + second.stdout
    assert {k: v["id"] for k, v in json.loads((out / "trackers.json").read_text()).items()} == \
        {k: v["id"] for k, v in ids.items()}

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads a file store only when asked
    client = mlflow_tracking.MlflowClient((out / "mlruns").as_uri())
    run = client.get_run(ids["mlflow"]["id"])
    assert run.info.status == "FINISHED" and run.data.params["train.max_steps"] in ("4", "6")
    assert client.get_experiment(run.info.experiment_id).name == "e"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3, 4, 5, 6]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval_loss")] == [0, 4, 6]
    assert client.get_metric_history(run.info.run_id, "grad_norm") and \
        client.get_metric_history(run.info.run_id, "tokens_per_s")
    assert "hf/model.safetensors" in {f.path for f in client.list_artifacts(run.info.run_id, "hf")}

    folders = sorted((out / "wandb").glob(f"offline-run-*-{ids['wandb']['id']}"))
    assert len(folders) == 2  # one run, written by two launches
    steps, wandb_config, rows = wandb_history(folders)
    assert sorted(set(steps)) == steps and steps == [0, 1, 2, 3, 4, 5, 6]  # each step once, in order
    assert wandb_config["train"]["lr"] == 1e-2 and wandb_config["resolved"]["world_size"] == 2
    assert all("loss" in row and "lr" in row for row in rows[1:]) and "eval_loss" in rows[0]


def test_a_tracker_asked_for_but_not_installed_is_one_line_before_the_workers_start(tmp_path, tiny_config):
    """The check goes by the module's name: a name that is not installed stands in for wandb."""
    from hvdtrain.observe import trackers
    cfg = load_config(str(tiny_config()), ["log.wandb.enabled=true"])
    trackers.check_installed(cfg)  # installed here (the test extra)
    missing = dict(trackers.MODULES, wandb="wandb_not_installed_here")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trackers, "MODULES", missing)
        with pytest.raises(UserError, match=r"^log.wandb.enabled is true but wandb_not_installed_here is not "
                                            r"installed: pip install 'hvdtrain\[wandb\]'"):
            trackers.check_installed(cfg)


def test_an_unreachable_tracker_asked_for_is_a_user_error(tmp_path, monkeypatch, tiny_config):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    cfg = load_config(str(tiny_config()), ["log.mlflow.enabled=true", "log.mlflow.tracking_uri=http://127.0.0.1:9"])
    with pytest.raises(UserError, match=r"^log.mlflow: cannot start the MLflow run: "):
        Trackers(cfg, str(tmp_path), 0, cfg.to_dict())


def test_a_tracker_failing_mid_run_is_reported_once_and_left_out(tmp_path, capsys, tiny_config):
    cfg = load_config(str(tiny_config()), ["log.mlflow.enabled=true"])
    trackers = Trackers(cfg, str(tmp_path), 0, cfg.to_dict())
    trackers.log({"step": 1, "loss": 4.0})
    shutil.rmtree(tmp_path / "mlruns")  # the store is gone
    trackers.log({"step": 2, "loss": 3.9})
    trackers.log({"step": 3, "loss": 3.8})
    trackers.finish()
    err = capsys.readouterr().err
    assert err.count("hvdtrain: warning: log.mlflow: the MLflow run failed") == 1 and not trackers.runs, err
