"""Experiment trackers: the run in Weights & Biases (`log.wandb`) and MLflow (`log.mlflow`), from rank 0.

RunLog (hvdtrain.observe.run_log) hands every record it writes to `Trackers.log`; each tracker
gets the record's numbers at its step. A resumed run continues the same tracker run: its id is
kept in out_dir/trackers.json, with the last step each tracker was given, so that steps the
resumed run computes again are not logged twice (metrics.jsonl and TensorBoard drop them
likewise). A tracker that cannot start is a UserError (exit 2) before anything is written; one
that fails in the middle of the run is reported once and left out from then on: training goes on.
"""
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

from hvdtrain.errors import UserError

IDS_FILE = "trackers.json"


def scalars(record: dict) -> dict[str, float]:
    """The numbers of a record, as TensorBoard gets them: not the step, lists or nested tables."""
    return {k: float(v) for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}


def flat(tree: dict, prefix: str = "") -> dict[str, object]:
    """{"train": {"lr": 1}} -> {"train.lr": 1}"""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class WandbRun:
    name = "W&B"

    def __init__(self, cfg, out_dir: Path, config: dict, run_id: str | None):
        import wandb
        c = cfg.log.wandb
        self.run = wandb.init(project=c.project, entity=c.entity, name=c.name or out_dir.resolve().name,
                              tags=c.tags or None, config=config, id=run_id,
                              resume="allow", dir=str(out_dir), reinit="create_new",
                              # console="off": the launcher shows the output; wandb need not copy it
                              settings=wandb.Settings(console="off", silent=True))
        self.id = self.run.id

    def log(self, step: int, values: dict[str, float]):
        self.run.log(values, step=step)

    def finish(self, hf_dir: Path | None, failed: bool):
        self.run.finish(exit_code=1 if failed else 0)


class MlflowRun:
    name = "MLflow"

    def __init__(self, cfg, out_dir: Path, config: dict, run_id: str | None):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient
        c = cfg.log.mlflow
        uri = c.tracking_uri
        if uri is None:  # a local store in the run folder: MLflow 3 keeps file stores only when asked
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (out_dir / "mlruns").resolve().as_uri()
        self.client, self.log_model = MlflowClient(uri), c.log_model
        if run_id is None:
            experiment = self.client.get_experiment_by_name(c.experiment)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(c.experiment)
            run_id = self.client.create_run(experiment_id, run_name=out_dir.resolve().name).info.run_id
            params = [Param(k, str(v)[:6000]) for k, v in flat(config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
                self.client.log_batch(run_id, params=params[i:i + 100])
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.id = run_id

    def log(self, step: int, values: dict[str, float]):
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        self.client.log_batch(self.id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def finish(self, hf_dir: Path | None, failed: bool):
        if hf_dir is not None and self.log_model:
            self.client.log_artifacts(self.id, str(hf_dir), "hf")
        self.client.set_terminated(self.id, "FAILED" if failed else "FINISHED")


KINDS = {"wandb": WandbRun, "mlflow": MlflowRun}
MODULES = {"wandb": "wandb", "mlflow": "mlflow"}  # what each needs installed: the extra of that name


def check_installed(cfg):
    """A tracker asked for but not installed: one line, before anything starts (`hvdtrain launch`
    checks on its host, each worker on its own)."""
    for key, module in MODULES.items():
        if getattr(cfg.log, key).enabled and importlib.util.find_spec(module) is None:
            raise UserError(f"log.{key}.enabled is true but {module} is not installed: "
                            f"pip install 'hvdtrain[{key}]' (or set log.{key}.enabled=false)")


class Trackers:
    """The trackers a run's config asks for, opened on rank 0 before the run folder is written."""

    def __init__(self, cfg, out_dir: str, start_step: int, config: dict):
        check_installed(cfg)
        self.out_dir = Path(out_dir)
        saved = self._read_ids() if start_step > 0 else {}
        self.runs = {}
        self.logged_before: dict[str, int] = {}  # the last step an earlier run of this folder logged
        self.last_step: dict[str, int] = {}
        for key, kind in KINDS.items():
            if not getattr(cfg.log, key).enabled:
                continue
            previous = saved.get(key, {})
            try:
                self.runs[key] = kind(cfg, self.out_dir, config, previous.get("id"))
            except Exception as e:  # not reachable, refused, misconfigured: the user asked for it
                raise UserError(f"log.{key}: cannot start the {kind.name} run: {type(e).__name__}: "
                                f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}") from None
            self.logged_before[key] = self.last_step[key] = previous.get("last_step", -1)
        self._write_ids()

    def log(self, record: dict):
        values, step = scalars(record), record["step"]
        for key, run in list(self.runs.items()):
            if step <= self.logged_before[key]:  # computed again after a resume: logged the first time
                continue
            try:
                run.log(step, values)
            except Exception as e:
                self._drop(key, f"{type(e).__name__}: {e}")
            else:
                self.last_step[key] = max(self.last_step[key], step)
        self._write_ids()

    def finish(self, hf_dir: Path | None = None, failed: bool = False):
        for key, run in list(self.runs.items()):
            try:
                run.finish(hf_dir, failed)
            except Exception as e:
                self._drop(key, f"{type(e).__name__}: {e}")
        self.runs = {}

    def _drop(self, key: str, why: str):
        """Reported once; the run goes on without this tracker."""
        print(f"hvdtrain: warning: log.{key}: the {self.runs[key].name} run failed and is left out from now on: "
              f"{why.strip().splitlines()[0]}", file=sys.stderr, flush=True)
        del self.runs[key]

    def _read_ids(self) -> dict:
        path = self.out_dir / IDS_FILE
        try:
            return json.loads(path.read_text()) if path.is_file() else {}
        except ValueError:
            return {}  # damaged: the trackers start new runs

    def _write_ids(self):
        ids = {key: {"id": run.id, "last_step": self.last_step[key]} for key, run in self.runs.items()}
        if ids:
            tmp = self.out_dir / f".{IDS_FILE}.tmp"
            tmp.write_text(json.dumps(ids))
            os.replace(tmp, self.out_dir / IDS_FILE)
