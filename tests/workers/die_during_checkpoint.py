"""Test worker: like train_and_dump.py, but rank 0 kills itself with SIGKILL while writing the
checkpoint of step K (argv[-1]): after half of state.pt is on disk, before the rename."""
import os
import signal
import sys

import torch

from hvdtrain import checkpoint
from hvdtrain.config import load_config
from hvdtrain.train import train

kill_step = int(sys.argv[-1])
real_save = torch.save


def save_then_die(obj, path, *args, **kwargs):
    if isinstance(obj, dict) and obj.get("step") == kill_step:
        real_save(obj, path, *args, **kwargs)
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.truncate(size // 2)
        os.kill(os.getpid(), signal.SIGKILL)
    return real_save(obj, path, *args, **kwargs)


checkpoint.torch.save = save_then_die
train(load_config(sys.argv[1], sys.argv[2:-1]))
