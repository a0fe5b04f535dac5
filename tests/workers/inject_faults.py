"""Test worker: `hvdtrain train CONFIG [overrides]` with faults injected at chosen steps.

    HVDTRAIN_TEST_SIGNAL="RANK:STEP"   that rank sends itself SIGUSR1 at the start of STEP
    HVDTRAIN_TEST_NAN_STEPS="3,4"      every rank's training loss turns NaN in those steps (0-based)

Exits with the code `hvdtrain train` would."""
import os
import signal
import sys

import horovod.torch as hvd

from hvdtrain import cli
from hvdtrain.training import step_engine
from hvdtrain.training import train as training

signal_rank, signal_step = map(int, os.environ.get("HVDTRAIN_TEST_SIGNAL", "-1:-1").split(":"))
nan_steps = {int(s) for s in os.environ.get("HVDTRAIN_TEST_NAN_STEPS", "").split(",") if s}
current = {"step": -1}
real_lr_multiplier, real_training_sums = training.lr_multiplier, step_engine.training_sums


def lr_multiplier(step, cfg):  # called once at the start of every step
    current["step"] = step
    if step == signal_step and hvd.rank() == signal_rank:
        os.kill(os.getpid(), signal.SIGUSR1)
    return real_lr_multiplier(step, cfg)


def training_sums(model, batch):
    loss, statistics = real_training_sums(model, batch)
    return (loss * float("nan") if current["step"] in nan_steps else loss), statistics


training.lr_multiplier, step_engine.training_sums = lr_multiplier, training_sums
sys.exit(cli.main(["train", *sys.argv[1:]]))
