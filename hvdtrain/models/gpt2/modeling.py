"""GPT-2 in transformers (GPT2LMHeadModel): building it, its blocks, its head, its stages."""
from functools import partial
from typing import Callable

import torch

from hvdtrain.config import ModelConfig
from hvdtrain.models import ModelParts, TensorPlan


def model_maker(cfg: ModelConfig, vocab, rows: int, positions: int, d_ff: int) -> Callable[[], torch.nn.Module]:
    """What builds a new GPT2LMHeadModel of `cfg`'s shape, with `rows` embedding rows (called by
    hvdtrain.models.model_build with the parameters on the meta device)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=rows, n_positions=positions, n_embd=cfg.d_model, n_layer=cfg.n_layer,
                        n_head=cfg.n_head, n_inner=d_ff, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
                        attn_pdrop=cfg.dropout, bos_token_id=vocab.bos_id, eos_token_id=vocab.eos_id,
                        # GPT-2's tanh GELU as one kernel: same values as "gelu_new", which
                        # runs as several small ops and keeps their outputs for backward
                        activation_function="gelu_pytorch_tanh")
    config._attn_implementation = "sdpa"
    return partial(GPT2LMHeadModel, config)


def _embed(stage, input_ids):
    # GPT2Model's own steps. No attention mask: the blocks then attend causally, as GPT2Model
    # does for unpadded blocks.
    t = stage.transformer
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    return t.drop(t.wte(input_ids) + t.wpe(positions))


def _final_norm(stage, hidden):
    return stage.transformer.ln_f(hidden)


PARTS = ModelParts(body="transformer", layers="transformer.h",
                   first_only=("transformer.wte", "transformer.wpe"),
                   last_only=("transformer.ln_f", "lm_head"), embed=_embed, final_norm=_final_norm,
                   # c_attn's outputs are query, key and value side by side, cut at attn.split_size
                   tensor_plan=TensorPlan({"attn.c_attn": "colwise", "attn.c_proj": "rowwise", "mlp.c_fc": "colwise",
                                           "mlp.c_proj": "rowwise"}, fused={"attn.c_attn": 3},
                                          conv1d=("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"),
                                          per_rank=("attn.split_size",)))
