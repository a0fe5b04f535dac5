"""What rank 0 shows and records about a run: its progress (hvdtrain.observe.progress),
metrics.jsonl, TensorBoard, the experiment trackers (hvdtrain.observe.trackers), and the
summary line at its end.

metrics.jsonl holds one JSON object per logged step (`step`, `loss`, `lr`, `tokens_per_s`,
`world_size`, the step-time breakdown ...) and one per evaluation (`step`, `eval_loss`, ...).

A run that resumes at step S (from a checkpoint, or an elastic job's last commit) computes the
steps after S again. So that each step appears once in what a user reads (pandas, dashboards,
TensorBoard), opening the log removes the records of those steps from metrics.jsonl and has
TensorBoard purge its events from step S + 1 on; events (an elastic reset ...) are kept.
"""
import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

from hvdtrain.observe.metrics import FILE_NAME, is_event
from hvdtrain.observe.progress import SUMMARY, Progress, ProgressDisplay
from hvdtrain.observe.trackers import Trackers


class RunLog:
    def __init__(self, out_dir: str, start_step: int, max_steps: int, progress: bool, tensorboard: bool,
                 trackers: Trackers | None = None):
        self.path = Path(out_dir) / FILE_NAME
        keep_records_up_to(self.path, start_step)
        self.file = open(self.path, "a")
        self.out_dir, self.start_step, self.max_steps = Path(out_dir), start_step, max_steps
        self.display = ProgressDisplay(show_progress=progress)  # a bar on a terminal, else plain lines
        self.started = time.monotonic()
        self.last_train: dict | None = None
        self.last_eval: dict | None = None
        self.tokens_per_s: list[float] = []  # each record's throughput, for the summary
        self.trackers = trackers
        self.straggler = None  # the rank over the imbalance threshold in the previous interval
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            # TensorBoard drops the events of earlier runs from purge_step on (0: a run that starts
            # again from the beginning).
            self.tb = SummaryWriter(str(Path(out_dir) / "tensorboard"), purge_step=start_step + 1 if start_step else 0)

    def write(self, record: dict):
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                    self.tb.add_scalar(key, value, record["step"])
            # On disk now, not in 2 minutes: after a kill, the run that resumes keeps these events.
            self.tb.flush()
        if self.trackers is not None:
            self.trackers.log(record)

    def train_record(self, record: dict):
        self.write(record)
        self.last_train = record
        self.tokens_per_s.append(record["tokens_per_s"])
        self.display.update(Progress(record["step"], self.max_steps, record["loss"], record["lr"],
                                     record["tokens_per_s"], record.get("comm_fraction", 0.0),
                                     record.get("aux_loss"), record.get("expert_load_max")))
        # Warn about a rank that is the slow one in two intervals in a row: one noisy interval
        # (a shared machine, a GC pause) is not a straggler.
        slow = record["slowest_rank"] if record.get("imbalance_warning") else None
        if slow is not None and slow == self.straggler:
            stage = f" (pipeline stage {record['slowest_stage']})" if "slowest_stage" in record else ""
            self.message(f"warning: rank {record['slowest_rank']}{stage} is slow: its data+compute time is "
                         f"{record['imbalance']:.0%} above the fastest rank's (rank {record['fastest_rank']})")
        self.straggler = slow

    def eval_record(self, record: dict):
        self.write(record)
        self.last_eval = record
        self.message(f"step {record['step']}: {eval_figures(record)}")

    def event(self, record: dict):
        """Something that happened to the run at a step (e.g. an elastic reset): a record and a line."""
        self.write(record)
        details = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in record.items() if k not in ("step", "event"))
        self.message(f"step {record['step']}: {record['event']} ({details})")

    def message(self, text: str):
        self.display.message(text)

    def summary(self, hf_dir: Path | None) -> str:
        """The run's last line: what this run did, how fast, its final evaluation, where it is."""
        step = self.last_train["step"] if self.last_train else self.start_step
        took = round(time.monotonic() - self.started)
        done = f"{step - self.start_step} steps" + (f" (from step {self.start_step})" if self.start_step else "")
        done += f" in {took // 60}m{took % 60:02d}s" if took >= 60 else f" in {took}s"
        if self.tokens_per_s:
            done += f" ({sum(self.tokens_per_s) / len(self.tokens_per_s):.0f} tokens/s)"
        if self.last_eval is not None:
            done += f"; step {self.last_eval['step']}: {eval_figures(self.last_eval)}"
        where = f"run folder {self.out_dir}" + (f", model in {hf_dir}" if hf_dir else "")
        return f"{SUMMARY}{done}; {where}"

    def end_trackers(self, hf_dir: Path | None = None, failed: bool = False):
        """The tracker runs end: with the exported model (hf_dir) when the run is complete."""
        if self.trackers is not None:
            self.trackers.finish(hf_dir, failed)

    def close(self):
        self.display.close()
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def eval_figures(record: dict) -> str:
    ppl = f", perplexity {record['eval_ppl']:.2f}" if math.isfinite(record["eval_ppl"]) else ""
    acc = f", accuracy {record['eval_accuracy']:.3f}" if "eval_accuracy" in record else ""
    return f"eval loss {record['eval_loss']:.4f}{ppl}{acc}"


def keep_records_up_to(path: Path, start_step: int):
    """Make the metrics file at `path` what a run that starts at `start_step` appends to: the
    records of the steps it computes again (after start_step; from a start at 0 all, the
    baseline evaluation included) are removed; events, other lines and the order stay. A last
    line a kill cut short (no newline, not JSON) is cut off: it was never a complete record, and
    the next one would be glued to it. Rewritten atomically, and only when something changes."""
    if not path.exists() or all(kept == line for line, kept in _kept_lines(path, start_step)):
        return
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as out:
            for _, kept in _kept_lines(path, start_step):
                if kept is not None:
                    out.write(kept)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _kept_lines(path: Path, start_step: int) -> Iterator[tuple[bytes, bytes | None]]:
    """(line, what stays of it: the line, the line with its missing newline, or None) for each
    line of the file, read one at a time."""
    with open(path, "rb") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:  # not JSON (or not UTF-8)
                record = None
            complete = line.endswith(b"\n")
            if record is None and not complete:
                yield line, None
            elif (isinstance(record, dict) and "step" in record and not is_event(record)
                  and (record["step"] > start_step or start_step == 0)):
                yield line, None
            else:
                yield line, line if complete else line + b"\n"
