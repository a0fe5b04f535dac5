"""Test worker: a ShardedOptimizer over the workers frees each parameter's full gradient as soon
as its reduce-scatter is done, while backward goes on. The first layer's backward waits 1 s, so
the later layers' reduce-scatters finish meanwhile; right after backward, before
reduce_gradients, their full gradients must be gone and their reduced slices taken. Prints one
JSON line per rank. argv: CONFIG DTYPE (float32 or bfloat16)."""
import json
import sys

import horovod.torch as hvd
import torch

from hvdtrain.config import load_config
from hvdtrain.parallel.sharded_optimizer import ShardedOptimizer
from slow_backward import SlowBackward  # beside this file


hvd.init()
cfg = load_config(sys.argv[1], [])
dtype = getattr(torch, sys.argv[2])
torch.manual_seed(0)
first, later = torch.nn.Linear(64, 64), torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
model = torch.nn.Sequential(first, later)
optimizer = ShardedOptimizer(model, cfg.train, 1e-3, torch.device("cpu"), cfg.horovod, backward_passes=1,
                             rank=hvd.rank(), size=hvd.size(), compute_dtype=dtype)
loss = later(SlowBackward.apply(first(torch.randn(8, 64, dtype=dtype)), 1.0)).float().square().mean()
loss.backward()
later_slices = [optimizer.by_param[id(p)] for p in later.parameters()]
freed = all(s.param.grad is None and s.main_grad is None for s in later_slices)
taken = all(s.master.grad is not None for s in later_slices)
optimizer.reduce_gradients()
complete = all(s.master.grad is not None and s.param.grad is None and s.main_grad is None for s in optimizer.slices)
print("RESULT " + json.dumps({"rank": hvd.rank(), "freed": freed, "taken": taken, "complete": complete}), flush=True)
