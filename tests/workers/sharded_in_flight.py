"""Test worker: with parallel.shard=gradients a backward that outruns its reduce-scatters waits
for the oldest, so that no more than `in_flight_limit` bytes of full gradients (one fusion
buffer's worth: horovod.fusion_threshold_mb) are ever alive beside their slices. Rank 1 is
slow: every layer's backward waits 0.2 s there, so rank 0's reduce-scatters cannot finish
before rank 1 reaches them. Two models, one under a 0.5 MiB limit and one under 1 GiB, record
the bytes in flight after each gradient's reduce-scatter started. Prints one JSON line per
rank. argv: CONFIG."""
import json
import sys

import horovod.torch as hvd
import torch

from hvdtrain.config import load_config
from hvdtrain.parallel.sharded_optimizer import ShardedOptimizer
from slow_backward import SlowBackward  # beside this file


class SlowLayers(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = SlowBackward.apply(layer(x), 0.2 if hvd.rank() == 1 else 0.0)
        return x


def most_in_flight(limit_mb: float) -> tuple[int, int]:
    """(the most bytes in flight seen, the limit) over one backward of 8 layers of 256 KiB."""
    cfg = load_config(sys.argv[1], [f"horovod.fusion_threshold_mb={limit_mb}"])
    torch.manual_seed(0)
    model = SlowLayers(8)
    optimizer = ShardedOptimizer(model, cfg.train, 1e-3, torch.device("cpu"), cfg.horovod, backward_passes=1,
                                 rank=hvd.rank(), size=hvd.size(), level="gradients")
    seen = []
    for p in model.parameters():  # after the optimizer's own hook, which started the reduce-scatter
        p.register_post_accumulate_grad_hook(lambda _: seen.append(optimizer.in_flight_bytes))
    model(torch.randn(4, 256)).square().mean().backward()
    optimizer.reduce_gradients()
    return max(seen), optimizer.in_flight_limit


hvd.init()
limited, limit = most_in_flight(0.5)
unlimited, _ = most_in_flight(1024)
print("RESULT " + json.dumps({"rank": hvd.rank(), "limited": limited, "limit": limit, "unlimited": unlimited}),
      flush=True)
