"""hvdtrain.models.flops: parameter counts against hand arithmetic and against transformers' own
models, the 6N + 12·L·d·T formula, the GPU peak table's name matching, and MFU, also as
metrics.Throughput measures it in training."""
import types

import pytest

from hvdtrain.config import config_from_dict
from hvdtrain.models.flops import (built_model_dims, count_params, flops_params, flops_per_token, mfu, model_dims,
                            model_flops_per_token, peak_tflops)

GPT2_124M = dict(arch="gpt2", n_layer=12, d_model=768, d_ff=3072, vocab_size=50257, max_position=1024)
# Llama 3.2 1B and Llama 3 8B as published (1,235,814,400 and 8,030,261,248 parameters)
LLAMA_32_1B = dict(arch="llama", n_layer=16, d_model=2048, d_ff=8192, vocab_size=128256, max_position=131072,
                   kv_width=512)
LLAMA_3_8B = dict(arch="llama", n_layer=32, d_model=4096, d_ff=14336, vocab_size=128256, max_position=8192,
                  kv_width=1024)
# ModernBERT-base as published: 149,655,232 parameters
MODERNBERT_BASE = dict(arch="modernbert", n_layer=22, d_model=768, d_ff=1152, vocab_size=50368, max_position=8192,
                       local_attention=128, global_every=3)
# 46.7B parameters in all, 12.9B active (two of eight experts), as Mistral counts them
MIXTRAL_8X7B = dict(arch="mixtral", n_layer=32, d_model=4096, d_ff=14336, vocab_size=32000, max_position=32768,
                    kv_width=1024, experts=8, experts_per_token=2)
BERT_LARGE = dict(arch="bert", n_layer=24, d_model=1024, d_ff=4096, vocab_size=30522, max_position=512)


def test_gpt2_124m_by_hand():
    # wte 50257·768 = 38,597,376; wpe 1024·768 = 786,432; ln_f 1,536;
    # per layer 4·768² + 2·768·3072 + 9·768 + 3072 = 7,087,872, x12 = 85,054,464
    assert count_params(**GPT2_124M) == 38_597_376 + 786_432 + 1_536 + 85_054_464 == 124_439_808
    # 6N leaves out the position table only: the tied wte is the lm_head matmul
    assert flops_params(**GPT2_124M) == 124_439_808 - 786_432 == 123_653_376


def test_bert_large_by_hand():
    # embeddings 30522·1024 + 512·1024 + 2·1024 + LayerNorm 2·1024 = 31,782,912
    # per layer 4·1024² + 2·1024·4096 + 9·1024 + 4096 = 12,596,224, x24 = 302,309,376
    # MLM head: dense 1024² + 1024, LayerNorm 2048, decoder bias 30522 = 1,082,170
    assert count_params(**BERT_LARGE) == 31_782_912 + 302_309_376 + 1_082_170 == 335_174_458
    assert flops_params(**BERT_LARGE) == 335_174_458 - 512 * 1024 - 2 * 1024


def test_untied_output_projection_is_counted_once_in_6n():
    untied = count_params(**GPT2_124M, tied_embeddings=False)
    assert untied == 124_439_808 + 50257 * 768
    # the input table becomes a lookup, the separate lm_head is the matmul: N is unchanged
    assert flops_params(**GPT2_124M, tied_embeddings=False) == 123_653_376


def test_bert_head_counts_only_for_masked_positions():
    # hvdtrain sends only the masked positions through BERT's MLM head:
    # head = decoder 30522·1024 + its bias 30522 + transform dense 1024² + 1024 + LayerNorm 2048 = 32,336,698
    full = 335_174_458 - 512 * 1024 - 2 * 1024  # 334,648,122
    assert flops_params(**BERT_LARGE, head_fraction=0.15) == pytest.approx(full - 0.85 * 32_336_698)
    cfg = config_from_dict({"model": {"arch": "bert", "n_layer": 24, "n_head": 16, "d_model": 1024},
                            "data": {"seq_len": 512, "vocab_size": 30522, "mlm_probability": 0.15}})
    # 6 · 307,161,928.7 + 12 · 24 · 1024 · 512
    assert model_flops_per_token(cfg) == pytest.approx(6 * (full - 0.85 * 32_336_698) + 150_994_944)


def test_model_flops_per_token_gpt2_from_config():
    cfg = config_from_dict({"model": {"arch": "gpt2", "n_layer": 12, "n_head": 12, "d_model": 768},
                            "data": {"seq_len": 1024, "vocab_size": 4096}})
    assert model_flops_per_token(cfg, dict(model_dims(cfg), vocab_size=50257)) == 855_166_464  # the real model's
    assert model_flops_per_token(cfg) == 855_166_464 - 6 * (50257 - 4096) * 768


