"""fp16 with split layers (tests/test_tensor_parallel.py): t=2 ranks hold a column-wise Linear's
rows and a row-wise Linear's columns (DTensors; its bias a whole DTensor) and a plain scale
vector; in step 2 only rank 1's slice finds inf. Each step goes through the training loop's
engine (step_engine.TensorParallelStep: clip_gradients unscales with LocalGradScaler,
optimizer_step shares the flag over the group and steps through the grad scaler) with
hvdtrain's AdamW built as on a GPU: fused, whose kernel refuses one list of DTensor and plain
tensors (torch has it for CPU tensors too). Writes, per step, this rank's scaler state, whether
its parameters changed and the guard's streak to OUT/rankN.json.

    horovodrun -np 2 python tensor_fp16_skips.py OUT
"""
import json
import sys
from pathlib import Path

import horovod.torch as hvd
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from hvdtrain.config import HorovodConfig, TrainConfig
from hvdtrain.optim.optimizers import build_optimizer
from hvdtrain.parallel.tensor_parallel import LocalGradScaler, local, open_tensor_groups
from hvdtrain.training.run_guards import NonFiniteGuard
from hvdtrain.training.step_engine import TensorParallelStep
from pipeline_step import FP16_SCALER


class UpDown(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(3, 4, bias=False), torch.nn.Linear(4, 3)
        self.scale = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.down(self.up(x)) * self.scale


def main(out: Path, steps: int = 4, inf_step: int = 2):
    hvd.init(process_sets="dynamic")
    cpu = torch.device("cpu")
    groups = open_tensor_groups(hvd.rank(), hvd.size(), 2, cpu)
    torch.manual_seed(0)
    model = parallelize_module(UpDown(), groups.mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    optimizer = build_optimizer(model, TrainConfig(), 0.1, torch.device("cuda"))  # "cuda": the fused AdamW
    scaler = LocalGradScaler("cpu", **FP16_SCALER)
    engine = TensorParallelStep(model, optimizer, scaler, None, None, cpu, groups=groups, horovod=HorovodConfig(),
                                grad_accum=1, reduce_after=False)
    guard = NonFiniteGuard(cpu, max_bad_steps=10)
    states = []
    for step in range(steps):
        scaler.scale(model(torch.ones(1, 3)).sum()).backward()
        engine.reduce_gradients()  # over the copies: one here (2 workers, t=2)
        if step == inf_step and groups.rank == 1:
            local(model.up.weight.grad)[0, 0] = float("inf")
        before = [local(p).detach().clone() for p in model.parameters()]
        engine.optimizer_step(guard, engine.clip_gradients(max_norm=1e9))
        states.append({**scaler.state_dict(), "in_a_row": guard.in_a_row.item(),
                       "stepped": any(not torch.equal(b, local(p)) for b, p in zip(before, model.parameters()))})
    (out / f"rank{hvd.rank()}.json").write_text(json.dumps(states))
    engine.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
