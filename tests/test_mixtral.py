"""The Mixtral family (a mixture of experts in each layer, top-k routed, dropless, with Switch
Transformer's load-balancing loss): its loss is transformers' own, the loss spreads the tokens,
np=2 equals np=1 through real horovodrun workers with the routing statistics logged, and the
exported folder is a MixtralForCausalLM with the trained model's logits. (FLOPs and parameter
counts: test_flops; the streamed export: test_export_streaming; bad input: test_errors.)"""
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from helpers import (assert_same_losses, assert_same_params, load_params, read_metrics, step_losses,
                     train_workers, two_stages_equal_one_worker)
from hvdtrain.config import ModelConfig
from hvdtrain.models.common import IGNORE_INDEX, Vocab, build_model, statistics_record, training_sums

VOCAB = Vocab(size=128, pad_id=0, bos_id=1, eos_id=2)


def tiny_mixtral(**model) -> torch.nn.Module:
    return build_model(ModelConfig(arch="mixtral", n_layer=2, n_head=2, n_kv_head=1, d_model=32, d_ff=32,
                                   experts=4, dropout=0.0, **model), VOCAB, 16)


def test_the_loss_is_transformers_token_loss_plus_the_router_losses():
    """training_sums per target token equals MixtralForCausalLM's own loss (mean cross-entropy
    plus router_aux_loss_coef x load_balancing_loss_func) plus router_z_loss_coef x ST-MoE's
    z-loss; the statistics count every token's k experts in every layer."""
    torch.manual_seed(0)
    model = tiny_mixtral(experts_per_token=2, router_aux_loss_coef=0.5, router_z_loss_coef=0.1)
    ids = torch.randint(3, 128, (2, 16))
    # hvdtrain's labels are aligned with the outputs (the collator shifts them); transformers shifts its own
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), IGNORE_INDEX)], dim=1)
    loss, statistics = training_sums(model, {"input_ids": ids, "labels": labels})
    theirs = model(input_ids=ids, labels=ids, output_router_logits=True)
    targets = 2 * 15
    z_loss = sum((torch.logsumexp(logits, dim=-1) ** 2).mean() for logits in theirs.router_logits) / 2
    torch.testing.assert_close(loss / targets, theirs.loss + 0.1 * z_loss, rtol=1e-5, atol=1e-6)
    record = statistics_record(model)(statistics.tolist(), targets)
    assert record["aux_loss"] == pytest.approx(0.5 * theirs.aux_loss.item(), rel=1e-5)
    assert record["z_loss"] == pytest.approx(0.1 * z_loss.item(), rel=1e-5)
    assert [sum(layer) for layer in record["expert_tokens"]] == [2 * 16 * 2] * 2  # tokens x k, per layer
    assert record["expert_load_max"] == max(record["expert_load"]) >= 1.0


