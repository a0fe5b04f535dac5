"""Test worker: train as train_and_dump.py does, with parallel.shard (any level), and make one
value of rank 0's reduced gradient slices inf in step HVDTRAIN_TEST_INF_STEP (0-based): only
rank 0 sees it in its own slices, so the other ranks skip that step only if they agree. Every
rank then saves its parameters as train_and_dump.py does (a split weight: its slice)."""
import os
import sys
from pathlib import Path

import horovod.torch as hvd
from safetensors.torch import save_file

from hvdtrain.training import train as training
from hvdtrain.config import load_config
from hvdtrain.parallel.sharded_optimizer import ShardedOptimizer
from hvdtrain.parallel.tensor_parallel import local

inf_step = int(os.environ["HVDTRAIN_TEST_INF_STEP"])
current = {"step": -1}
real_lr_multiplier, real_reduce = training.lr_multiplier, ShardedOptimizer.reduce_gradients


def lr_multiplier(step, cfg):  # called once at the start of every step
    current["step"] = step
    return real_lr_multiplier(step, cfg)


def reduce_gradients(self):
    real_reduce(self)
    if current["step"] == inf_step and hvd.rank() == 0:
        self.slices[0].master.grad[0] = float("inf")


training.lr_multiplier, ShardedOptimizer.reduce_gradients = lr_multiplier, reduce_gradients
cfg = load_config(sys.argv[1], sys.argv[2:])
model = training.train(cfg)
state = {k: local(v).detach().contiguous().clone() for k, v in model.state_dict().items() if v.numel()}  # full: no weights
save_file(state, str(Path(cfg.out_dir) / f"params_rank{hvd.rank()}.safetensors"))
