"""The two model families, built with Hugging Face transformers, and the training loss.

GPT-2 (causal LM) and BERT (masked LM) are built from the config for training from scratch,
or loaded from `model.pretrained` to continue pretraining. Attention goes through PyTorch's
scaled_dot_product_attention. The training loop takes the logits and sums the token losses
itself, so it can normalise by the number of targets in the whole optimizer step.
"""
from dataclasses import dataclass

import torch

from hvdtrain.config import ModelConfig
from hvdtrain.errors import UserError

IGNORE_INDEX = -100  # label of positions that are not predicted (the convention of transformers)
# The embedding / output matrix gets a multiple of 64 rows (nanoGPT's 50257 -> 50304): tensor
# cores are much faster on such shapes. Rows past the tokenizer's size are never targets.
VOCAB_MULTIPLE = 64


@dataclass
class Vocab:
    """What a model needs to know of the tokenizer."""
    size: int
    pad_id: int
    bos_id: int | None = None
    eos_id: int | None = None
    cls_id: int | None = None
    sep_id: int | None = None
    mask_id: int | None = None

    @property
    def special_ids(self) -> list[int]:
        return sorted({i for i in (self.pad_id, self.bos_id, self.eos_id, self.cls_id, self.sep_id, self.mask_id)
                       if i is not None})


def build_model(cfg: ModelConfig, vocab: Vocab, seq_len: int) -> torch.nn.Module:
    if cfg.pretrained:
        return load_pretrained(cfg, seq_len)
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

    positions = cfg.max_position or seq_len
    d_ff = cfg.d_ff or 4 * cfg.d_model
    rows = -(-vocab.size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    if cfg.arch == "gpt2":
        config = GPT2Config(vocab_size=rows, n_positions=positions, n_embd=cfg.d_model, n_layer=cfg.n_layer,
                            n_head=cfg.n_head, n_inner=d_ff, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
                            attn_pdrop=cfg.dropout, bos_token_id=vocab.bos_id, eos_token_id=vocab.eos_id,
                            # GPT-2's tanh GELU as one kernel: same values as "gelu_new", which
                            # runs as several small ops and keeps their outputs for backward
                            activation_function="gelu_pytorch_tanh")
        config._attn_implementation = "sdpa"
        return GPT2LMHeadModel(config)
    config = BertConfig(vocab_size=rows, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layer,
                        num_attention_heads=cfg.n_head, intermediate_size=d_ff, hidden_dropout_prob=cfg.dropout,
                        attention_probs_dropout_prob=cfg.dropout, max_position_embeddings=positions,
                        pad_token_id=vocab.pad_id)
    config._attn_implementation = "sdpa"
    return BertForMaskedLM(config)


def load_pretrained(cfg: ModelConfig, seq_len: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    auto = AutoModelForCausalLM if cfg.arch == "gpt2" else AutoModelForMaskedLM
    try:
        # Weights from safetensors only: a pickled pytorch_model.bin can run code when loaded.
        model = auto.from_pretrained(cfg.pretrained, attn_implementation="sdpa", use_safetensors=True)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"model.pretrained '{cfg.pretrained}': could not load ({first})") from None
    positions = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    if positions is not None and positions < seq_len:
        raise UserError(f"model.pretrained '{cfg.pretrained}' has {positions} positions, fewer than "
                        f"data.seq_len={seq_len} (train the first phase with model.max_position={seq_len})")
    return model


def transformer_blocks(model) -> torch.nn.ModuleList:
    """The repeated layers: the unit for torch.compile and activation checkpointing."""
    if hasattr(model, "transformer"):
        return model.transformer.h
    return model.bert.encoder.layer


def prepare(model, cfg: ModelConfig):
    """Optional speed-ups applied after the model is on its device."""
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.compile:
        # Per block, not the whole model: a whole-model compiled backward hands gradients to
        # Horovod's hooks only at its end, which serialises allreduce after backward.
        for block in transformer_blocks(model):
            block.compile()


def logits_and_labels(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (positions, vocab) logits and their labels, for a summed cross-entropy.

    Labels are already aligned with the logits (the collator shifts GPT labels), so GPT and
    BERT share the loss. For BERT only the masked positions go through the vocabulary
    projection: the other ~85% of logits would be computed and thrown away."""
    labels = batch["labels"]
    if hasattr(model, "bert"):
        hidden = model.bert(input_ids=batch["input_ids"]).last_hidden_state
        picked = labels != IGNORE_INDEX
        return model.cls(hidden[picked]), labels[picked]
    logits = model(input_ids=batch["input_ids"]).logits
    return logits.flatten(0, 1), labels.flatten()
