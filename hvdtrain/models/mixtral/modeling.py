"""Mixtral in transformers (MixtralForCausalLM): building it, its router's loss, its parts."""
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
    from transformers import MixtralConfig, MixtralForCausalLM

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
    return partial(MixtralForCausalLM, config)


def routing_loss(model, body_output, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(router losses x targets, [load-balancing loss, z-loss, the tokens each layer's router
    sent to each expert]) of one micro batch.

    The load-balancing loss is Switch Transformer's over every layer's router logits
    (transformers' load_balancing_loss_func: experts x the sum over experts of the share of
    routed tokens sent to it x its mean router probability; k, the experts per token, when the
    tokens spread evenly),
    times model.router_aux_loss_coef; the z-loss ST-MoE's (the squared log-sum-exp of each
    token's router logits, averaged over tokens and layers), times model.router_z_loss_coef.
    Both count once for each of the micro batch's `targets` (see models.common.training_sums)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    config = model.config
    experts, k = config.num_local_experts, config.num_experts_per_tok
    logits = body_output.router_logits  # a (tokens, experts) tensor per layer
    balance = config.router_aux_loss_coef * load_balancing_loss_func(logits, experts, k) * targets
    z_coef = getattr(config, "router_z_loss_coef", ROUTER_Z_LOSS_COEF)  # a folder saved elsewhere has none
    z = (z_coef * torch.stack([torch.logsumexp(layer.float(), dim=-1).square().mean() for layer in logits]).mean()
         * targets)
    with torch.no_grad():
        # the experts each token is sent to, as the router picks them (top-k of its logits)
        chosen = torch.stack([layer.topk(k, dim=-1).indices for layer in logits]).flatten(1)  # (layers, tokens x k)
        tokens = torch.zeros(len(logits), experts, device=chosen.device).scatter_add_(
            1, chosen, torch.ones(chosen.shape, device=chosen.device))
    return balance + z, torch.cat([balance.detach().float().reshape(1), z.detach().float().reshape(1), tokens.flatten()])


def routing_record(config, statistics: list[float], targets: float) -> dict:
    """The train record's entries of a log interval's routing in a model of transformers
    `config` (routing_loss's statistics summed over the interval's steps and the ranks; its
    targets): the load-balancing loss and the z-loss per target token (`aux_loss`, `z_loss`,
    both already part of `loss`), the tokens each layer's router sent to each expert
    (`expert_tokens`), and per layer the busiest expert's tokens over the mean (`expert_load`,
    1.0 when even) and the largest of those (`expert_load_max`)."""
    tokens = torch.tensor(statistics[2:]).reshape(-1, config.num_local_experts)
    load = (tokens.max(dim=1).values / tokens.mean(dim=1).clamp(min=1e-12)).tolist()
    return {"aux_loss": statistics[0] / max(targets, 1), "z_loss": statistics[1] / max(targets, 1),
            "expert_load_max": max(load), "expert_load": load,
            "expert_tokens": [[int(n) for n in layer] for layer in tokens.tolist()]}


# Llama's parts (the same module names and steps), and the body asked for its routers' logits
PARTS = ModelParts(**{**LLAMA_PARTS.__dict__, "body_options": {"output_router_logits": True},
                      "auxiliary_loss": routing_loss, "statistics_record": routing_record})
