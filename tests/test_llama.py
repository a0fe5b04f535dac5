"""The Llama family through the real training loop (horovodrun, Gloo, fp32, no dropout) in what its
own tests elsewhere do not cover: per-block compile and activation checkpointing, fp16/bf16, and
continued pretraining from a local Hugging Face Llama folder, also in pipeline stages. (exact
resume: test_resume; np=2 = np=1: test_equivalence; stages: test_pipeline_training; FLOPs:
test_flops; export, generate and transformers' pipeline: test_recipes.)"""
import math

import pytest
import torch

from helpers import (assert_same_losses, assert_same_params, load_params, read_metrics, step_losses, train_workers,
                     two_stages_equal_one_worker)

pytestmark = pytest.mark.workers

# grouped-query attention: both query heads share one key/value head
LLAMA = {"model": {"arch": "llama", "n_kv_head": 1}}


# deep: a minute of compiling on 2 cores; make test compiles blocks in
# tests/test_training_features.py (two workers against eager)
@pytest.mark.parametrize("model", [pytest.param(LLAMA["model"], marks=pytest.mark.deep),
                                   pytest.param({"arch": "modernbert", "local_attention": 8}, marks=pytest.mark.deep)],
                         ids=["llama", "modernbert"])
def test_compiled_blocks_and_activation_checkpointing_train_like_eager(tmp_path, tiny_config, model):
    """models.apply_speedups on Llama's decoder and ModernBERT's encoder layers: the same losses
    as eager (checkpointing recomputes the same ops; the compiler may round differently),
    identical ranks."""
    config = tiny_config({"model": model, "train": {"max_steps": 3}})
    eager, recomputed, compiled = tmp_path / "eager", tmp_path / "recomputed", tmp_path / "compiled"
    train_workers(2, config, f"out_dir={eager}")
    train_workers(2, config, f"out_dir={recomputed}", "model.activation_checkpointing=true")
    train_workers(2, config, f"out_dir={compiled}", "model.compile=true", timeout=400)
    reference = step_losses(eager)
    assert_same_losses(reference, step_losses(recomputed), min_steps=3)
    assert_same_params(load_params(eager, 0), load_params(recomputed, 0), atol=1e-6)
    for step, loss in step_losses(compiled).items():
        assert loss == pytest.approx(reference[step], rel=1e-4)
    assert_same_params(load_params(compiled, 0), load_params(compiled, 1))


@pytest.mark.parametrize("precision", [pytest.param("fp16", marks=pytest.mark.deep), "bf16"])
def test_mixed_precision_trains(tmp_path, tiny_config, precision):
    config = tiny_config({**LLAMA, "train": {"precision": precision, "max_steps": 8, "lr": 3e-3}})
    train_workers(2, config, f"out_dir={tmp_path}")
    losses = step_losses(tmp_path)
    assert sorted(losses) == list(range(1, 9)) and all(math.isfinite(v) for v in losses.values())
    assert losses[8] < losses[1]
    assert_same_params(load_params(tmp_path, 0), load_params(tmp_path, 1))


def llama_folder(folder, tied: bool):
    """A Hugging Face Llama folder (as transformers saves one; no hvdtrain involved) whose
    vocabulary is the synthetic data's 128 tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                         tie_word_embeddings=tied)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.mark.parametrize("tied", [True, pytest.param(False, marks=pytest.mark.deep)], ids=["tied", "untied"])
def test_continued_pretraining_from_a_local_folder_also_in_two_stages(tmp_path, tiny_config, tied):
    """model.pretrained: training starts from the folder's weights (its step 0 loss is the
    folder's model's), and two pipeline stages equal one worker."""
    from transformers import LlamaForCausalLM
    folder = llama_folder(tmp_path / "pretrained", tied)
    config = tiny_config({"model": {"arch": "llama", "pretrained": str(folder)},
                          "train": {"micro_batch_size": 2, "global_batch_size": 8, "max_steps": 3, "lr": 1e-3},
                          "eval": {"every": 3}})
    one = two_stages_equal_one_worker(tmp_path, config)
    # the run continued from the folder: its first eval is the pretrained model's loss, near
    # log(128) for a random model, and its first step moved the folder's own weights
    start = LlamaForCausalLM.from_pretrained(folder).state_dict()
    evals = read_metrics(one)[1]
    assert evals[0]["step"] == 0 and abs(evals[0]["eval_loss"] - math.log(128)) < 0.5
    moved = load_params(one, 0)["model.layers.0.mlp.up_proj.weight"]
    assert moved.shape == start["model.layers.0.mlp.up_proj.weight"].shape
    assert 0 < (moved - start["model.layers.0.mlp.up_proj.weight"]).abs().max() < 0.01
