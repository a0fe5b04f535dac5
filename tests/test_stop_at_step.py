"""train.stop_at_step is a pause: a job in a time-limited allocation stops there with a
checkpoint, and the same command, submitted again, continues to train.max_steps."""
import pytest

from helpers import hvdtrain, read_metrics

pytestmark = pytest.mark.workers


def test_the_same_command_continues_after_the_pause(tmp_path, tiny_config):
    out = tmp_path / "run"
    command = ["train", tiny_config({"train": {"max_steps": 6}}), f"out_dir={out}", "train.stop_at_step=3"]
    first = hvdtrain(*command)
    assert first.returncode == 0, first.stderr[-2000:]
    assert [r["step"] for r in read_metrics(out)[0]] == [1, 2, 3]
    again = hvdtrain(*command)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming at step 3" in again.stdout
    assert [r["step"] for r in read_metrics(out)[0]] == [1, 2, 3, 4, 5, 6]