def _hf_model(arch, n_layer, d_model, d_ff, vocab_size, max_position, tied, kv_width=None, local_attention=None,
              global_every=None, experts=None, experts_per_token=None):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    if arch == "gpt2":
        config = transformers.GPT2Config(n_layer=n_layer, n_embd=d_model, n_head=2, n_inner=d_ff,
                                         vocab_size=vocab_size, n_positions=max_position,
                                         tie_word_embeddings=tied)
        cls = transformers.GPT2LMHeadModel
    elif arch == "llama":
        config = transformers.LlamaConfig(num_hidden_layers=n_layer, hidden_size=d_model, num_attention_heads=4,
                                          num_key_value_heads=4 * kv_width // d_model, intermediate_size=d_ff,
                                          vocab_size=vocab_size, max_position_embeddings=max_position,
                                          tie_word_embeddings=tied)
        cls = transformers.LlamaForCausalLM
    elif arch == "mixtral":
        config = transformers.MixtralConfig(num_hidden_layers=n_layer, hidden_size=d_model, num_attention_heads=4,
                                            num_key_value_heads=4 * kv_width // d_model, intermediate_size=d_ff,
                                            vocab_size=vocab_size, max_position_embeddings=max_position,
                                            tie_word_embeddings=tied, num_local_experts=experts,
                                            num_experts_per_tok=experts_per_token)
        cls = transformers.MixtralForCausalLM
    elif arch == "modernbert":
        config = transformers.ModernBertConfig(num_hidden_layers=n_layer, hidden_size=d_model, num_attention_heads=4,
                                               intermediate_size=d_ff, vocab_size=vocab_size,
                                               max_position_embeddings=max_position, tie_word_embeddings=tied,
                                               local_attention=local_attention,
                                               global_attn_every_n_layers=global_every, pad_token_id=0)
        cls = transformers.ModernBertForMaskedLM
    else:
        config = transformers.BertConfig(num_hidden_layers=n_layer, hidden_size=d_model, num_attention_heads=2,
                                         intermediate_size=d_ff, vocab_size=vocab_size,
                                         max_position_embeddings=max_position, tie_word_embeddings=tied)
        cls = transformers.BertForMaskedLM
    with torch.device("meta"):  # shapes only: full-size models cost no memory or time
        return cls(config)


@pytest.mark.parametrize("dims, tied", [
    (dict(arch="gpt2", n_layer=2, d_model=64, d_ff=256, vocab_size=100, max_position=32), True),
    (dict(arch="gpt2", n_layer=3, d_model=96, d_ff=200, vocab_size=257, max_position=64), False),
    (dict(arch="gpt2", n_layer=1, d_model=32, d_ff=128, vocab_size=4096, max_position=128), True),
    (GPT2_124M, True),
    (dict(arch="bert", n_layer=2, d_model=64, d_ff=256, vocab_size=100, max_position=32), True),
    (dict(arch="bert", n_layer=3, d_model=96, d_ff=200, vocab_size=257, max_position=64), False),
    (dict(arch="bert", n_layer=1, d_model=32, d_ff=128, vocab_size=4096, max_position=128), True),
    (BERT_LARGE, True),
    # grouped-query attention: 4 query heads, 2 or 1 key/value heads
    (dict(arch="llama", n_layer=2, d_model=64, d_ff=200, vocab_size=100, max_position=32, kv_width=32), True),
    (dict(arch="llama", n_layer=3, d_model=96, d_ff=256, vocab_size=257, max_position=64, kv_width=24), False),
    (dict(arch="llama", n_layer=1, d_model=32, d_ff=128, vocab_size=4096, max_position=128, kv_width=32), True),
    (LLAMA_32_1B, True),
    (LLAMA_3_8B, False),
    (dict(arch="modernbert", n_layer=4, d_model=64, d_ff=96, vocab_size=100, max_position=32, local_attention=8,
          global_every=3), True),
    (dict(arch="modernbert", n_layer=3, d_model=96, d_ff=144, vocab_size=257, max_position=64, local_attention=16,
          global_every=2), False),
    (MODERNBERT_BASE, True),
    (dict(arch="mixtral", n_layer=2, d_model=64, d_ff=96, vocab_size=100, max_position=32, kv_width=32, experts=4,
          experts_per_token=2), False),
    (MIXTRAL_8X7B, False),
])
def test_count_matches_transformers(dims, tied):
    model = _hf_model(**dims, tied=tied)
    assert count_params(**dims, tied_embeddings=tied) == sum(p.numel() for p in model.parameters())
    # the shape read back from the model's own config counts the same
    assert built_model_dims(model.config) == dict(dims, tied_embeddings=tied)
    assert count_params(**built_model_dims(model.config)) == sum(p.numel() for p in model.parameters())


def test_other_model_types_have_no_dims():
    assert built_model_dims(types.SimpleNamespace(model_type="t5")) is None


