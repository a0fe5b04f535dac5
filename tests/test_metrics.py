"""metrics.jsonl records: the step breakdown names the slowest rank, and its pipeline stage; a
line a kill cut short is neither read nor appended to."""
import json
from pathlib import Path

import numpy as np
import pytest

from hvdtrain.errors import UserError
from hvdtrain.metrics import FILE_NAME, PHASES, read_metrics, read_records, summarize_ranks
from hvdtrain.run_log import RunLog


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
