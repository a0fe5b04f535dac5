"""Learning-rate schedule: linear warmup to the (world-size scaled) peak, then decay to a floor.

The rate is a pure function of the optimizer step (set on the param groups before each step,
as nanoGPT does), so the checkpoint needs only the step: a resumed run continues the curve
exactly, and a resume with another world size re-derives the peak for its size.
"""
import math

from hvdtrain.config import TrainConfig


def lr_multiplier(step: int, cfg: TrainConfig) -> float:
    """Fraction of the peak rate at optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    decay_steps = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    if cfg.schedule == "linear":
        shape = 1.0 - progress
    else:  # cosine
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape
