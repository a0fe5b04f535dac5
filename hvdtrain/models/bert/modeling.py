"""BERT in transformers (BertForMaskedLM): building it, its blocks, its head, its stages."""
from functools import partial
from typing import Callable

import torch

from hvdtrain.config import ModelConfig
from hvdtrain.models import StageParts
from hvdtrain.models.common import IGNORE_INDEX


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


def blocks(model) -> torch.nn.ModuleList:
    return model.bert.encoder.layer


def body(model) -> torch.nn.Module:
    return model.bert


def head_inputs(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Only the masked positions go through the head (its transform and the projection): the
    other ~85% would be computed and thrown away."""
    hidden, labels = masked_positions(model.bert(input_ids=batch["input_ids"]).last_hidden_state, batch)
    return model.cls.predictions.transform(hidden), labels


def masked_positions(hidden: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The (targets, d_model) hidden states of a masked LM's labelled positions and their
    labels. When the batch carries `num_targets` (a Python int, as the collator makes it),
    they are picked without the device-to-host copy that sizing `hidden[mask]` costs."""
    hidden, labels = hidden.flatten(0, 1), batch["labels"].flatten()
    picked = labels != IGNORE_INDEX
    index = None
    if isinstance(batch.get("num_targets"), int):
        try:
            index = torch.nonzero_static(picked, size=batch["num_targets"]).squeeze(1)
        except NotImplementedError:  # a device without the operator: the mask, with its copy
            index = None
    if index is not None:
        hidden, labels = hidden.index_select(0, index), labels.index_select(0, index)
    else:
        hidden, labels = hidden[picked], labels[picked]
    return hidden, labels


def _embed(stage, input_ids):
    # Packed BERT blocks have no padding, so no attention mask: full attention, as BertModel.
    return stage.bert.embeddings(input_ids=input_ids)


def _final_norm(stage, hidden):
    return hidden  # BERT's layers end with their own LayerNorm


def _head_logits(stage, hidden, labels):
    picked = labels != IGNORE_INDEX  # the vocabulary projection on masked positions only
    return stage.cls(hidden[picked]), labels[picked]


STAGE = StageParts(layers="bert.encoder.layer", first_only=("bert.embeddings",), last_only=("cls",),
                   embed=_embed, final_norm=_final_norm, head_logits=_head_logits)
