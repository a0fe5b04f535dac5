"""fp16 with split weights (tests/test_tensor_parallel.py): each of t=2 ranks holds half the rows
of a column-wise Linear (a DTensor) and a whole bias; in step 2 only rank 1's slice finds inf.
Each step as the training loop does it: LocalGradScaler.unscale_, share_found_inf over the
group, NonFiniteGuard.scaler_step. Writes, per step, this rank's scaler state, whether its
parameters changed and the guard's streak to OUT/rankN.json.

    horovodrun -np 2 python tensor_fp16_skips.py OUT
"""
import json
import sys
from pathlib import Path

import horovod.torch as hvd
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from hvdtrain.parallel.tensor_parallel import LocalGradScaler, local, open_tensor_groups
from hvdtrain.training.run_guards import NonFiniteGuard, share_found_inf
from pipeline_step import FP16_SCALER


def main(out: Path, steps: int = 4, inf_step: int = 2):
    hvd.init(process_sets="dynamic")
    groups = open_tensor_groups(hvd.rank(), hvd.size(), 2, torch.device("cpu"))
    torch.manual_seed(0)
    linear = parallelize_module(torch.nn.Linear(3, 4, bias=False), groups.mesh, ColwiseParallel())
    bias = torch.nn.Parameter(torch.zeros(3))
    params = [linear.weight, bias]
    optimizer = torch.optim.SGD(params, lr=0.1)
    scaler = LocalGradScaler("cpu", **FP16_SCALER)
    guard = NonFiniteGuard(torch.device("cpu"), max_bad_steps=10)
    states = []
    for step in range(steps):
        scaler.scale(linear(torch.ones(1, 3)).sum() + bias.sum()).backward()
        if step == inf_step and groups.rank == 1:
            local(linear.weight.grad)[0, 0] = float("inf")
        before = [local(p).detach().clone() for p in params]
        scaler.unscale_(optimizer)
        share_found_inf(scaler, optimizer, groups.group)
        guard.scaler_step(scaler, optimizer)
        states.append({**scaler.state_dict(), "in_a_row": guard.in_a_row.item(),
                       "stepped": any(not torch.equal(b, local(p)) for b, p in zip(before, params))})
        optimizer.zero_grad()
    (out / f"rank{hvd.rank()}.json").write_text(json.dumps(states))
    groups.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