class _World:
    """The part of distributed.World that Throughput reads: one CPU worker, rank 0."""
    size, is_main = 1, True
    device = types.SimpleNamespace(type="cpu")

    def __init__(self):
        self.printed = []

    def print(self, text):
        self.printed.append(text)


def test_throughput_counts_the_real_model_not_the_config():
    """With model.pretrained the model.* keys do not describe the model: a 3 x 96 checkpoint
    trained under a config that says 2 x 64 (the defaults) runs at the checkpoint's FLOPs."""
    from hvdtrain.observe.metrics import Throughput
    cfg = config_from_dict({"model": {"pretrained": "some/checkpoint"},
                            "data": {"seq_len": 64, "vocab_size": 4096}, "log": {"peak_tflops": 1.0}})
    real = dict(arch="gpt2", n_layer=3, d_model=96, d_ff=200, vocab_size=257, max_position=64)
    model = _hf_model(**real, tied=False)
    world = _World()
    throughput = Throughput(cfg, model.config, world, global_batch=8)
    expected = flops_per_token(flops_params(**real, tied_embeddings=False), 3, 96, 64)
    assert throughput.flops_per_token == expected != model_flops_per_token(cfg)
    assert f"{expected / 1e6:.1f} MFLOPs per token" in world.printed[0]
    record = throughput.record(step_time=0.5)  # 8 x 64 tokens in 0.5 s
    assert record["tokens_per_s"] == 1024 and record["mfu"] == pytest.approx(1024 * expected / 1e12)


def test_throughput_of_an_uncounted_model_type_has_no_mfu():
    from hvdtrain.observe.metrics import Throughput
    cfg = config_from_dict({"log": {"peak_tflops": 1.0}})
    world = _World()
    throughput = Throughput(cfg, types.SimpleNamespace(model_type="t5"), world, global_batch=8)
    assert "mfu" not in throughput.record(step_time=0.5)
    assert "no FLOPs count for model type 't5'" in world.printed[0]


def test_flops_per_token_gpt2_124m():
    # 6 · 123,653,376 + 12 · 12 · 768 · 1024 = 741,920,256 + 113,246,208
    assert flops_per_token(123_653_376, 12, 768, 1024) == 855_166_464


@pytest.mark.parametrize("name, precision, value, entry", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989, "H100 SXM"),
    ("NVIDIA H100 PCIe", "bf16", 756, "H100 PCIe"),
    ("NVIDIA H100 NVL", "fp16", 835, "H100 NVL"),
    ("NVIDIA H200", "bf16", 989, "H200"),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312, "A100 80GB"),
    ("NVIDIA A100-SXM4-40GB", "fp16", 312, "A100 40GB"),
    # fp32 runs with TF32 matmuls (distributed.init): the TF32 tensor-core rate where there is one
    ("NVIDIA A100 80GB PCIe", "fp32", 156, "A100 80GB"),
    ("NVIDIA H100 80GB HBM3", "fp32", 494.5, "H100 SXM"),
    ("NVIDIA H200", "fp32", 494.5, "H200"),
    ("Tesla V100-SXM2-32GB", "fp32", 15.7, "V100 32GB"),  # Volta: no TF32, CUDA cores
    ("NVIDIA A10", "bf16", 125, "A10"),
    ("NVIDIA L4", "bf16", 121, "L4"),
    ("NVIDIA L40S", "bf16", 362, "L40S"),
    ("NVIDIA GeForce RTX 4090", "bf16", 165.2, "RTX 4090"),
    ("Tesla V100-SXM2-32GB", "fp16", 125, "V100 32GB"),
    ("NVIDIA B200", "bf16", 2250, "B200"),
    ("h100", "bf16", 989, "H100 SXM"),
])
def test_peak_tflops_matches_device_names(name, precision, value, entry):
    peak, source = peak_tflops(name, precision)
    assert peak == value
    assert source.startswith(entry + " ")


@pytest.mark.parametrize("name, precision", [
    ("cpu", "bf16"),
    ("NVIDIA A10G", "bf16"),  # no \b after A10: not the A10
    ("Tesla V100-SXM2-16GB", "bf16"),  # Volta has no bf16 tensor cores
])
def test_peak_tflops_unknown_is_none(name, precision):
    peak, source = peak_tflops(name, precision)
    assert peak is None and source


def test_mfu():
    # 8 GPUs of 989 TFLOP/s, 855,166,464 FLOPs/token at 4M tokens/s: 3.42e15 / 7.912e15
    assert mfu(4e6, 855_166_464, 8 * 989) == pytest.approx(4e6 * 855_166_464 / 7.912e15)
    assert mfu(4e6, 855_166_464, 8 * 989) == pytest.approx(0.43234, abs=1e-5)


