"""Test worker: like train_and_dump.py, but rank 0 kills itself with SIGKILL while writing the
checkpoint of step K (argv[-1]): after half of optimizer.safetensors is on disk, before the
manifest and the rename."""
import os
import signal
import sys

from hvdtrain.checkpointing import checkpoint
from hvdtrain.config import load_config
from hvdtrain.training.train import train

kill_step = f"step_{int(sys.argv[-1]):08d}"
real_save_file = checkpoint.save_file


def save_then_die(tensors, path, *args, **kwargs):
    real_save_file(tensors, path, *args, **kwargs)
    if kill_step in path and path.endswith(checkpoint.OPTIMIZER_FILE):
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.truncate(size // 2)
        os.kill(os.getpid(), signal.SIGKILL)


checkpoint.save_file = save_then_die
train(load_config(sys.argv[1], sys.argv[2:-1]))
