"""metrics.jsonl records: the step breakdown names the slowest rank, and its pipeline stage."""
import numpy as np

from hvdtrain.metrics import PHASES, summarize_ranks


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
