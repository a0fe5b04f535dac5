"""Mixtral in transformers (MixtralForCausalLM): building it, its router's loss, its parts."""
import math
import re
from functools import partial
from typing import Callable

import torch

from hvdtrain.config import ModelConfig
from hvdtrain.models import ModelParts
from hvdtrain.models.llama import RMS_NORM_EPS, ROPE_THETA
from hvdtrain.models.llama.modeling import PARTS as LLAMA_PARTS
from hvdtrain.models.mixtral import (EXPERTS, EXPERTS_PER_TOKEN, ROUTER_AUX_LOSS_COEF, ROUTER_Z_LOSS_COEF,
                                      TIE_EMBEDDINGS)


def model_maker(cfg: ModelConfig, vocab, rows: int, positions: int, d_ff: int) -> Callable[[], torch.nn.Module]:
    """What builds a new MixtralForCausalLM of `cfg`'s shape, with `rows` embedding rows (called
    by hvdtrain.models.model_build with the parameters on the meta device). d_ff is each
    expert's SwiGLU width; model.dropout the attention dropout, as Llama's."""
    from transformers import MixtralConfig

    config = MixtralConfig(vocab_size=rows, hidden_size=cfg.d_model, intermediate_size=d_ff,
                           num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
                           num_key_value_heads=cfg.n_kv_head or cfg.n_head, max_position_embeddings=positions,
                           rope_theta=cfg.rope_theta or ROPE_THETA, rms_norm_eps=RMS_NORM_EPS,
                           attention_dropout=cfg.dropout, sliding_window=None,
                           num_local_experts=cfg.experts or EXPERTS,
                           num_experts_per_tok=cfg.experts_per_token or EXPERTS_PER_TOKEN,
                           router_aux_loss_coef=(ROUTER_AUX_LOSS_COEF if cfg.router_aux_loss_coef is None
                                                 else cfg.router_aux_loss_coef),
                           tie_word_embeddings=TIE_EMBEDDINGS if cfg.tie_embeddings is None else cfg.tie_embeddings,
                           bos_token_id=vocab.bos_id, eos_token_id=vocab.eos_id, pad_token_id=vocab.pad_id)
    # not a MixtralConfig key: kept with the model's config (and its config.json) as an extra one
    config.router_z_loss_coef = ROUTER_Z_LOSS_COEF if cfg.router_z_loss_coef is None else cfg.router_z_loss_coef
    config._attn_implementation = "sdpa"
    config.capacity_factor = cfg.capacity_factor  # not a MixtralConfig key either; None: dropless
    return partial(build_mixtral, config)


def build_mixtral(config) -> torch.nn.Module:
    """MixtralForCausalLM of `config`; with a capacity factor its routers drop what is over
    their experts' capacity (drop_over_capacity)."""
    from transformers import MixtralForCausalLM

    return with_capacity(MixtralForCausalLM(config), config.capacity_factor)


def pretrained_maker(cfg: ModelConfig, config, build: Callable[[], torch.nn.Module]) -> Callable[[], torch.nn.Module]:
    """model.pretrained's Mixtral (hvdtrain.models.common.pretrained_blueprint): the folder's
    shape, built by `build`; the router settings are training settings, so model.*'s are kept
    where set (the loss coefficients otherwise the folder's) and its capacity factor applied."""
    if cfg.router_aux_loss_coef is not None:
        config.router_aux_loss_coef = cfg.router_aux_loss_coef
    if cfg.router_z_loss_coef is not None:
        config.router_z_loss_coef = cfg.router_z_loss_coef
    config.capacity_factor = cfg.capacity_factor
    return lambda: with_capacity(build(), cfg.capacity_factor)


# A layer's router and experts, as hvdtrain (and transformers in memory) names them
MOE_TENSOR = re.compile(r"(.+\.layers\.\d+)\.mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)")


def saved_pieces(config, name: str):
    """Where a Mixtral folder in the hub's layout (Mixtral 8x7B's; transformers' save_pretrained
    writes it too) holds the tensor `name` (hvdtrain.models.model_build.load_part): the router
    as block_sparse_moe.gate, each expert e apart as block_sparse_moe.experts.e.w1 (gate), w3
    (up) and w2 (down). (The pieces' names, what joins them), or None for the other tensors:
    gate_up_proj stacks each expert's w1 and w3 one after the other (its forward's chunk(2)
    takes gate, then up), down_proj stacks the w2s."""
    found = MOE_TENSOR.fullmatch(name)
    if found is None:
        return None
    layer, tensor = found.groups()
    moe, experts = f"{layer}.block_sparse_moe", range(config.num_local_experts)
    if tensor == "gate.weight":
        return [f"{moe}.gate.weight"], lambda pieces: pieces[0]
    if tensor == "experts.down_proj":
        return [f"{moe}.experts.{e}.w2.weight" for e in experts], torch.stack
    return ([f"{moe}.experts.{e}.{w}.weight" for e in experts for w in ("w1", "w3")],
            lambda pieces: torch.stack([torch.cat(pieces[i:i + 2]) for i in range(0, len(pieces), 2)]))


