"""Test worker: one experts module split over an expert group of 2 (expert_parallel.split_experts)
against the whole module, on each rank's own tokens, all of which choose rank 0's experts, so
rank 1 receives nothing: its backward must still take part in the group's alltoalls. Under
autocast (argv: float32 or bfloat16) the hidden states travel in its dtype. Prints one JSON line
per rank: the largest differences of the output, the input's gradient and this rank's experts'
gradients (summed over the ranks for the whole module) relative to their largest, the experts'
weights left without a gradient (rank 1's must have zeros), and the dtypes and names of the
alltoalls sent (bf16 as int16: its bits). Rank 0 runs one Horovod collective more than rank 1
before the exchange, as ranks with other process sets do: an unnamed alltoall, which Horovod
names by a count of the process's collectives, would then wait for a name the other never sends."""
import copy
import json
import sys

import horovod.torch as hvd
import torch
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from hvdtrain.parallel.expert_parallel import expert_grid, open_expert_groups, split_experts

dtype = getattr(torch, sys.argv[1])
sent_dtypes, names, alltoall = set(), set(), hvd.alltoall


def recorded_alltoall(tensor, **kw):
    sent_dtypes.add(str(tensor.dtype))
    names.add(kw.get("name"))
    return alltoall(tensor, **kw)


hvd.alltoall = recorded_alltoall  # what expert_parallel calls
hvd.init(process_sets="dynamic")
groups = open_expert_groups(expert_grid(hvd.size(), 2), hvd.rank())
torch.manual_seed(0)  # the same weights on every rank
whole = MixtralExperts(MixtralConfig(hidden_size=8, intermediate_size=16, num_local_experts=4))
for weight in whole.parameters():
    torch.nn.init.normal_(weight, std=0.3)
split = torch.nn.Sequential(copy.deepcopy(whole))
split_experts(split, lambda module: isinstance(module, MixtralExperts), groups)
if hvd.rank() == 0:  # Horovod: a collective rank 1 does not run, over the ranks holding rank 0's experts (rank 0)
    hvd.allreduce(torch.zeros(1), process_set=groups.same_experts_set)

torch.manual_seed(1 + hvd.rank())  # each rank its own tokens, every one choosing experts 0 and 1
tokens = torch.randn(6, 8)
index = torch.stack([torch.randint(0, 2, (6,)), torch.randint(0, 2, (6,))], dim=1)
weights = torch.rand(6, 2)
outputs, grads = [], []
for module in (whole, split[0]):
    hidden = tokens.clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        output = module(hidden, index, weights)
    output.float().square().sum().backward()
    outputs.append(output)
    grads.append(hidden.grad)
rows = slice(2 * groups.rank, 2 * groups.rank + 2)
expert_error, without_grad = 0.0, []
for name, weight in whole.named_parameters():
    summed = hvd.allreduce(weight.grad, op=hvd.Sum, name=name)[rows]  # Horovod: the group's tokens' gradients
    mine = getattr(split[0], name).grad
    if mine is None:  # its gradient hooks (the reductions that start from them) would not have run
        without_grad.append(name)
        mine = torch.zeros_like(summed)
    expert_error = max(expert_error, ((summed - mine).abs().max() / summed.abs().max().clamp(min=1e-12)).item())
print("RESULT " + json.dumps({"rank": hvd.rank(), "output": (outputs[0] - outputs[1]).abs().max().item(),
                              "input_grad": (grads[0] - grads[1]).abs().max().item(), "experts_grad": expert_error,
                              "without_grad": without_grad,
                              "received_nothing": groups.rank == 1, "sent": sorted(sent_dtypes),
                              "names": sorted(map(str, names))}), flush=True)
groups.close()
