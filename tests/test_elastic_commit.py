"""The elastic commit without workers: it is held in host memory, shares nothing with the live
state, and a restore puts the committed values back on the parameters' device and dtype."""
from types import SimpleNamespace as World

import pytest
import torch

from hvdtrain.config import ModelConfig, TrainConfig
from hvdtrain.parallel.elastic import ElasticState
from hvdtrain.models.common import Vocab, build_model
from hvdtrain.optim.optimizers import build_optimizer
from hvdtrain.training.training_state import TrainingState

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU: on the CPU the live state is in host memory already"))]


def train_one_step(model, optimizer):
    model(input_ids=torch.randint(0, 64, (2, 8), device=model.device)).logits.sum().backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("device", DEVICES)
def test_the_commit_is_a_host_copy_and_restores_on_the_device(device):
    torch.manual_seed(0)
    model = build_model(ModelConfig(n_layer=1, d_model=16, n_head=2, dropout=0.0), Vocab(size=64, pad_id=0), 8)
    model.to(device)
    optimizer = build_optimizer(model, TrainConfig(), 1e-3, torch.device(device))
    train_one_step(model, optimizer)
    scaler = torch.amp.GradScaler(device, enabled=False)
    training = TrainingState(model, optimizer, scaler, World(rank=0, size=1), cfg=None)
    training.step = 1
    committed = ElasticState(training)
    saved = committed.saved["optimizer"]["state"]
    live = optimizer.state_dict()["state"]
    for index, values in saved.items():
        for key, value in values.items():
            assert value.device.type == "cpu", (index, key)
            assert value.untyped_storage().data_ptr() != live[index][key].untyped_storage().data_ptr()
    assert all(v.device.type == "cpu" for v in committed.saved["model"].values())
    expected_weights = {k: v.clone() for k, v in model.state_dict().items()}
    expected_state = {i: {k: v.clone() for k, v in values.items()} for i, values in live.items()}

    train_one_step(model, optimizer)  # the steps after the commit, lost with a worker
    training.step = 2
    committed.restore()
    assert training.step == 1
    for name, value in model.state_dict().items():
        assert value.device == expected_weights[name].device and torch.equal(value, expected_weights[name]), name
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, values in optimizer.state_dict()["state"].items():
        for key, value in values.items():
            assert torch.equal(value.cpu(), expected_state[index][key].cpu()), (index, key)
            if key != "step":  # torch keeps Adam's step count where it was saved
                assert (value.device, value.dtype) == (params[index].device, params[index].dtype), (index, key)