def with_capacity(model: torch.nn.Module, capacity_factor: float | None) -> torch.nn.Module:
    """`model` whose routers drop the pairs over capacity_factor's capacity (None: dropless)."""
    if capacity_factor is not None:
        for module in model.modules():
            if isinstance(module, router_class()):
                module.register_forward_hook(partial(drop_over_capacity, capacity_factor))
    return model


def drop_over_capacity(capacity_factor: float, router, inputs, output):
    """A router's forward hook (MixtralTopKRouter's output: the logits, the weights and the
    experts of each token's top k): the (token, expert) pairs past their expert's capacity,
    ceil(capacity_factor x tokens x k / experts), get weight 0, so that the expert adds nothing
    to the token and gets no gradient from it (transformers' experts compute the pair all the
    same; split experts do not send it: hvdtrain.parallel.expert_parallel). First choices go
    before second ones, earlier tokens first (GShard's order). The count of dropped pairs is
    kept as router.dropped."""
    logits, weights, experts = output
    tokens, k = experts.shape
    capacity = math.ceil(capacity_factor * tokens * k / router.num_experts)
    queue = torch.nn.functional.one_hot(experts.t().reshape(-1), router.num_experts)  # first choices first
    place = (queue.cumsum(0) * queue).sum(1) - 1  # each pair's place in its expert's queue
    kept = (place < capacity).reshape(k, tokens).t()
    router.dropped = (~kept).sum().detach()
    return logits, weights * kept, experts


# A micro batch's routing, summed layer by layer (routing_sums) so that pipeline stages can add
# their layers' to what the stages before them sent (stage_routing), one vector of
#   E       each expert's router probabilities summed over the tokens and layers   (gradients)
#   1       the router logits' squared log-sum-exp summed over the tokens and layers (gradients)
#   L x E   the (token, expert) pairs each layer's router chose                   (counts)
#   L       the pairs each layer's capacity factor dropped (0: dropless)           (counts)
# of which routing_loss_of makes the losses and the statistics the run logs.

def routing_size(config) -> int:
    layers, experts = config.num_hidden_layers, config.num_local_experts
    return experts + 1 + layers * experts + layers


def has_capacity(config) -> bool:
    return getattr(config, "capacity_factor", None) is not None  # a folder saved elsewhere has none


def statistics_size(config) -> int:
    """The length of routing_loss_of's statistics (every pipeline stage sends as many)."""
    layers, experts = config.num_hidden_layers, config.num_local_experts
    return 2 + layers * experts + (layers if has_capacity(config) else 0)


def routing_sums(config, layers: list[tuple[int, torch.Tensor, torch.Tensor | None]],
                 carried: torch.Tensor | None = None) -> torch.Tensor:
    """`carried` (None: nothing yet) plus the routing of `layers`: (layer index, its router's
    logits (tokens, experts), the pairs its capacity factor dropped or None)."""
    experts, k = config.num_local_experts, config.num_experts_per_tok
    n_layers = config.num_hidden_layers
    device = layers[0][1].device
    probabilities = sum(torch.softmax(logits.float(), dim=-1).sum(dim=0) for _, logits, _ in layers)
    z = sum(torch.logsumexp(logits.float(), dim=-1).square().sum() for _, logits, _ in layers)
    with torch.no_grad():
        counts, dropped = torch.zeros(n_layers, experts, device=device), torch.zeros(n_layers, device=device)
        for index, logits, layer_dropped in layers:
            # the experts each token is sent to, as the router picks them (top-k of its logits)
            counts[index] = torch.bincount(logits.topk(k, dim=-1).indices.flatten(), minlength=experts).float()
            if layer_dropped is not None:
                dropped[index] = layer_dropped.float()
    added = torch.cat([probabilities, z.reshape(1), counts.flatten(), dropped])
    return added if carried is None else carried + added


