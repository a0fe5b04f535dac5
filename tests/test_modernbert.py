"""The ModernBERT family through the real training loop (horovodrun, Gloo, fp32, no dropout) in
what its tests elsewhere do not cover: bf16 and fp16, and continued pretraining from a local
Hugging Face ModernBERT folder, also in pipeline stages. (exact resume: test_resume; per-block
compile and activation checkpointing: test_llama; np=2 = np=1: test_equivalence; stages:
test_pipeline_training; FLOPs with the local window: test_flops; export, fill-mask and
transformers' pipeline: test_recipes.)"""
import math

import pytest
import torch

from helpers import (assert_same_params, load_params, read_metrics, step_losses, train_workers,
                     two_stages_equal_one_worker)

pytestmark = pytest.mark.workers

# the second layer attends to 8 of the 16 positions
MODERNBERT = {"model": {"arch": "modernbert", "local_attention": 8}}


@pytest.mark.parametrize("precision", ["bf16", pytest.param("fp16", marks=pytest.mark.deep)])
def test_mixed_precision_follows_fp32(tmp_path, tiny_config, precision):
    """bf16 / fp16 autocast (fp16 with its loss scaler): finite losses that follow fp32's to
    16-bit rounding (random synthetic tokens leave a masked LM little to learn in 8 steps, so
    it is compared, not asked to improve)."""
    config = tiny_config({**MODERNBERT, "train": {"max_steps": 8, "lr": 3e-3}})
    fp32, bf16 = tmp_path / "fp32", tmp_path / precision
    train_workers(2, config, f"out_dir={fp32}")
    train_workers(2, config, f"out_dir={bf16}", f"train.precision={precision}")
    reference, losses = step_losses(fp32), step_losses(bf16)
    assert sorted(losses) == list(range(1, 9)) and all(math.isfinite(v) for v in losses.values())
    for step, loss in losses.items():
        assert loss == pytest.approx(reference[step], rel=2e-2), step
    assert_same_params(load_params(bf16, 0), load_params(bf16, 1))


@pytest.mark.deep
def test_continued_pretraining_from_a_local_folder_also_in_two_stages(tmp_path, tiny_config):
    """model.pretrained: a folder transformers saved (no hvdtrain involved), with the synthetic
    data's 128 tokens (ids 2, 3, 4 are [CLS], [SEP], [MASK] there). Training starts from its
    weights, and two pipeline stages equal one worker."""
    from transformers import ModernBertConfig, ModernBertForMaskedLM
    folder = tmp_path / "pretrained"
    torch.manual_seed(3)
    ModernBertForMaskedLM(ModernBertConfig(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2,
        max_position_embeddings=16, local_attention=8, pad_token_id=0, cls_token_id=2, sep_token_id=3,
        bos_token_id=2, eos_token_id=3)).save_pretrained(folder, safe_serialization=True)
    config = tiny_config({"model": {"arch": "modernbert", "pretrained": str(folder)},
                          "train": {"micro_batch_size": 2, "global_batch_size": 8, "max_steps": 3, "lr": 1e-3},
                          "eval": {"every": 3}})
    one = two_stages_equal_one_worker(tmp_path, config)
    start = ModernBertForMaskedLM.from_pretrained(folder).state_dict()
    assert abs(read_metrics(one)[1][0]["eval_loss"] - math.log(128)) < 0.5  # the folder's random model
    moved = load_params(one, 0)["model.layers.1.mlp.Wi.weight"] - start["model.layers.1.mlp.Wi.weight"]
    assert 0 < moved.abs().max() < 0.01