@pytest.mark.parametrize("coefficient", [0.0, 1.0])
def test_the_load_balancing_loss_spreads_the_tokens(coefficient):
    """Routers that send every token to expert 0 (its row reads a feature every token has):
    with top-1 routing the token loss gives a router no gradient (the chosen expert's weight is
    1), so without the auxiliary loss all tokens stay on one expert (load 4.0 of 4); with it the
    busiest expert's share falls within 40 steps (to about half, measured)."""
    torch.manual_seed(0)
    model = tiny_mixtral(experts_per_token=1, router_aux_loss_coef=coefficient)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.mlp.gate.weight[0, 0] = 3.0
    record = statistics_record(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(0)
    loads = []
    for _ in range(40):
        ids = torch.randint(3, 128, (8, 16), generator=data)
        loss, statistics = training_sums(model, {"input_ids": ids, "labels": ids})
        (loss / ids.numel()).backward()
        optimizer.step()
        optimizer.zero_grad()
        loads.append(record(statistics.tolist(), ids.numel())["expert_load_max"])
    assert loads[0] == 4.0
    last = sum(loads[-10:]) / 10
    assert (last < 3.0) if coefficient else (last > 3.5), loads


def test_a_capacity_factor_skips_the_pairs_over_capacity_and_counts_them():
    """Capacity factor 1, top-2 of 4 experts, 32 tokens crowding onto expert 0: each expert
    takes at most 16 (token, expert) pairs, first choices before second ones, earlier tokens
    first. The dropped pairs are counted as an independent count in that order finds them, and
    the layer's output is the experts' with those pairs' weights zeroed; a large factor drops none."""
    torch.manual_seed(0)
    model = tiny_mixtral(experts_per_token=2, capacity_factor=1.0)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.mlp.gate.weight[0, 0] = 3.0
    logits = []  # each router's logits in the forward that dropped (near ties: not recomputed)
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda router, inputs, output: logits.append(output[0].detach()))
    ids = torch.randint(3, 128, (2, 16))
    loss, statistics = training_sums(model, {"input_ids": ids, "labels": ids})
    record = statistics_record(model)(statistics.tolist(), ids.numel())

    def over_capacity(layer_logits, capacity=16):
        chosen = layer_logits.topk(2, dim=-1).indices
        taken, dropped = [0] * 4, []
        for slot in range(2):
            for token in range(len(chosen)):
                expert = chosen[token, slot].item()
                taken[expert] += 1
                if taken[expert] > capacity:
                    dropped.append((token, slot))
        return dropped

    expected = [len(over_capacity(layer)) for layer in logits]
    assert record["expert_dropped"] == expected and expected[0] > 0
    assert record["expert_dropped_fraction"] == pytest.approx(sum(expected) / (2 * 32 * 2))

    block = model.model.layers[0].mlp
    x = torch.randn(32, 32) + model.model.embed_tokens.weight[5]
    logits.clear()
    with torch.no_grad():
        output = block(x.unsqueeze(0)).squeeze(0)
        weights, experts = torch.softmax(logits[0], dim=-1).topk(2, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        for token, slot in over_capacity(logits[0]):
            weights[token, slot] = 0.0
        torch.testing.assert_close(output, block.experts(x, experts, weights))
    roomy = tiny_mixtral(experts_per_token=2, capacity_factor=4.0)
    roomy.load_state_dict(model.state_dict())
    statistics = training_sums(roomy, {"input_ids": ids, "labels": ids})[1]
    assert statistics_record(roomy)(statistics.tolist(), ids.numel())["expert_dropped"] == [0, 0]


def test_a_pretrained_folder_takes_the_configured_router_settings(tmp_path):
    """model.pretrained: the folder's weights, with model.router_aux_loss_coef and the capacity
    factor applied (they are training settings, not the folder's shape); unset, the folder's
    coefficient stays and routing is dropless."""
    torch.manual_seed(0)
    saved = tiny_mixtral(experts_per_token=2, router_aux_loss_coef=0.1)
    # as hvdtrain exports it (save_pretrained writes the hub's layout: the next test)
    saved.config.save_pretrained(tmp_path / "folder")
    save_file(saved.state_dict(), tmp_path / "folder" / "model.safetensors")
    ids = torch.randint(3, 128, (2, 16))
    kept = build_model(ModelConfig(arch="mixtral", pretrained=str(tmp_path / "folder"), dropout=0.0), VOCAB, 16)
    crowded = build_model(ModelConfig(arch="mixtral", pretrained=str(tmp_path / "folder"), dropout=0.0,
                                      router_aux_loss_coef=0.3, capacity_factor=0.5), VOCAB, 16)
    assert (kept.config.router_aux_loss_coef, crowded.config.router_aux_loss_coef) == (0.1, 0.3)
    records = [statistics_record(model)(training_sums(model, {"input_ids": ids, "labels": ids})[1].tolist(),
                                        ids.numel()) for model in (kept, crowded)]
    assert "expert_dropped" not in records[0] and sum(records[1]["expert_dropped"]) > 0


def test_a_pretrained_folder_in_the_hub_layout_gives_the_saved_model_s_logits(tmp_path):
    """save_pretrained writes Mixtral as the hub holds it (each expert's w1, w2, w3 apart, the
    router as block_sparse_moe.gate); model.pretrained joins the pieces into the experts'
    tensors: the same logits as the saved model."""
    torch.manual_seed(0)
    saved = tiny_mixtral(experts_per_token=2).eval()
    saved.save_pretrained(tmp_path / "hub")
    with safe_open(str(tmp_path / "hub" / "model.safetensors"), framework="pt") as f:
        assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in f.keys()
    loaded = build_model(ModelConfig(arch="mixtral", pretrained=str(tmp_path / "hub"), dropout=0.0), VOCAB, 16).eval()
    ids = torch.randint(3, 128, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, saved(input_ids=ids).logits, rtol=0, atol=0)


@pytest.mark.workers
def test_two_workers_equal_one_worker_with_the_routing_logged(tmp_path, tiny_config):
    """Same global batch (4 x 2), top-2 of 4 experts, a large router loss and clipping active:
    per-step losses (the router loss included), the logged router loss and expert loads, and
    the final parameters agree; the export is a MixtralForCausalLM with the trained weights' logits."""
    config = tiny_config({"model": {"arch": "mixtral", "n_kv_head": 1, "experts": 4, "experts_per_token": 2,
                                    "d_ff": 32, "router_aux_loss_coef": 0.5},
                          "train": {"global_batch_size": 8, "max_steps": 8, "grad_clip": 0.5}})
    one, two = tmp_path / "np1", tmp_path / "np2"
    train_workers(1, config, f"out_dir={one}")
    train_workers(2, config, f"out_dir={two}")
    assert_same_losses(step_losses(one), step_losses(two), min_steps=8)
    records = [read_metrics(run)[0] for run in (one, two)]
    for a, b in zip(*records):
        assert a["aux_loss"] == pytest.approx(b["aux_loss"], rel=1e-5) and a["aux_loss"] > 0.4
        assert a["expert_tokens"] == b["expert_tokens"]
        assert [sum(layer) for layer in a["expert_tokens"]] == [8 * 16 * 2] * 2  # a step's tokens x k, per layer
    assert all(r["grad_norm"] > 0.5 for r in records[0])  # clipped
    assert_same_params(load_params(two, 0), load_params(two, 1))
    assert_same_params(load_params(one, 0), load_params(two, 0), atol=1e-5)

    exported = transformers.MixtralForCausalLM.from_pretrained(two / "hf").eval()
    trained = tiny_mixtral(experts_per_token=2)
    trained.load_state_dict({name: load_params(two, 0)[name] for name in trained.state_dict()})
    ids = torch.randint(3, 128, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, trained.eval()(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.workers
@pytest.mark.parametrize("bounds", [[0, 1, 2], [0, 2, 2], pytest.param([0, 0, 2], marks=pytest.mark.deep)])
def test_two_pipeline_stages_train_as_one_worker(tmp_path, tiny_config, bounds):
    """Two pipeline stages, each with one layer's router, or one with the head or the
    embeddings alone (it routes nothing: it passes the sums on, or sends zeros): the second receives the first's routing sums
    with the hidden states, the last computes the router losses from both layers and their
    gradients go back along the pipeline. The same per-step losses (router losses included),
    logged router loss and expert tokens, and weights, as one worker."""
    config = tiny_config({"model": {"arch": "mixtral", "n_kv_head": 1, "experts": 4, "experts_per_token": 2,
                                    "d_ff": 32, "router_aux_loss_coef": 0.5, "router_z_loss_coef": 0.1},
                          "train": {"micro_batch_size": 2, "global_batch_size": 8, "max_steps": 4, "lr": 1e-3}})
    one = two_stages_equal_one_worker(tmp_path, config, f"parallel.layer_boundaries={bounds}".replace(" ", ""))
    for a, b in zip(*(read_metrics(run)[0] for run in (one, tmp_path / "two"))):
        assert a["aux_loss"] == pytest.approx(b["aux_loss"], rel=1e-5) and a["aux_loss"] > 0.4
        assert a["z_loss"] == pytest.approx(b["z_loss"], rel=1e-5) and a["z_loss"] > 0
        assert a["expert_tokens"] == b["expert_tokens"]


@pytest.mark.workers
@pytest.mark.parametrize("shard", [pytest.param(level, marks=pytest.mark.deep) for level in ("full", "optimizer")])
def test_sharding_levels_train_like_plain_data_parallelism(tmp_path, tiny_config, shard):
    """The experts' 3D weights go through the sharded optimizer's slices (and, with "full",
    the gathered units) as any other parameter: the same losses and exported weights (with
    "full" the model object holds none after the run)."""
    from safetensors.torch import load_file
    config = tiny_config({"model": {"arch": "mixtral", "n_kv_head": 1, "d_ff": 32, "experts": 4,
                                    "experts_per_token": 2, "router_z_loss_coef": 0.01},
                          "train": {"global_batch_size": 8}})
    plain, sharded = tmp_path / "plain", tmp_path / "sharded"
    train_workers(2, config, f"out_dir={plain}")
    train_workers(2, config, f"out_dir={sharded}", f"parallel.shard={shard}")
    assert_same_losses(step_losses(plain), step_losses(sharded))
    assert_same_params(*(load_file(str(run / "hf" / "model.safetensors")) for run in (plain, sharded)), atol=1e-6)
