"""ModernBERT in transformers (ModernBertForMaskedLM): building it, its blocks, its head, its stages."""
from functools import partial
from typing import Callable

import torch

from hvdtrain.config import ModelConfig
from hvdtrain.models import ModelParts, TensorPlan
from hvdtrain.models.modernbert import GLOBAL_ATTN_EVERY, GLOBAL_ROPE_THETA, LOCAL_ATTENTION, LOCAL_ROPE_THETA


def model_maker(cfg: ModelConfig, vocab, rows: int, positions: int, d_ff: int) -> Callable[[], torch.nn.Module]:
    """What builds a new ModernBertForMaskedLM of `cfg`'s shape, with `rows` embedding rows (called
    by hvdtrain.models.model_build with the parameters on the meta device). model.dropout
    is its embedding, attention and MLP dropout."""
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    every = cfg.global_attn_every or GLOBAL_ATTN_EVERY
    config = ModernBertConfig(
        vocab_size=rows, hidden_size=cfg.d_model, intermediate_size=d_ff, num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, max_position_embeddings=positions,
        local_attention=cfg.local_attention or LOCAL_ATTENTION,
        layer_types=["full_attention" if i % every == 0 else "sliding_attention" for i in range(cfg.n_layer)],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": GLOBAL_ROPE_THETA},
                         "sliding_attention": {"rope_type": "default", "rope_theta": LOCAL_ROPE_THETA}},
        embedding_dropout=cfg.dropout, attention_dropout=cfg.dropout, mlp_dropout=cfg.dropout,
        pad_token_id=vocab.pad_id, cls_token_id=vocab.cls_id, sep_token_id=vocab.sep_id,
        bos_token_id=vocab.cls_id, eos_token_id=vocab.sep_id)
    config._attn_implementation = "sdpa"
    return partial(ModernBertForMaskedLM, config)


def _embed(stage, input_ids):
    return stage.model.embeddings(input_ids=input_ids)


def _layer_inputs(stage, hidden):
    # ModernBertModel's own steps, once per stage: for each kind of layer its attention mask
    # (none for global layers on unpadded blocks; the window for local ones) and its rotary
    # embedding (each kind has its own theta), from the stage's own rotary_emb.
    from transformers.masking_utils import create_bidirectional_mask, create_bidirectional_sliding_window_mask

    positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    masks = {"full_attention": create_bidirectional_mask(config=stage.config, inputs_embeds=hidden,
                                                          attention_mask=None),
             "sliding_attention": create_bidirectional_sliding_window_mask(config=stage.config, inputs_embeds=hidden,
                                                                           attention_mask=None)}
    kinds = {kind: {"attention_mask": masks[kind],
                    "position_embeddings": stage.model.rotary_emb(hidden, positions, kind)}
             for kind in set(stage.config.layer_types)}
    return lambda layer: kinds[layer.attention_type]


def _final_norm(stage, hidden):
    return stage.model.final_norm(hidden)


PARTS = ModelParts(body="model", masked_head="head", layers="model.layers", first_only=("model.embeddings",),
                   last_only=("model.final_norm", "head", "decoder"), embed=_embed, final_norm=_final_norm,
                   layer_inputs=_layer_inputs,
                   # Wqkv's outputs are query, key and value side by side; Wi's the input and the gate
                   tensor_plan=TensorPlan({"attn.Wqkv": "colwise", "attn.Wo": "rowwise", "mlp.Wi": "colwise",
                                           "mlp.Wo": "rowwise"}, fused={"attn.Wqkv": 3, "mlp.Wi": 2}))
