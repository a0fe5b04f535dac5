"""Test worker of an elastic job: `hvdtrain train` (elastic), with test-only switches, then
every rank saves its final parameters to OUT_DIR/params_rank{R}.safetensors.

    HVDTRAIN_TEST_KILL="HOST:STEP"        the worker on HOST (HOROVOD_HOSTNAME) SIGKILLs itself
                                          at the start of STEP (0-based)
    HVDTRAIN_TEST_ADD_HOST="STEP:FILE:LINE"  rank 0 appends LINE to the discovery file FILE at the
                                          start of STEP (a host becomes available)"""
import os
import signal
import sys
from pathlib import Path

import horovod.torch as hvd
from safetensors.torch import save_file

from hvdtrain.training import train as training
from hvdtrain.config import load_config
from hvdtrain.parallel.elastic import train_elastic

kill_host, _, kill_step = os.environ.get("HVDTRAIN_TEST_KILL", ":-1").rpartition(":")
add_step, add_file, add_line = (os.environ.get("HVDTRAIN_TEST_ADD_HOST", "-1::").split(":", 2) + ["", ""])[:3]
real_lr_multiplier = training.lr_multiplier


def lr_multiplier(step, cfg):  # called once at the start of every step
    if step == int(kill_step) and os.environ.get("HOROVOD_HOSTNAME") == kill_host:
        os.kill(os.getpid(), signal.SIGKILL)
    if step == int(add_step) and hvd.rank() == 0 and add_line not in Path(add_file).read_text():
        with open(add_file, "a") as f:
            f.write(add_line + "\n")
    return real_lr_multiplier(step, cfg)


training.lr_multiplier = lr_multiplier
cfg = load_config(sys.argv[1], sys.argv[2:])
model = train_elastic(cfg)
state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
save_file(state, str(Path(cfg.out_dir) / f"params_rank{hvd.rank()}.safetensors"))
