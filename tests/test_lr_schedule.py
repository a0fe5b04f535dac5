import math

import pytest

from hvdtrain.config import TrainConfig
from hvdtrain.parallel.distributed import lr_scale
from hvdtrain.optim.lr_schedule import lr_multiplier


def test_warmup_then_cosine_to_the_floor():
    cfg = TrainConfig(warmup_steps=4, max_steps=14, schedule="cosine", min_lr_ratio=0.1)
    assert [lr_multiplier(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_multiplier(4, cfg) == pytest.approx(1.0)
    assert lr_multiplier(9, cfg) == pytest.approx(0.55)  # halfway: floor + half the span
    assert lr_multiplier(14, cfg) == pytest.approx(0.1)
    assert lr_multiplier(100, cfg) == pytest.approx(0.1)


def test_linear_and_constant():
    lin = TrainConfig(warmup_steps=0, max_steps=10, schedule="linear", min_lr_ratio=0.0)
    assert lr_multiplier(5, lin) == pytest.approx(0.5)
    const = TrainConfig(warmup_steps=2, max_steps=10, schedule="constant")
    assert lr_multiplier(7, const) == 1.0


def test_world_size_scaling_rules():
    assert lr_scale("none", 8) == 1.0
    assert lr_scale("linear", 8) == 8.0
    assert lr_scale("sqrt", 8) == pytest.approx(math.sqrt(8))