def test_fp32_mfu_is_measured_against_tf32():
    """GPT-2 124M in fp32 at 200k tokens/s on one H100 does 171 TFLOP/s: 2.6x the plain fp32
    rate of 67 TFLOP/s, but 35% of the TF32 tensor cores it actually runs its matmuls on."""
    peak, source = peak_tflops("NVIDIA H100 80GB HBM3", "fp32")
    assert source == "H100 SXM tf32 dense"
    assert mfu(200e3, 855_166_464, 67) > 1
    assert mfu(200e3, 855_166_464, peak) == pytest.approx(0.3459, abs=1e-4)


def test_published_sizes():
    assert count_params(**LLAMA_32_1B, tied_embeddings=True) == 1_235_814_400
    assert count_params(**MODERNBERT_BASE) == 149_655_232
    assert count_params(**LLAMA_3_8B, tied_embeddings=False) == 8_030_261_248
    # Mixtral 8x7B: 46.7B in all; 12.9B active per token (2 of 8 experts), of which N counts all
    # but the input embedding's 131M-entry lookup table
    assert count_params(**MIXTRAL_8X7B, tied_embeddings=False) == 46_702_792_704
    assert flops_params(**MIXTRAL_8X7B, tied_embeddings=False) + 32000 * 4096 == 12_879_925_248


@pytest.mark.parametrize("arch, model", [("gpt2", {}), ("llama", {"n_kv_head": 2, "d_ff": 200}),
                                         ("llama", {"n_kv_head": 1, "tie_embeddings": False}), ("bert", {}),
                                         ("modernbert", {"d_ff": 96, "global_attn_every": 1}),
                                         ("mixtral", {"n_kv_head": 2, "d_ff": 48, "experts": 4, "experts_per_token": 2})])
def test_flops_per_token_are_the_model_s_own_matmuls(arch, model):
    """The FLOPs of one training step as torch counts the model's matmuls (forward, loss and
    backward; attention through its matmul kernel, which the counter sees) equal the formula's,
    less 6 per vector parameter (biases and norms, which the 6N convention counts). A masked
    LM's head runs on its targets only (a quarter here, data.mlm_probability), and hvdtrain's
    loss sums the decoder bias's gradient with a matmul (2 FLOPs per target and vocabulary row)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from hvdtrain.models import family
    from hvdtrain.models.common import Vocab, build_model, token_loss_sum
    cfg = config_from_dict({"model": {"arch": arch, "n_layer": 2, "n_head": 4, "d_model": 64, "dropout": 0.0,
                                      **model},
                            "data": {"seq_len": 32, "vocab_size": 128, "mlm_probability": 0.25}})
    net = build_model(cfg.model, Vocab(size=128, pad_id=0, bos_id=1, eos_id=1, cls_id=2, sep_id=3, mask_id=4), 32)
    if arch == "mixtral":  # one matmul per expert: torch's counter does not count the default grouped_mm
        net.set_experts_implementation("eager")
    ids = torch.randint(5, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    causal = family(arch).causal
    labels = ids if causal else torch.where(torch.arange(32) % 4 == 0, ids, -100)
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        token_loss_sum(net, {"input_ids": ids, "labels": labels}).backward()
    head = {"bert": "cls.", "modernbert": ("head.", "decoder.")}.get(arch, "lm_head.")
    vectors = {n: p.numel() for n, p in net.named_parameters() if p.dim() == 1}
    head_vectors = sum(size for name, size in vectors.items() if name.startswith(head))
    fraction = 1.0 if causal else 0.25
    expected = (model_flops_per_token(cfg, built_model_dims(net.config))
                - 6 * (sum(vectors.values()) - (1 - fraction) * head_vectors))
    if not causal:
        expected += 2 * 128 * fraction  # the bias gradient's matmul
    assert counter.get_total_flops() / ids.numel() == pytest.approx(expected, rel=1e-12)


def test_local_attention_layers_count_their_window():
    """ModernBERT: layers 0 and 3 of 4 attend to all 512 keys, layers 1 and 2 to 129 (the
    position and 64 on each side); a block shorter than the window is attended whole."""
    from hvdtrain.models.modernbert import attended_keys
    assert attended_keys(512, n_layer=4, local_attention=128, global_every=3) == 2 * 512 + 2 * 129
    assert attended_keys(64, n_layer=4, local_attention=128, global_every=3) == 4 * 64
    cfg = config_from_dict({"model": {"arch": "modernbert", "n_layer": 4, "n_head": 4, "d_model": 64},
                            "data": {"seq_len": 512}})
    dims = model_dims(cfg)
    assert (dims["local_attention"], dims["global_every"]) == (128, 3)  # the defaults, ModernBERT-base's
    n = flops_params(**dims, head_fraction=0.15)
    assert model_flops_per_token(cfg) == flops_per_token(n, 4, 64, 512) - 12 * 64 * 2 * (512 - 129)
