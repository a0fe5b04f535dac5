"""metrics.jsonl records: the step breakdown names the slowest rank, and its pipeline stage; a
line a kill cut short is neither read nor appended to; a resumed run shows each step once."""
import json
from pathlib import Path

import numpy as np
import pytest

from helpers import WORKERS, assert_same_losses, horovodrun, step_losses, train_workers
from hvdtrain.errors import UserError
from hvdtrain.observe.metrics import FILE_NAME, PHASES, read_metrics, read_records, summarize_ranks
from hvdtrain.observe.run_log import RunLog, keep_records_up_to


def per_rank_times(busy: list[float]) -> np.ndarray:
    """Per-rank rows (phases..., step) where only the data phase differs."""
    rows = np.zeros((len(busy), len(PHASES) + 1))
    rows[:, PHASES.index("data")] = busy
    rows[:, PHASES.index("pipeline")] = 0.1
    rows[:, -1] = 1.0
    return rows


def test_the_slowest_rank_and_its_stage_are_named():
    # 2 stages x 2 copies: rank = stage x 2 + copy, so rank 3 is stage 1's second copy.
    record = summarize_ranks(per_rank_times([0.1, 0.1, 0.1, 0.5]), threshold=0.2, copies_per_stage=2)
    assert record["slowest_rank"] == 3 and record["slowest_stage"] == 1 and record["imbalance_warning"]
    assert "slowest_stage" not in summarize_ranks(per_rank_times([0.1, 0.5]), threshold=0.2)


def records_file(tmp_path, lines: list[str], tail: str) -> Path:
    path = tmp_path / FILE_NAME
    path.write_text("".join(line + "\n" for line in lines) + tail)
    return path


def test_a_line_cut_short_by_a_kill_is_skipped_by_readers_and_cut_off_before_appending(tmp_path):
    """A kill while a record was written leaves part of a line; the next run appends to the file
    and `report` reads it (before: the next record was glued to the partial line, and every
    reader refused the file)."""
    complete = [json.dumps({"step": s, "loss": 1.0 / s, "step_losses": [1.0 / s]}) for s in (1, 2)]
    path = records_file(tmp_path, complete, json.dumps({"step": 3, "loss": 0.3, "step_losses": [0.3]})[:17])
    assert [r["step"] for r in read_records(path)] == [1, 2]
    log = RunLog(str(tmp_path), 2, 4, progress=False, tensorboard=False)
    log.write(log_record(3))
    log.close()
    assert path.read_text() == "".join(line + "\n" for line in complete) + json.dumps(log_record(3)) + "\n"
    assert [r["loss"] for r in read_metrics(tmp_path)[0]] == [1.0, 0.5, 0.25]


def log_record(step: int) -> dict:
    return {"step": step, "loss": 0.25, "step_losses": [0.25]}


@pytest.mark.parametrize("tail", ["", "\n", json.dumps({"step": 3, "loss": 0.5})], ids=["none", "newline", "complete"])
def test_a_file_that_ends_with_a_whole_record_keeps_it(tmp_path, tail):
    path = records_file(tmp_path, [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2)], tail)
    before, whole = path.read_text(), tail.startswith("{")
    assert len(read_records(path)) == 2 + whole
    RunLog(str(tmp_path), 3, 4, progress=False, tensorboard=False).close()
    assert path.read_text() == before + ("\n" if whole else "")


def test_a_damaged_line_before_the_last_is_still_an_error(tmp_path):
    path = records_file(tmp_path, [json.dumps({"step": 1, "loss": 1.0}), "{\"step\": 2, \"lo", "{}"], "")
    with pytest.raises(UserError, match="line 2 is not JSON"):
        read_records(path)


