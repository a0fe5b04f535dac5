"""BERT in transformers (BertForMaskedLM): building it, its blocks, its head, its stages."""
from functools import partial
from typing import Callable

import torch

from hvdtrain.config import ModelConfig
from hvdtrain.models import ModelParts, TensorPlan


def model_maker(cfg: ModelConfig, vocab, rows: int, positions: int, d_ff: int) -> Callable[[], torch.nn.Module]:
    """What builds a new BertForMaskedLM of `cfg`'s shape, with `rows` embedding rows (called by
    hvdtrain.models.model_build with the parameters on the meta device)."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=rows, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layer,
                        num_attention_heads=cfg.n_head, intermediate_size=d_ff, hidden_dropout_prob=cfg.dropout,
                        attention_probs_dropout_prob=cfg.dropout, max_position_embeddings=positions,
                        pad_token_id=vocab.pad_id)
    config._attn_implementation = "sdpa"
    return partial(BertForMaskedLM, config)


def _embed(stage, input_ids):
    # Packed BERT blocks have no padding, so no attention mask: full attention, as BertModel.
    return stage.bert.embeddings(input_ids=input_ids)


def _final_norm(stage, hidden):
    return hidden  # BERT's layers end with their own LayerNorm


PARTS = ModelParts(body="bert", masked_head="cls.predictions.transform", layers="bert.encoder.layer",
                   first_only=("bert.embeddings",), last_only=("cls",), embed=_embed, final_norm=_final_norm,
                   tensor_plan=TensorPlan({"attention.self.query": "colwise", "attention.self.key": "colwise",
                                           "attention.self.value": "colwise", "attention.output.dense": "rowwise",
                                           "intermediate.dense": "colwise", "output.dense": "rowwise"}))