def routing_loss_of(config, carried: torch.Tensor, tokens: int, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(router losses x targets, [load-balancing loss, z-loss, the tokens each layer's router
    sent to each expert, (with a capacity factor) the pairs each layer dropped]) of one micro
    batch of `tokens` tokens, from every layer's routing_sums (`carried`).

    The load-balancing loss is Switch Transformer's over every layer's router logits, as
    transformers' load_balancing_loss_func computes it: experts x the sum over experts of the
    share of the (token, layer) rows' choices sent to it x its mean router probability (k, the
    experts per token, when the tokens spread evenly), times model.router_aux_loss_coef; the
    z-loss ST-MoE's (the squared log-sum-exp of each token's router logits, averaged over tokens
    and layers), times model.router_z_loss_coef. Both count once for each of the micro batch's
    `targets` (see models.common.training_sums)."""
    experts, n_layers = config.num_local_experts, config.num_hidden_layers
    rows = n_layers * tokens
    probabilities, z_sum = carried[:experts], carried[experts]
    counts = carried[experts + 1:experts + 1 + n_layers * experts].detach()
    chosen = counts.view(n_layers, experts).sum(dim=0)
    balance = config.router_aux_loss_coef * experts * ((chosen / rows) * (probabilities / rows)).sum() * targets
    z_coef = getattr(config, "router_z_loss_coef", ROUTER_Z_LOSS_COEF)  # a folder saved elsewhere has none
    z = z_coef * z_sum / rows * targets
    statistics = [balance.detach().reshape(1), z.detach().reshape(1), counts]
    if has_capacity(config):  # the pairs each layer's router dropped (drop_over_capacity)
        statistics.append(carried[-n_layers:].detach())
    return balance + z, torch.cat(statistics)


def routing_loss(model, body_output, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """routing_loss_of the whole model's routers (their logits: the body's router_logits)."""
    routers = [m for m in model.modules() if isinstance(m, router_class())]
    layers = [(i, logits, getattr(router, "dropped", None))
              for i, (logits, router) in enumerate(zip(body_output.router_logits, routers))]
    return routing_loss_of(model.config, routing_sums(model.config, layers), layers[0][1].shape[0], targets)


def stage_routing(stage, layer_ids: range, carried: torch.Tensor | None, run_layers: Callable):
    """A pipeline stage's layers (hvdtrain.parallel.pipeline.StageModule), run by
    `run_layers()`, with their routers' routing_sums added to what the stage before sent
    (`carried`; None on the first stage): (hidden states, carried), which the next stage
    receives, and from which the last computes the router losses (routing_loss_of). Their
    gradients go back along the pipeline with the hidden states'."""
    seen = []
    handles = [stage.layers[str(i)].mlp.gate.register_forward_hook(
        lambda router, args, output, i=i: seen.append((i, output[0], router))) for i in layer_ids]
    try:
        hidden = run_layers()
    finally:
        for handle in handles:
            handle.remove()
    layers = [(i, logits, getattr(router, "dropped", None)) for i, logits, router in seen]
    if not layers:  # a stage of the embeddings or the head alone routes nothing: it passes the sums on
        return hidden, carried if carried is not None else torch.zeros(routing_size(stage.config), device=hidden.device)
    return hidden, routing_sums(stage.config, layers, carried)


def router_class() -> type:
    """transformers' Mixtral router (imported when first needed, as transformers everywhere here)."""
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    return MixtralTopKRouter


def routing_record(config, statistics: list[float], targets: float) -> dict:
    """The train record's entries of a log interval's routing in a model of transformers
    `config` (routing_loss's statistics summed over the interval's steps and the ranks; its
    targets): the load-balancing loss and the z-loss per target token (`aux_loss`, `z_loss`,
    both already part of `loss`), the tokens each layer's router sent to each expert
    (`expert_tokens`), and per layer the busiest expert's tokens over the mean (`expert_load`,
    1.0 when even) and the largest of those (`expert_load_max`)."""
    layers, experts = config.num_hidden_layers, config.num_local_experts
    tokens = torch.tensor(statistics[2:2 + layers * experts]).reshape(layers, experts)
    load = (tokens.max(dim=1).values / tokens.mean(dim=1).clamp(min=1e-12)).tolist()
    record = {"aux_loss": statistics[0] / max(targets, 1), "z_loss": statistics[1] / max(targets, 1),
              "expert_load_max": max(load), "expert_load": load,
              "expert_tokens": [[int(n) for n in layer] for layer in tokens.tolist()]}
    dropped = statistics[2 + layers * experts:]
    if dropped:  # a capacity factor: the pairs over capacity, per layer, and their share of all
        record["expert_dropped"] = [int(n) for n in dropped]
        record["expert_dropped_fraction"] = sum(dropped) / max(tokens.sum().item(), 1)
    return record


def is_experts(module: torch.nn.Module) -> bool:
    """One layer's experts: transformers' MixtralExperts (3-d weights, a row per expert)."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    return isinstance(module, MixtralExperts)


# Llama's parts (the same module names and steps), and the body asked for its routers' logits
PARTS = ModelParts(**{**LLAMA_PARTS.__dict__, "body_options": {"output_router_logits": True},
                      "auxiliary_loss": routing_loss, "statistics_record": routing_record, "is_experts": is_experts,
                      "stage_carry": stage_routing, "carried_loss": routing_loss_of,
                      "statistics_size": statistics_size, "tensor_plan": None})