def test_a_resume_keeps_the_records_of_the_steps_it_does_not_compute_again(tmp_path):
    lines = [{"step": 0, "eval_loss": 5.0}, {"step": 1, "loss": 4.0}, {"step": 2, "loss": 3.0},
             {"step": 2, "eval_loss": 3.5}, {"step": 2, "event": "reset", "world_size": 1}, {"note": "no step"},
             {"step": 3, "loss": 2.0}, {"step": 4, "loss": 1.0}, {"step": 4, "eval_loss": 1.5},
             {"step": 4, "event": "reset", "world_size": 2}]
    path = records_file(tmp_path, [json.dumps(line) for line in lines], "")
    keep_records_up_to(path, 4)  # nothing to remove: the file is not rewritten
    assert path.read_text() == "".join(json.dumps(line) + "\n" for line in lines)
    inode = path.stat().st_ino
    keep_records_up_to(path, 2)
    assert path.read_text() == "".join(json.dumps(line) + "\n" for line in lines[:6] + lines[9:])
    assert path.stat().st_ino != inode and [p.name for p in tmp_path.iterdir()] == [FILE_NAME]  # renamed over it
    keep_records_up_to(path, 0)  # from the beginning: the baseline evaluation is computed again too
    assert path.read_text() == "".join(json.dumps(line) + "\n" for line in (lines[4], lines[5], lines[9]))


@pytest.mark.deep
@pytest.mark.workers
def test_a_resumed_run_shows_each_step_once(tmp_path, tiny_config):
    """Killed while writing the checkpoint of step 6 (every 3), the run resumes at step 3 and
    computes steps 4-6 again: metrics.jsonl and TensorBoard's events hold each step once, with
    the losses of an uninterrupted run, and nothing else of the log is lost."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = tiny_config({"train": {"max_steps": 8}, "checkpoint": {"every": 3, "keep": 3},
                          "eval": {"every": 2}, "log": {"tensorboard": True}})
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train_workers(2, config, f"out_dir={straight}")
    killed = horovodrun(2, [WORKERS / "die_during_checkpoint.py", config, f"out_dir={resumed}", "6"])
    assert killed.returncode != 0
    assert max(r["step"] for r in read_records(resumed / FILE_NAME)) == 6  # logged, then killed
    proc = train_workers(2, config, f"out_dir={resumed}")
    assert "resuming at step 3" in proc.stdout

    records = read_records(resumed / FILE_NAME)
    train_steps = [r["step"] for r in records if "loss" in r]
    eval_steps = [r["step"] for r in records if "eval_loss" in r]
    assert train_steps == list(range(1, 9)) and eval_steps == [0, 2, 4, 6, 8]
    assert_same_losses(step_losses(straight), step_losses(resumed), min_steps=8)
    evals = {s: [r["eval_loss"] for r in read_metrics(run)[1]] for s, run in (("straight", straight),
                                                                             ("resumed", resumed))}
    assert evals["resumed"] == pytest.approx(evals["straight"], rel=1e-5)

    events = EventAccumulator(str(resumed / "tensorboard"))
    events.Reload()
    for tag, steps in (("loss", range(1, 9)), ("eval_loss", [0, 2, 4, 6, 8])):
        scalars = events.Scalars(tag)
        assert [s.step for s in scalars] == list(steps), tag
    assert [s.value for s in events.Scalars("loss")] == pytest.approx(
        [r["loss"] for r in read_metrics(straight)[0]], rel=1e-5)


@pytest.mark.deep
@pytest.mark.workers
def test_a_resume_between_two_log_points_keeps_every_steps_loss(tmp_path, tiny_config):
    """log.every=4 with a checkpoint every 3: the checkpoint's step is a log point too, so a run
    resumed at step 3 has the losses of steps 1-3 (a record at step 4 would hold them, and it is
    one of the steps computed again)."""
    config = tiny_config({"train": {"max_steps": 8}, "checkpoint": {"every": 3, "keep": 3}, "log": {"every": 4}})
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train_workers(2, config, f"out_dir={straight}")
    assert horovodrun(2, [WORKERS / "die_during_checkpoint.py", config, f"out_dir={resumed}", "6"]).returncode != 0
    assert "resuming at step 3" in train_workers(2, config, f"out_dir={resumed}").stdout
    assert [r["step"] for r in read_records(resumed / FILE_NAME) if "loss" in r] == [3, 4, 6, 8]
    assert_same_losses(step_losses(straight), step_losses(resumed), min_steps=8)
