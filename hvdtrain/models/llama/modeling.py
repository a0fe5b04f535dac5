"""Llama in transformers (LlamaForCausalLM): building it, its blocks, its head, its stages."""
from functools import partial
from typing import Callable

import torch

from hvdtrain.config import ModelConfig
from hvdtrain.models import ModelParts, TensorPlan
from hvdtrain.models.llama import RMS_NORM_EPS, ROPE_THETA, TIE_EMBEDDINGS


def model_maker(cfg: ModelConfig, vocab, rows: int, positions: int, d_ff: int) -> Callable[[], torch.nn.Module]:
    """What builds a new LlamaForCausalLM of `cfg`'s shape, with `rows` embedding rows (called
    by hvdtrain.models.model_build with the parameters on the meta device). Llama has no
    residual or embedding dropout: model.dropout is its attention dropout."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=rows, hidden_size=cfg.d_model, intermediate_size=d_ff,
                         num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
                         num_key_value_heads=cfg.n_kv_head or cfg.n_head, max_position_embeddings=positions,
                         rope_theta=cfg.rope_theta or ROPE_THETA, rms_norm_eps=RMS_NORM_EPS,
                         attention_dropout=cfg.dropout,
                         tie_word_embeddings=TIE_EMBEDDINGS if cfg.tie_embeddings is None else cfg.tie_embeddings,
                         bos_token_id=vocab.bos_id, eos_token_id=vocab.eos_id, pad_token_id=vocab.pad_id)
    config._attn_implementation = "sdpa"
    return partial(LlamaForCausalLM, config)


def _embed(stage, input_ids):
    return stage.model.embed_tokens(input_ids)


def _layer_inputs(stage, hidden):
    # LlamaModel's own steps: the rotary cos/sin of positions 0..T-1, computed once per stage
    # by the stage's own rotary_emb (kept on every stage: it has no parameters). No attention
    # mask: the layers then attend causally, as LlamaModel does for unpadded blocks.
    positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    inputs = {"position_embeddings": stage.model.rotary_emb(hidden, positions)}
    return lambda layer: inputs  # the same for every layer


def _final_norm(stage, hidden):
    return stage.model.norm(hidden)


PARTS = ModelParts(body="model", layers="model.layers", first_only=("model.embed_tokens",),
                   last_only=("model.norm", "lm_head"), embed=_embed, final_norm=_final_norm,
                   layer_inputs=_layer_inputs,
                   tensor_plan=TensorPlan({"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise",
                                           "self_attn.v_proj": "colwise", "self_attn.o_proj": "rowwise",
                                           "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
                                           "mlp.down_proj": "rowwise"}))
