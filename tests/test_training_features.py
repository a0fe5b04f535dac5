"""Training-loop features with real workers: mixed precision with clipping, uneven data,
evaluation, the run folder's outputs; and the zero_grad shim for Horovod's optimizer."""
import math

import pytest
import torch
import yaml

from helpers import read_metrics, step_losses, train_workers

pytestmark = pytest.mark.workers


@pytest.mark.parametrize("precision", ["fp16", pytest.param("bf16", marks=pytest.mark.deep)])
def test_mixed_precision_with_clipping_on_uneven_data(tmp_path, tiny_config, precision):
    """37 samples and a global batch of 8: epochs end mid-batch, every rank still runs every
    step (no deadlock, the run ends within the timeout)."""
    config = tiny_config({"train": {"precision": precision, "grad_clip": 0.5, "max_steps": 12, "lr": 3e-3},
                          "data": {"synthetic_samples": 37}, "eval": {"every": 4}, "log": {"tensorboard": True}})
    train_workers(2, config, f"out_dir={tmp_path}", timeout=240)
    losses = step_losses(tmp_path)
    assert sorted(losses) == list(range(1, 13))
    assert all(math.isfinite(v) for v in losses.values())
    assert losses[12] < losses[1]
    train, evals = read_metrics(tmp_path)
    assert [e["step"] for e in evals] == [0, 4, 8, 12]
    for key in ("step", "loss", "lr", "tokens_per_s", "world_size"):
        assert key in train[-1]
    assert train[-1]["world_size"] == 2
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["train"]["precision"] == precision and saved["resolved"]["global_batch"] == 8
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_each_gradient_s_allreduce_starts_in_the_step_s_last_backward():
    """distributed.GradientReduction (the reduction of tensor and expert parallelism, over a
    process set per parameter): nothing is sent in the first of a step's two backward passes,
    every gradient the second makes is in flight before wait(); wait() sends a weight no
    backward reached as zeros, and the gradients keep their sums (one rank: the average)."""
    import horovod.torch as hvd

    from hvdtrain.config import HorovodConfig
    from hvdtrain.parallel.distributed import GradientReduction

    hvd.init()
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 2), "unused": torch.nn.Linear(2, 2)})
    reduction = GradientReduction(model, lambda name: (hvd.global_process_set, 1), HorovodConfig(), 2)
    model["used"](torch.ones(1, 3)).sum().backward()
    assert not reduction.in_flight
    model["used"](torch.ones(1, 3)).sum().backward()
    assert set(reduction.in_flight) == {"used.weight", "used.bias"}
    reduction.wait()
    assert torch.equal(model["used"].weight.grad, torch.full((2, 3), 2.0))
    assert torch.equal(model["unused"].weight.grad, torch.zeros(2, 2))
    assert not reduction.in_flight and set(reduction.passes.values()) == {0}

    model.zero_grad()
    after = GradientReduction(model["used"], lambda name: (hvd.global_process_set, 1), HorovodConfig(), 1, during=False)
    model["used"](torch.ones(1, 3)).sum().backward()
    assert not after.in_flight  # parallel.reduce_gradients "after": nothing sent in backward
    after.wait()
    assert torch.equal(model["used"].weight.grad, torch.ones(2, 3))


def test_zero_grad_sets_gradients_to_none():
    """Horovod's DistributedOptimizer.zero_grad() takes no set_to_none argument."""
    import horovod.torch as hvd

    from hvdtrain.config import HorovodConfig
    from hvdtrain.parallel.distributed import wrap_optimizer, zero_grad

    hvd.init()
    model = torch.nn.Linear(3, 2)
    opt = wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, HorovodConfig(), 1)
    with pytest.raises(TypeError):
        opt.zero_grad(set_to_none=True)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    zero_grad(opt)
    assert all(p.grad is None for p in model.parameters())


def test_compiled_blocks_train_like_eager_with_two_workers(tmp_path, tiny_config):
    """model.compile compiles each transformer block (so Horovod's gradient hooks still fire
    during backward): same losses as eager to compiler rounding, identical ranks."""
    from helpers import load_params
    from helpers import assert_same_params
    config = tiny_config({"train": {"max_steps": 3}})
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    train_workers(2, config, f"out_dir={eager}")
    train_workers(2, config, f"out_dir={compiled}", "model.compile=true", timeout=400)
    a, b = step_losses(eager), step_losses(compiled)
    assert a.keys() == b.keys() == {1, 2, 3}
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-4)
    assert_same_params(load_params(compiled, 0), load_params(compiled, 1))
