"""hvdtrain.tools.plan: memory, ring-allreduce and batch arithmetic checked against numbers worked
out by hand in the comments, the metrics.jsonl reader, and the `plan` subcommand."""
import argparse
import json
import math
from pathlib import Path

import pytest

from helpers import REPO
from hvdtrain.tools import plan as planmod
from hvdtrain.config import config_from_dict, load_config
from hvdtrain.errors import UserError
from hvdtrain.tools.plan import (activation_bytes, exposed_comm_seconds, in_flight, layer_activation_bytes, loss_chunk_bytes,
                           memory_bytes, pipeline_plan, plan, read_step_time, ring_allreduce_seconds, stage_memory,
                           with_stages)

GIB = 2 ** 30
N_124M = 124_439_808
FIXED = GIB + 128 * 2 ** 20  # CUDA overhead + Horovod's default 128 MiB fusion buffer
SBH_B1 = 1024 * 768  # s·h of GPT-2 124M at seq_len 1024: s·b·h = 786,432 per sample


def gpt2_124m(**train):
    return config_from_dict({
        "model": {"arch": "gpt2", "n_layer": 12, "n_head": 12, "d_model": 768},
        "data": {"seq_len": 1024, "vocab_size": 50257},
        "train": {"micro_batch_size": 8, **train},
    })


# ---------------------------------------------------------------- memory

def test_gpt2_124m_fp32_state():
    parts = memory_bytes(gpt2_124m(precision="fp32"), 8, False)["parts"]
    assert parts["parameters (fp32)"] == parts["gradients (fp32)"] == 4 * N_124M == 497_759_232
    assert parts["optimizer state (adamw, 2 fp32 moments)"] == 8 * N_124M == 995_518_464
    assert "autocast 16-bit weight copies" not in parts


@pytest.mark.parametrize("precision,per_param", [("fp32", lambda d: 8 + 8 / d), ("fp16", lambda d: 8 + 8 / d),
                                                 ("bf16", lambda d: 6 + 12 / d)])
@pytest.mark.parametrize("spelling", [{"shard": "optimizer"}, {"shard_optimizer": True}])
def test_a_sharded_optimizer_divides_its_state_by_the_copies(precision, per_param, spelling):
    """Megatron's distributed optimizer's counts (fp32 weights and gradients, 1/d of the moments;
    in bf16, bf16 weights, fp32 gradients, 1/d of the fp32 masters and moments, no autocast
    copies), and the reduce-scatter outputs in flight beside the full gradients: 1/d of one
    fusion buffer (Horovod's 128 MiB), or of the gradients when they are smaller."""
    for n in (1 << 20, 1 << 30):
        in_flight = min(4 * n, 128 * 2 ** 20)
        for d in (1, 2, 4, 64):
            cfg = config_from_dict({"train": {"precision": precision}, "parallel": spelling})
            parts = planmod.weight_state_bytes(cfg, n, 0, copies=d)
            assert sum(parts.values()) == per_param(d) * n + in_flight // d


@pytest.mark.parametrize("precision,per_param", [("fp32", lambda d: 4 + 12 / d), ("bf16", lambda d: 2 + 16 / d)])
def test_sharded_gradients_keep_only_their_slices_beside_the_gradients_in_flight(precision, per_param):
    """ZeRO-2: the weights (fp32, or bf16 with 1/d of the fp32 masters), 1/d of the gradients
    and moments, and one fusion buffer of full gradients in flight."""
    for n in (1 << 20, 1 << 30):
        in_flight = min(4 * n, 128 * 2 ** 20)
        for d in (1, 2, 4, 64):
            cfg = config_from_dict({"train": {"precision": precision}, "parallel": {"shard": "gradients"}})
            assert sum(planmod.weight_state_bytes(cfg, n, 0, copies=d).values()) == per_param(d) * n + in_flight


@pytest.mark.parametrize("precision,unit_bytes", [("fp32", 4 * 4), ("bf16", 4 * 2)])
def test_full_sharding_keeps_16_over_d_and_the_units_in_flight(precision, unit_bytes):
    """ZeRO-3: 16/d per parameter, plus 3 units whole and one arriving, in the weights' dtype
    (bf16 is gathered as bf16), and one unit's fp32 gradients in flight (no more than a fusion
    buffer's worth); GPT-2's largest unit is its embeddings (wte and wpe)."""
    cfg = config_from_dict({**gpt2_124m(precision=precision).to_dict(), "parallel": {"shard": "full"}})
    unit = planmod.largest_unit_params(cfg)
    assert unit == (50_257 + 1024) * 768
    small = config_from_dict({**cfg.to_dict(), "horovod": {"fusion_threshold_mb": 1024}})
    assert planmod.fused_gradient_bytes(small, 1 << 30) == 4 * unit  # one unit's, under a large fusion buffer
    for n in (1 << 27, 1 << 30):
        for d in (1, 8, 64):
            parts = planmod.weight_state_bytes(cfg, n, 0, copies=d)
            assert parts["units in flight (full)"] == unit * unit_bytes
            in_flight = min(4 * unit, 128 * 2 ** 20)
            assert parts["full gradients in flight (one unit's)"] == in_flight
            assert sum(parts.values()) == 16 * n // d + unit * unit_bytes + in_flight


def test_gpt2_124m_bf16_state():
    parts = memory_bytes(gpt2_124m(precision="bf16"), 8, False)["parts"]
    # fp32 params, grads and moments in every precision: 16 B/param
    state = parts["parameters (fp32)"] + parts["gradients (fp32)"] + parts["optimizer state (adamw, 2 fp32 moments)"]
    assert state == 16 * N_124M
    # 2 B for each matmul weight's bf16 copy: the 123,653,376 parameters of 6N
    assert parts["autocast 16-bit weight copies"] == 2 * 123_653_376


def test_korthikanti_formula_for_16_bit_everything():
    # With 16-bit LayerNorm inputs and softmax the generalised count is Korthikanti's own
    # sbh·(34 + 5as/h); hvdtrain's fp32 residual and softmax add 4·sbh and 2·as²b.
    s, b, h, a = 1024, 8, 768, 12
    sbh, as2b = s * b * h, a * s * s * b
    assert layer_activation_bytes(s, b, h, a, 2, sdpa=False) == (34 + 4) * sbh + (5 + 2) * as2b
    # fp32: every 2-byte value doubled, the 1-byte masks (2·sbh + as²b) not
    assert layer_activation_bytes(s, b, h, a, 4, sdpa=False) == 66 * sbh + 9 * as2b
    # SDPA: no a·s² scores; the kernel keeps its output (2·sbh)
    assert layer_activation_bytes(s, b, h, a, 2, sdpa=True) == 40 * sbh


def test_activations_with_and_without_checkpointing():
    cfg = gpt2_124m(precision="bf16")
    sbh = 8 * SBH_B1  # 6,291,456
    assert activation_bytes(cfg, 8, checkpointing=False) == 12 * 40 * sbh == 3_019_898_880
    # checkpointing: 12 fp32 layer inputs + one layer's activations during its recompute
    assert activation_bytes(cfg, 8, checkpointing=True) == 12 * 4 * sbh + 40 * sbh == 553_648_128
    assert activation_bytes(cfg, 8, checkpointing=False, sdpa=False) == \
        12 * (38 * sbh + 7 * 12 * 1024 * 1024 * 8) == 11_324_620_800


def test_bert_loss_chunk_only_for_masked_positions():
    cfg = config_from_dict({"model": {"arch": "bert", "n_layer": 24, "n_head": 16, "d_model": 1024},
                            "data": {"seq_len": 512, "vocab_size": 30522, "mlm_probability": 0.15},
                            "train": {"precision": "bf16"}})
    # 16·512 positions, 15% of them through the vocabulary: one chunk of all 1228 (2^26 / 30522 =
    # 2198 rows fit) x 30522 x (2 bf16 logits + 4 their fp32 copy + 4 log-softmax), the head's
    # fp32 gradient and one chunk's bf16 product added to it, grad x (bf16)
    assert loss_chunk_bytes(cfg, 16) == 1228 * 30522 * 10 + 30522 * 1024 * (4 + 2) + 1228 * 1024 * 2


def test_plan_memory_total_and_fit():
    p = plan(gpt2_124m(precision="bf16"), gpus=1, gpu="NVIDIA H100 80GB HBM3")
    mem = p["memory"]
    # The chunked loss (loss_chunk_bytes): 1335 positions x 50257 x (2 bf16 logits + 4 their fp32
    # copy + 4 log-softmax), the head's fp32 gradient and one chunk's bf16 product, grad x (bf16)
    loss = 1335 * 50257 * 10 + 50257 * 768 * (4 + 2) + 8 * 1024 * 768 * 2
    total = 16 * N_124M + 2 * 123_653_376 + 3_019_898_880 + loss + FIXED
    assert mem["total"] == total == 7_381_300_230
    assert mem["budget"] == 0.9 * 80 * GIB
    assert mem["fits"] and mem["pipeline_stages"] is None
    assert mem["total_with_checkpointing"] == total - 3_019_898_880 + 553_648_128


def test_too_big_suggests_pipeline_stages():
    # 3 GiB GPU: budget 2.7 GiB, of which the fixed 1.125 GiB leaves 1,691,143,372.8 B per stage.
    # The fewest stages at micro batch 1, checkpointing, 1f1b with m = p micro batches: the last
    # stage is the largest (the head's copy of wte and the loss), per stage_memory:
    #   state: 18 B per layer parameter (16 + the bf16 copy): 7,087,872 x 18 = 127,581,696 per layer;
    #          ln_f + lm_head copy 38,598,912 x 18 = 694,780,416
    #   activations (1 in flight): the layer inputs but the first (the receive buffer) 4·sbh each,
    #          + one layer's 40·sbh = 31,457,280 (sbh = 786,432)
    #   receive buffers: the 1 activation in flight, 4·sbh = 3,145,728
    #   the chunked loss (as one stage's, pipeline.TokenLoss), at micro batch 1 one chunk of all
    #          1024 positions: 1024·50257·10 + 50257·768·(4 + 2) + 1024·768·2 = 747,788,800
    # p = 4, layers 10-11: 949,943,808 + 34,603,008 + 3,145,728 + 747,788,800 = 1,735,481,344: too big
    # p = 5, layer 11:     822,362,112 + 31,457,280 + 3,145,728 + 747,788,800 = 1,604,753,920: fits
    p = plan(gpt2_124m(precision="bf16"), gpus=1, gpu="tiny", gpu_memory_gib=3)
    mem = p["memory"]
    assert mem["smallest_total"] == 3_055_338_496 + FIXED  # one stage at micro batch 1, its chunked loss 747,788,800
    assert not mem["fits"]
    assert mem["pipeline_stages"] == 5
    assert "at least 5 pipeline stages (parallel.pipeline_stages; `--pp 5` plans them)" in planmod.format_plan(p)
    cfg = with_stages(gpt2_124m(precision="bf16"), 4)
    assert stage_memory(cfg, 4, 1, True)[-1]["total"] == 1_735_481_344 + FIXED
    assert stage_memory(with_stages(cfg, 5), 5, 1, True)[-1]["total"] == 1_604_753_920 + FIXED
    # 2 GiB (0.675 GiB per stage): the head's copy and the loss alone do not fit on a last stage
    p = plan(gpt2_124m(precision="bf16"), gpus=1, gpu="tiny", gpu_memory_gib=2)
    assert p["memory"]["pipeline_stages"] is None
    assert "with one layer per pipeline stage the largest stage still does not fit" in planmod.format_plan(p)


# ---------------------------------------------------------------- communication

def test_ring_allreduce_by_hand():
    nbytes = 4 * N_124M  # 497,759,232 B; at 100 Gbit/s = 12.5e9 B/s that is 0.03982073856 s
    assert ring_allreduce_seconds(nbytes, 1, 100, 5e-6, 4) == 0.0
    # N=2: 2·1/2 of the data, 2·1 latency steps for each of 4 fused allreduces
    assert ring_allreduce_seconds(nbytes, 2, 100, 5e-6, 4) == pytest.approx(0.03982073856 + 4 * 2 * 5e-6)
    # N=8: 2·7/8 = 1.75 of the data, 2·7 latency steps each
    assert ring_allreduce_seconds(nbytes, 8, 100, 5e-6, 4) == pytest.approx(1.75 * 0.03982073856 + 4 * 14 * 5e-6)


def test_plan_comm_fusion_and_compression():
    comm = plan(gpt2_124m(), gpus=8)["comm"]
    assert comm["gradient_bytes"] == 497_759_232
    assert comm["allreduces"] == math.ceil(497_759_232 / 2 ** 27) == 4
    assert comm["seconds"] == pytest.approx(0.06996629248)
    cfg = config_from_dict({**gpt2_124m().to_dict(), "horovod": {"compression": "fp16"}})
    comm = plan(cfg, gpus=8)["comm"]
    assert comm["gradient_bytes"] == 2 * N_124M and comm["allreduces"] == 2


def test_fusion_off_means_one_allreduce_per_parameter_tensor():
    cfg = config_from_dict({**gpt2_124m().to_dict(), "horovod": {"fusion_threshold_mb": 0}})
    p = plan(cfg, gpus=8)
    assert p["comm"]["allreduces"] == 12 * 12 + 4 == sum(1 for _ in _gpt2_parameter_names())
    assert p["memory"]["parts"]["Horovod fusion buffer"] == 0
    # 148 allreduces x 14 ring steps x 5 us of latency on top of the bandwidth term
    assert p["comm"]["seconds"] == pytest.approx(1.75 * 0.03982073856 + 148 * 14 * 5e-6)


def _gpt2_parameter_names():
    layer = [f"{m}.{w}" for m in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj")
             for w in ("weight", "bias")]
    return ["wte", "wpe", *(f"h.{i}.{n}" for i in range(12) for n in layer), "ln_f.weight", "ln_f.bias"]


def test_fp16_compression_copies_count_in_memory():
    cfg = config_from_dict({**gpt2_124m().to_dict(), "horovod": {"compression": "fp16"}})
    assert memory_bytes(cfg, 8, False)["parts"]["fp16-compressed gradients"] == 2 * N_124M


def test_exposed_comm():
    assert exposed_comm_seconds(0.07, 0.02, micro_compute_s=0.03) == pytest.approx(0.05)  # 0.07 - 2/3·0.03
    assert exposed_comm_seconds(0.07, 0.02, micro_compute_s=0.3) == 0.02  # hidden, except the tail


def test_scaling_rows_by_hand():
    # Embedding gradients (50257 + 1024)·768 = 39,383,808 params = 157,535,232 B are ready last:
    # on 8 GPUs 1.75 · 157,535,232 / 12.5e9 + 14 · 5e-6 = 0.02212493248 s, never hidden.
    tail_8 = 1.75 * 157_535_232 / 12.5e9 + 14 * 5e-6
    # grad_accum 1, step 0.3 s: window 2/3 · 0.3 = 0.2 s hides all but the tail
    rows = plan(gpt2_124m(), gpus=8, step_time=0.3)["scaling"]["rows"]
    assert [r["gpus"] for r in rows] == [1, 2, 4, 8]
    assert rows[0]["step_s"] == 0.3 and rows[0]["efficiency"] == 1.0
    assert rows[-1]["exposed_s"] == pytest.approx(tail_8)
    assert rows[-1]["efficiency"] == pytest.approx(0.3 / (0.3 + tail_8))
    # grad_accum 16, step 0.6 s: the last micro batch computes 0.0375 s, its backward hides 0.025 s
    rows = plan(gpt2_124m(grad_accum=16), gpus=8, step_time=0.6)["scaling"]["rows"]
    assert rows[-1]["exposed_s"] == pytest.approx(0.06996629248 - 0.025)
    assert rows[-1]["step_s"] == pytest.approx(0.6 + 0.06996629248 - 0.025)
    assert rows[-1]["tokens_per_s"] == pytest.approx(8 * 8 * 16 * 1024 / rows[-1]["step_s"])


def test_mfu_in_scaling_uses_the_gpu_peak():
    row = plan(gpt2_124m(precision="bf16"), gpus=1, gpu="H100", step_time=0.1)["scaling"]["rows"][0]
    # 8·1024 tokens in 0.1 s at 855,166,464 FLOPs/token on 989 TFLOP/s
    assert row["mfu"] == pytest.approx(81920 * 855_166_464 / 989e12)


# ---------------------------------------------------------------- batch for a target global batch

def test_target_global_batch_largest_micro_batch():
    # per GPU 64 samples; micro 64 needs 16·N + copies + 64·12·40·786,432 + the chunked loss
    # (1335·50257·10 + 50257·768·(4 + 2) + 64·1024·768·2 = 1,003,178,502) + fixed = 28,608,672,774 B
    t = plan(gpt2_124m(precision="bf16"), gpus=8, gpu="H100", target_global_batch=512)["target"]
    assert (t["micro_batch"], t["grad_accum"], t["checkpointing"]) == (64, 1, False)
    assert t["total"] == 28_608_672_774
    # 1024: micro 128 needs 52,945,721,862 B = 49.3 GiB <= 72 GiB
    t = plan(gpt2_124m(precision="bf16"), gpus=8, gpu="H100", target_global_batch=1024)["target"]
    assert (t["micro_batch"], t["grad_accum"]) == (128, 1)
    # L4, 24 GiB: micro 32 needs 16,555,940,358 B = 15.4 GiB <= 21.6; 64 does not fit
    t = plan(gpt2_124m(precision="bf16"), gpus=8, gpu="NVIDIA L4", target_global_batch=512)["target"]
    assert (t["micro_batch"], t["grad_accum"]) == (32, 2)


def test_target_needs_checkpointing():
    # micro 1 without checkpointing: 4,544,274,944 B; with it: 4,235,993,600 B; budget 0.9·4.5 GiB between
    t = plan(gpt2_124m(precision="bf16"), gpus=8, gpu="x", gpu_memory_gib=4.5, target_global_batch=8)["target"]
    assert (t["micro_batch"], t["grad_accum"], t["checkpointing"]) == (1, 1, True)


def test_target_from_config_and_not_divisible():
    t = plan(gpt2_124m(global_batch_size=100), gpus=8)["target"]
    assert t["global_batch"] == 100 and "not a multiple of 8" in t["error"]


def test_target_step_time_scales_with_samples_and_recompute():
    # measured: micro 8 x accum 1 in 0.4 s = 0.05 s per sample; target micro 1 with checkpointing
    # on 8 GPUs: 1 sample x 4/3 recompute = 0.0666 s per micro batch, accum 1; comm mostly exposed
    t = plan(gpt2_124m(precision="bf16"), gpus=8, gpu="x", gpu_memory_gib=4.5, step_time=0.4,
             target_global_batch=8)["target"]
    micro_s = 0.05 * 4 / 3
    assert t["compute_s"] == pytest.approx(micro_s)
    assert t["step_s"] == pytest.approx(micro_s + 0.06996629248 - 2 / 3 * micro_s)


# ---------------------------------------------------------------- measured runs and the CLI

def _write_metrics(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")


def test_read_step_time_median_of_one_worker_lines(tmp_path):
    _write_metrics(tmp_path / "metrics.jsonl", [
        {"step": 10, "world_size": 1, "time_step": 2.0},  # warm-up
        {"step": 20, "world_size": 1, "time_step": 0.31},
        {"step": 25, "eval_loss": 3.2},
        {"step": 30, "world_size": 1, "time_step": 0.29},
        {"step": 40, "world_size": 1, "time_step": 0.30},
        {"step": 10, "world_size": 2, "time_step": 0.5},
    ])
    assert read_step_time(str(tmp_path)) == pytest.approx(0.305)  # median of 2.0, .31, .29, .30
    assert read_step_time(str(tmp_path / "metrics.jsonl")) == pytest.approx(0.305)


def test_read_step_time_errors(tmp_path):
    with pytest.raises(UserError, match="no metrics file"):
        read_step_time(str(tmp_path))
    _write_metrics(tmp_path / "metrics.jsonl", [{"step": 1, "world_size": 2, "time_step": 0.5}])
    with pytest.raises(UserError, match="no lines with world_size 1"):
        read_step_time(str(tmp_path))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{oops\n')
    with pytest.raises(UserError, match="line 2 is not JSON"):
        read_step_time(str(tmp_path))


@pytest.mark.parametrize("kwargs, message", [
    (dict(gpus=0), "--gpus"),
    (dict(gpus=2, gpu="Radeon 7"), "unknown GPU"),
    (dict(gpus=2, step_time=0.0), "--step-time"),
    (dict(gpus=2, net_gbps=0), "--net-gbps"),
    (dict(gpus=2, gpu="x", gpu_memory_gib=1), "no room"),
])
def test_plan_rejects_bad_input(kwargs, message):
    with pytest.raises(UserError, match=message):
        plan(gpt2_124m(), **kwargs)


def _cli(argv):
    parser = argparse.ArgumentParser(prog="hvdtrain")
    planmod.add_cli(parser.add_subparsers(required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_with_measured_run(tmp_path, capsys):
    config = tmp_path / "gpt2.yaml"
    config.write_text("model: {arch: gpt2, n_layer: 12, n_head: 12, d_model: 768}\n"
                      "data: {seq_len: 1024, vocab_size: 50257}\n")
    _write_metrics(tmp_path / "metrics.jsonl", [{"step": 10, "world_size": 1, "time_step": 0.3}])
    assert _cli(["plan", str(config), "train.precision=bf16", "--gpus", "8", "--gpu", "A100",
                 "--measured", str(tmp_path), "--target-global-batch", "512"]) == 0
    out = capsys.readouterr().out
    assert "124,439,808" in out and "A100 80GB" in out and "fits" in out
    assert "1-worker step 0.300 s" in out and "312 TFLOP/s" in out
    assert "micro batch 64 x grad_accum 1 x 8 GPUs" in out


def test_impossible_step_time_is_flagged():
    # 8·1024 tokens x 855 MFLOPs in 1 ms would be 7 PFLOP/s on one 989 TFLOP/s GPU
    p = plan(gpt2_124m(precision="bf16"), gpus=2, gpu="H100", step_time=0.001)
    assert p["scaling"]["rows"][0]["mfu"] > 1
    assert "warning: this step time means more than the GPU's peak" in planmod.format_plan(p)
    assert "warning" not in planmod.format_plan(plan(gpt2_124m(precision="bf16"), gpus=2, step_time=0.1))


def test_cli_config_errors_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        _cli(["plan", str(tmp_path / "missing.yaml"), "--gpus", "2"])
    config = tmp_path / "c.yaml"
    config.write_text("model: {arch: gpt2}\n")
    with pytest.raises(UserError, match="model.n_layer"):
        _cli(["plan", str(config), "model.n_layer=0", "--gpus", "2"])


# ---------------------------------------------------------------- the formula against real models

@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_layer_formula_matches_saved_tensors_of_hf_models(arch):
    """Sum the bytes autograd keeps for backward in a real HF layer (eager attention, fp32, on
    CPU) and compare with layer_activation_bytes. CPU dropout keeps its mask as a float tensor
    (4 B), where CUDA keeps 1-byte masks: 3 more bytes for each of 2·sbh + a·s²·b mask elements.
    The formula leaves out the two LayerNorms' per-row fp32 mean and rstd (2·2·4·b·s bytes)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    s, b, h, a = 64, 2, 128, 4

    def saved_bytes(n_layer):
        torch.manual_seed(0)
        if arch == "gpt2":
            model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
                n_layer=n_layer, n_embd=h, n_head=a, vocab_size=96, n_positions=s,
                activation_function="gelu_pytorch_tanh", attn_implementation="eager"))
        else:
            model = transformers.BertForMaskedLM(transformers.BertConfig(
                num_hidden_layers=n_layer, hidden_size=h, num_attention_heads=a, intermediate_size=4 * h,
                vocab_size=96, max_position_embeddings=s, attn_implementation="eager"))
        model.train()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                storages[storage.data_ptr()] = storage.nbytes()
            return t

        ids = torch.randint(0, 96, (b, s))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, labels=ids)
        return sum(storages.values())

    per_layer = saved_bytes(3) - saved_bytes(2)
    cpu_masks = 3 * (2 * s * b * h + a * s * s * b)
    layernorm_stats = 2 * 2 * 4 * b * s
    assert per_layer == layer_activation_bytes(s, b, h, a, 4, sdpa=False) + cpu_masks + layernorm_stats


# ---------------------------------------------------------------- pipeline stages (--pp)

def small_gpt(**sections):
    """4 layers of d 64 (12·64² + 13·64 = 49,984 parameters each), 32 positions, 256 tokens,
    bf16, micro batch 2, 2 stages of 2 layers ([0, 2, 4]), 1f1b, no fusion buffer: the numbers
    below are worked out by hand from these."""
    tree = {"model": {"arch": "gpt2", "n_layer": 4, "n_head": 4, "d_model": 64},
            "data": {"seq_len": 32, "vocab_size": 256},
            "train": {"micro_batch_size": 2, "global_batch_size": 16, "precision": "bf16"},
            "horovod": {"fusion_threshold_mb": 0},
            "parallel": {"pipeline_stages": 2}}
    for name, values in sections.items():
        tree[name] = {**tree.get(name, {}), **values}
    return config_from_dict(tree)


# stage 0: 2 layers 99,968 + wte 16,384 + wpe 2,048 = 118,400 parameters, 99,968 in matmuls
# stage 1: 2 layers 99,968 + ln_f 128 + its copy of wte 16,384 = 116,480, all in matmuls
# sbh = 32·2·64 = 4,096; one layer (bf16, SDPA) 40·sbh = 163,840; a boundary tensor 4·sbh = 16,384
STATE_0 = 16 * 118_400 + 2 * 99_968   # 2,094,336
STATE_1 = 16 * 116_480 + 2 * 116_480  # 2,096,640
BUFFERS = 16_384                      # one gradient received (stage 0); the 1 activation in flight (stage 1)
# the chunked loss, one chunk of all 64 positions: logits 64·256·(2 + 4 + 4), the head's fp32
# gradient and one chunk's bf16 product added to it 256·64·(4 + 2), the inputs' gradient 64·64·2
LOSS = 163_840 + 98_304 + 8_192       # 270,336


def test_stage_memory_1f1b_by_hand():
    ranks = stage_memory(small_gpt(), 4, 2, checkpointing=False)
    assert [r["params"] for r in ranks] == [118_400, 116_480]
    # in flight: min(m, p - rank): 2 on the first stage, 1 on the last
    assert [r["in_flight"] for r in ranks] == [2, 1]
    # stage 0 per micro batch: 2 layers + its output kept for backward = 327,680 + 16,384
    assert ranks[0]["parts"]["activations"] == 2 * (2 * 163_840 + 16_384) == 688_128
    # stage 1: 2 layers, the first one's input being the receive buffer
    assert ranks[1]["parts"]["activations"] == 2 * 163_840 - 16_384 == 311_296
    assert [r["parts"]["pipeline receive buffers"] for r in ranks] == [BUFFERS, BUFFERS]
    assert "logits and loss" not in ranks[0]["parts"] and ranks[1]["parts"]["logits and loss"] == LOSS
    assert ranks[0]["total"] == STATE_0 + 688_128 + BUFFERS + GIB == 2_798_848 + GIB
    assert ranks[1]["total"] == STATE_1 + 311_296 + BUFFERS + LOSS + GIB == 2_694_656 + GIB


def test_stage_memory_gpipe_and_checkpointing_by_hand():
    ranks = stage_memory(small_gpt(parallel={"schedule": "gpipe"}), 4, 2, checkpointing=False)
    # all 4 micro batches in flight; the last stage keeps each waiting loss's gradients (its
    # inputs' 64·64·2 and the head's fp32 256·64·4)
    assert [r["in_flight"] for r in ranks] == [4, 4]
    assert [r["parts"]["activations"] for r in ranks] == [4 * 344_064, 4 * 311_296]
    assert ranks[1]["parts"]["logits and loss"] == LOSS + 3 * (64 * 64 * 2 + 256 * 64 * 4) == 491_520
    ranks = stage_memory(small_gpt(), 4, 2, checkpointing=True)
    # checkpointing: 4·sbh per layer input, plus one layer's activations during its recompute
    assert ranks[0]["parts"]["activations"] == 2 * (2 * 16_384 + 16_384) + 163_840 == 262_144
    assert ranks[1]["parts"]["activations"] == (2 * 16_384 - 16_384) + 163_840 == 180_224


@pytest.mark.parametrize("sections", [
    {}, {"model": {"activation_checkpointing": True}}, {"train": {"precision": "fp32"}},
    {"horovod": {"compression": "fp16", "fusion_threshold_mb": 64}},
    {"model": {"arch": "bert"}}, {"model": {"arch": "bert", "activation_checkpointing": True}}])
def test_one_stage_is_the_whole_model(sections):
    cfg = small_gpt(**sections)
    flat = with_stages(cfg, 1)
    ckpt = cfg.model.activation_checkpointing
    (rank,) = stage_memory(flat, 1, 2, ckpt)
    assert rank["parts"] == memory_bytes(cfg, 2, ckpt)["parts"]
    assert rank["flops_per_token"] == pytest.approx(planmod.model_flops_per_token(cfg))


def test_in_flight_per_schedule():
    assert [in_flight("1f1b", 4, 1, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight("gpipe", 4, 1, 8, r) for r in range(4)] == [8] * 4
    # torch's interleaved warm-up: (v-1)·(m/rounds) + 2·(p-1-rank), then one more forward;
    # p=2, v=2, m=4: 2 rounds of 2 -> 2 + 2 + 1 = 5 chunks on rank 0, 2 + 0 + 1 = 3 on rank 1
    assert [in_flight("interleaved1f1b", 2, 2, 4, r) for r in range(2)] == [5, 3]
    assert in_flight("1f1b", 1, 1, 8, 0) == 1  # no pipeline: one micro batch at a time


def test_pipeline_step_time_by_hand():
    # 4 GPUs = 2 stages x 2 copies; global batch 16 = micro 2 x 4 micro batches x 2 copies: one run, m = 4.
    # FLOPs per token: stage 0 6·99,968 + 12·2·64·32 = 648,960; stage 1 6·116,480 + 49,152 = 748,032.
    # At 1 TFLOP/s the slower stage takes 748,032 x 64 tokens x 1e-12 s per micro batch, and a run
    # m + p - 1 = 5 of those slots.
    row = pipeline_plan(small_gpt(), 2, 4, 70 * GIB, net_gbps=100, latency_s=5e-6, spf=1e-12, peak=None)
    slot = 748_032 * 64 * 1e-12
    assert (row["copies"], row["microbatches"], row["runs"]) == (2, 4, 1)
    assert row["bubble"] == pytest.approx(1 / 5)
    assert row["slot_s"] == pytest.approx(slot) and row["compute_s"] == pytest.approx(5 * slot)
    # Stage 0's fp32 gradients, 473,600 B, ring over 2 copies, 28 allreduces (fusion off:
    # 12 tensors x 2 layers + 4), all exposed ("after" is the GPU default)
    comm = 473_600 / 12.5e9 + 28 * 2 * 5e-6
    assert row["reduce"] == "after" and row["exposed_s"] == pytest.approx(comm)
    # the tied embedding's fp32 gradient (256·64·4 B) summed between the two ends
    tied = 65_536 / 12.5e9 + 2 * 5e-6
    assert row["step_s"] == pytest.approx(5 * slot + comm + tied)
    assert row["tokens_per_s"] == pytest.approx(16 * 32 / row["step_s"])
    # reduced during the backward: the last micro batch's 2/3 backward hides part of it
    row = pipeline_plan(small_gpt(parallel={"reduce_gradients": "during"}), 2, 4, 70 * GIB, 100, 5e-6, 1e-12, None)
    assert row["exposed_s"] == pytest.approx(max(comm - 2 / 3 * slot, 0.0))


def test_pipeline_step_time_from_mfu_and_from_a_measured_step():
    cfg = small_gpt(model={"activation_checkpointing": True})
    spf, source = planmod.seconds_per_flop(cfg, 989.0, 0.5, None)
    assert spf == pytest.approx(4 / 3 / (989e12 * 0.5)) and "at 50% of 989 TFLOP/s" in source and "recompute" in source
    # measured: one worker, micro 2 x accum 8 (global 16) in 0.1 s: 512 tokens x model FLOPs per token
    spf, _ = planmod.seconds_per_flop(cfg, 989.0, 0.5, 0.1)
    assert spf == pytest.approx(0.1 / (16 * 32 * planmod.model_flops_per_token(cfg)))


def _pp_plan(gpu_memory_gib, **sections):
    return plan(small_gpt(**sections), gpus=4, gpu="x", gpu_memory_gib=gpu_memory_gib, pp=2)


def test_plan_with_pp_report():
    p = plan(small_gpt(), gpus=4, gpu="H100", pp=2, step_time=0.1)
    pipe = p["pipeline"]
    assert pipe["chosen"]["fits"] and pipe["chosen"]["largest"] == 2_798_848 + GIB
    assert [r["stages"] for r in pipe["rows"] if r["tensor_parallel"] == 1] == [1, 2, 4]
    assert pipe["rows"][2]["copies"] == 1  # 4 stages of one layer each, 16 micro batches per run
    text = planmod.format_plan(p)
    assert "Pipeline: 2 stages x 2 data-parallel copies on 4 GPUs, 1f1b, micro batch 2 x 4 micro batches" in text
    assert "ideal bubble (p-1)/(m+p-1) = 1/(4+1) = 20.0%" in text
    assert "0-1 +emb" in text and "2-3 +head" in text
    assert "Global batch 16 on 4 GPUs in 2 pipeline stages:" in text
    # the configured stages count is the default of --pp
    assert plan(small_gpt(), gpus=4, gpu="H100")["pipeline"]["stages"] == 2
    assert plan(small_gpt(parallel={"pipeline_stages": 1}), gpus=4, gpu="H100")["pipeline"] is None


def test_pp_target_picks_the_most_micro_batches_that_fit():
    # global 64 on 2 copies: 32 samples per copy; micro batch 1 gives m = 32, bubble 1/33
    t = plan(small_gpt(), gpus=4, gpu="H100", pp=2, target_global_batch=64)["target"]
    assert (t["micro_batch"], t["microbatches"], t["checkpointing"]) == (1, 32, False)
    assert t["bubble"] == pytest.approx(1 / 33)
    # a GPU between the two: micro batch 1 fits with checkpointing only
    cfg = with_stages(small_gpt(train={"micro_batch_size": 1, "global_batch_size": 64}), 2)
    without, with_ckpt = (max(r["total"] for r in stage_memory(cfg, 32, 1, ckpt)) for ckpt in (False, True))
    assert with_ckpt < without
    gib = (with_ckpt + without) / 2 / 0.9 / GIB
    t = plan(small_gpt(), gpus=4, gpu="x", gpu_memory_gib=gib, pp=2, target_global_batch=64)["target"]
    assert (t["micro_batch"], t["checkpointing"]) == (1, True)
    t = plan(small_gpt(), gpus=4, gpu="H100", pp=2, target_global_batch=3)["target"]
    assert "not a multiple of 2 data-parallel copies" in t["error"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(gpus=4, pp=0), "--pp: expected an integer >= 1"),
    (dict(gpus=4, pp=3), "--pp: 3 pipeline stages do not divide --gpus 4"),
    (dict(gpus=8, pp=8), "--pp: 8 pipeline stages is more than the model's 4 layers"),
    (dict(gpus=4, pp=2, model_flops_utilisation=0), "--mfu"),
])
def test_pp_rejects_bad_input(kwargs, message):
    with pytest.raises(UserError, match=message):
        plan(small_gpt(), **kwargs)


def test_pp_names_the_config_key_when_the_batch_does_not_split():
    # global 16 on 4 GPUs in 4 stages = 1 copy: 8 micro batches of 2 per run; 2 stages of 2 copies: 4.
    # micro batch 8: 16 / (8 x 2 copies) = 1 micro batch, fewer than the 2 stages
    with pytest.raises(UserError, match=r"^2 pipeline stages on 4 GPUs: parallel.microbatches=1 must be at least "
                                        r"parallel.pipeline_stages=2"):
        plan(small_gpt(train={"micro_batch_size": 8}), gpus=4, pp=2)
    with pytest.raises(UserError, match=r"^2 pipeline stages on 4 GPUs: config key 'train.global_batch_size'"):
        plan(small_gpt(train={"micro_batch_size": 3}), gpus=4, pp=2)
    # stages from the config, not --pp: the key is named
    with pytest.raises(UserError, match=r"^config key 'parallel.pipeline_stages': 2 pipeline stages do not divide "
                                        r"--gpus 3"):
        plan(small_gpt(), gpus=3)


def test_cli_pp(tmp_path, capsys):
    config = tmp_path / "gpt.yaml"
    config.write_text("model: {arch: gpt2, n_layer: 4, n_head: 4, d_model: 64}\n"
                      "data: {seq_len: 32, vocab_size: 256}\n"
                      "train: {micro_batch_size: 2, global_batch_size: 16, precision: bf16}\n")
    assert _cli(["plan", str(config), "--gpus", "4", "--pp", "2", "--mfu", "0.3"]) == 0
    out = capsys.readouterr().out
    assert "Pipeline: 2 stages x 2 data-parallel copies" in out and "at 30% of 989 TFLOP/s, --mfu" in out


def test_cli_shard_optimizer_counts_the_state_over_the_copies_of_each_stage(tmp_path, capsys):
    config = tmp_path / "gpt.yaml"
    config.write_text("model: {arch: gpt2, n_layer: 4, n_head: 4, d_model: 64}\n"
                      "data: {seq_len: 32, vocab_size: 256}\n"
                      "train: {micro_batch_size: 2, global_batch_size: 16, precision: bf16}\n")
    assert _cli(["plan", str(config), "--gpus", "8", "--pp", "2", "--shard-optimizer"]) == 0
    out = capsys.readouterr().out
    assert "master weights (fp32, sharded 1/8)" in out and "optimizer state (adamw, sharded 1/8)" in out
    assert "autocast 16-bit weight copies" not in out


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_stage_params_match_the_real_split(arch):
    """flops.stage_params against the parameters of hvdtrain.parallel.pipeline's real stages, for 2
    stages and for 2 ranks of 2 interleaved stages each."""
    pytest.importorskip("torch")
    from hvdtrain.parallel import parallel_dims, pipeline
    from hvdtrain.config import ModelConfig
    from hvdtrain.models.flops import stage_params
    from hvdtrain.models.common import Vocab, build_model
    import torch

    model_cfg = ModelConfig(arch=arch, n_layer=5, n_head=2, d_model=32)
    vocab = Vocab(size=128, pad_id=0)  # a multiple of 64: the model's rows are the vocabulary
    for stages, per_rank in ((2, 1), (2, 2)):
        bounds = pipeline.stage_bounds(5, stages, per_rank)
        counts = stage_params(arch, 5, 32, 128, 128, 16, bounds)
        for rank in range(stages):
            torch.manual_seed(0)
            layout = parallel_dims.Layout(stages=stages, dp=1, stage=rank, dp_rank=0, stages_per_rank=per_rank)
            stage = pipeline.split_model(build_model(model_cfg, vocab, 16), layout, bounds)
            assert sum(p.numel() for p in stage.parameters()) == sum(counts[g]["params"] for g in layout.stage_ids)


def test_interleaved_plan():
    # 2 ranks x 2 stages: 4 layers + embedding + head in 4 stages of [0, 1, 3, 4, 4] (the head alone
    # on the last); rank 0 runs stages 0 and 2, rank 1 stages 1 and 3. 2 GPUs, one copy: the global
    # batch 16 is 8 micro batches of 2, so (p-1)/(v·m+p-1) = 1/17. In flight, torch's warm-up with
    # 4 rounds of 2: rank 0 (2-1)·2 + 2·1 + 1 = 5 chunks, rank 1 2 + 0 + 1 = 3.
    cfg = small_gpt(parallel={"schedule": "interleaved1f1b", "stages_per_rank": 2})
    p = plan(cfg, gpus=2, gpu="H100")
    chosen = p["pipeline"]["chosen"]
    assert chosen["microbatches"] == 8 and chosen["bubble"] == pytest.approx(1 / 17)
    assert [r["stages"] for r in chosen["ranks"]] == [[0, 2], [1, 3]]
    assert [r["layers"] for r in chosen["ranks"]] == [[(0, 1), (3, 4)], [(1, 3), (4, 4)]]
    assert [r["in_flight"] for r in chosen["ranks"]] == [5, 3]
    assert "ideal bubble (p-1)/(v·m+p-1) = 1/(2 x 8+1) = 5.9%" in planmod.format_plan(p)


def test_the_plan_balances_an_auto_split_on_its_flops():
    """GPT-2 124M's 12 layers on 2 stages with a 64k vocabulary, whose head (and loss) weighs
    about 6 layers in FLOPs: the even split [0, 6, 12] (the head counted as one layer) puts it on
    top of 6 layers; "auto" moves layers to the first stage, and the plan's slowest rank gets
    faster. With a 4k vocabulary the head weighs less than a layer, and both splits agree."""
    def two_stages(vocab: int, bounds):
        tree = {**gpt2_124m(global_batch_size=32).to_dict(), "parallel": {"pipeline_stages": 2, "layer_boundaries": bounds}}
        tree["data"]["vocab_size"] = vocab
        return config_from_dict(tree)

    even, auto = two_stages(64_000, None), two_stages(64_000, "auto")
    assert planmod.planned_bounds(even, 2, 1) == [0, 6, 12]
    bounds = planmod.planned_bounds(auto, 2, 1)
    assert 8 <= bounds[1] <= 10
    rows = {name: pipeline_plan(c, 2, 2, 80 * GIB, 100.0, 5e-6, 1e-15, 989.0) for name, c in (("even", even),
                                                                                             ("auto", auto))}
    assert rows["auto"]["ranks"][0]["layers"] == [(0, bounds[1])]
    assert rows["auto"]["slot_s"] < 0.8 * rows["even"]["slot_s"]
    assert planmod.planned_bounds(two_stages(4096, "auto"), 2, 1) == [0, 6, 12]


# ---------------------------------------------------------------- experts

def olmoe_shaped(e: int, activation_checkpointing: bool = False, shard: str = "none"):
    """OLMoE-1B-7B's shape (recipes/olmoe-1b-7b.yaml): 16 layers x 2048, 64 experts of 1024, top-8."""
    return config_from_dict({
        "model": {"arch": "mixtral", "n_layer": 16, "n_head": 16, "d_model": 2048, "d_ff": 1024, "experts": 64,
                  "experts_per_token": 8, "activation_checkpointing": activation_checkpointing},
        "data": {"seq_len": 4096, "vocab_size": 50304},
        "train": {"micro_batch_size": 4, "global_batch_size": 1024, "precision": "bf16"},
        "parallel": {"expert_parallel": e, "shard": shard},
    })


def test_split_experts_leave_each_worker_its_share_and_an_alltoall():
    """e = 8: a worker keeps 8 of each layer's 64 experts (3 x 2048 x 1024 weights each) and
    the dense weights; its state is 16 B per parameter it holds. The alltoall: per layer and
    micro batch four exchanges of tokens x k bf16 hidden states, 7/8 of them to other ranks;
    six with activation checkpointing (the recomputed forward exchanges again)."""
    whole, split = plan(olmoe_shaped(1), gpus=8), plan(olmoe_shaped(8), gpus=8)
    expert = 3 * 2048 * 1024
    held = whole["model"]["params"] - 16 * 56 * expert
    assert split["experts"]["params_per_worker"] == held
    assert split["memory"]["parts"]["optimizer state (adamw, 2 fp32 moments)"] == 8 * held
    assert split["comm"]["gradient_bytes"] == 4 * held
    assert whole["experts"] is None
    grad_accum = 1024 // 8 // 4
    assert split["experts"]["alltoall_bytes"] == 4 * 16 * grad_accum * (4 * 4096 * 8) * 2048 * 2 * 7 // 8
    recomputed = plan(olmoe_shaped(8, activation_checkpointing=True), gpus=8)["experts"]["alltoall_bytes"]
    assert recomputed == 6 * 16 * grad_accum * (4 * 4096 * 8) * 2048 * 2 * 7 // 8
    assert "Experts split over 8 workers" in planmod.format_plan(split)
    with pytest.raises(UserError, match="--gpus"):
        plan(olmoe_shaped(8), gpus=12)


@pytest.mark.parametrize("level", ["optimizer", "full"])
def test_sharded_split_experts_shard_each_expert_over_the_copies_holding_it(level):
    """parallel.shard over 8 copies with e = 8: each dense weight sharded over all 8 workers, each
    expert weight over the 8 / e = 1 worker holding it, so that a worker's optimizer state is the
    whole model's 1/8, as at e = 1 (memory_bytes and stage_memory alike); with full the block
    gathered whole holds the worker's 8 of each layer's 64 experts."""
    whole, split = olmoe_shaped(1, shard=level), olmoe_shaped(8, shard=level)
    state = "optimizer state (adamw, sharded 1/8)"
    expected = memory_bytes(whole, 4, False, copies=8)["parts"][state]
    assert memory_bytes(split, 4, False, copies=8)["parts"][state] == pytest.approx(expected, rel=1e-6)
    (rank,) = stage_memory(split, 1, 4, False, copies=8)
    assert rank["parts"][state] == pytest.approx(expected, rel=1e-6)
    parts = planmod.parameter_parts(whole)
    assert planmod.largest_unit_params(whole) == parts.layer
    # the head with its 50304 x 2048 output matrix is now the largest unit: a layer is smaller
    head = parts.head + 50304 * 2048
    assert parts.layer - 56 * 3 * 2048 * 1024 < head == planmod.largest_unit_params(split)


def test_fully_sharded_split_experts_in_stages_count_each_stage_s_slices():
    """16 GPUs, p=2 x 8 copies of each stage, e=4, full: a stage holds 8 layers with 16 of each
    layer's 64 experts (their weights sharded over the 8 / 4 = 2 copies holding them) and its
    dense weights (over all 8); its masters, gradient slices and optimizer state are 16 B per
    value it keeps, as the table's weights+grads+optimizer column shows."""
    cfg = olmoe_shaped(4, shard="full")
    p = plan(cfg, gpus=16, pp=2)
    (first, _) = p["pipeline"]["chosen"]["ranks"]
    parts = planmod.parameter_parts(cfg)
    dense = 8 * (parts.layer - parts.experts) + parts.embeddings
    kept = dense // 8 + 8 * parts.experts // 4 // 2
    state = {k: v for k, v in first["parts"].items() if k.startswith(("master", "gradient slices", "optimizer"))}
    assert sum(state.values()) == pytest.approx(16 * kept, rel=1e-6) and len(state) == 3
    row = next(line for line in planmod.format_plan(p).splitlines() if "0-7 +emb" in line)
    assert f"{16 * kept / GIB:.2f} GiB" in row


def test_one_stage_of_split_experts_is_the_plan_s_worker_and_its_slot_carries_the_alltoall():
    """The layout table tune ranks (pipeline_plan, one stage): with e = 8 the rank's memory is
    memory_bytes' (8 of each layer's 64 experts held), and each micro batch's slot gains that
    micro batch's alltoall at the network's bandwidth; the expert sizes tune tries divide the
    experts and the copies."""
    for e in (1, 8):
        cfg = olmoe_shaped(e)
        (rank,) = stage_memory(cfg, 1, 4, False)
        assert rank["params"] == planmod.params_per_worker(cfg)
        assert rank["total"] == memory_bytes(cfg, 4, False)["total"]
    rows = {e: planmod.pipeline_plan(olmoe_shaped(e), 1, 64, 80 * 2 ** 30, 100.0, 0.0, 1e-15, 989.0) for e in (1, 8)}
    alltoall = planmod.alltoall_bytes(olmoe_shaped(8), 4, 1) * 8 / 100e9
    assert rows[8]["slot_s"] == pytest.approx(rows[1]["slot_s"] + alltoall)
    assert planmod.expert_sweep(olmoe_shaped(1), 8) == [1, 2, 4, 8]
    assert planmod.expert_sweep(olmoe_shaped(1), 6) == [1, 2]
    assert planmod.expert_sweep(small_gpt(), 8) == [1]


def llama_shaped(t: int, **model):
    """Llama-like: 4 layers of d 256, 8 heads (2 key/value), bf16, micro batch 2 of 128 tokens,
    global batch 32: the numbers below are worked out from these."""
    return config_from_dict({"model": {"arch": "llama", "n_layer": 4, "n_head": 8, "n_kv_head": 2, "d_model": 256,
                                       "d_ff": 512, **model},
                             "data": {"seq_len": 128, "vocab_size": 1024},
                             "train": {"micro_batch_size": 2, "global_batch_size": 32, "precision": "bf16"},
                             "parallel": {"tensor_parallel": t}})


def test_split_layers_leave_each_worker_its_slices_and_their_allreduces():
    """t = 2 on 8 GPUs: a worker keeps half of every layer (and the whole embeddings and head),
    16 B of state per parameter it holds, allreduces its gradients over the 4 copies; its
    activations inside the split matrices' span halve: a layer keeps (2·2 + 2 + 8)·sbh whole
    and (12·2 + 2)·sbh / 2 split; per layer and micro batch 4 allreduces of s·b·h bf16 values
    within the group, 6 with activation checkpointing."""
    whole, split = plan(llama_shaped(1), gpus=8), plan(llama_shaped(2), gpus=8)
    layer = planmod.parameter_parts(llama_shaped(1)).layer
    held = whole["model"]["params"] - 4 * layer // 2
    assert split["tensor"]["params_per_worker"] == held
    assert split["memory"]["parts"]["optimizer state (adamw, 2 fp32 moments)"] == 8 * held
    assert split["comm"]["gradient_bytes"] == 4 * held and split["comm"]["workers"] == 4
    sbh = 128 * 2 * 256
    assert layer_activation_bytes(128, 2, 256, 8, 2, t=1) == 40 * sbh
    assert layer_activation_bytes(128, 2, 256, 8, 2, t=2) == 14 * sbh + 26 * sbh // 2
    grad_accum = 32 // 4 // 2  # the global batch over 4 copies, micro batches of 2
    x = split["tensor"]
    assert (x["allreduces"], x["bytes"]) == (4 * 4 * grad_accum, 4 * 4 * grad_accum * sbh * 2)
    recomputed = plan(llama_shaped(2, activation_checkpointing=True), gpus=8)["tensor"]
    assert recomputed["allreduces"] == 6 * 4 * grad_accum
    assert x["seconds"] == pytest.approx(x["allreduces"] * ring_allreduce_seconds(sbh * 2, 2, 3600.0, 5e-6))
    assert whole["tensor"] is None
    assert "Layers split over 2 workers" in planmod.format_plan(split)
    with pytest.raises(UserError, match="--gpus"):
        plan(llama_shaped(4, n_kv_head=4), gpus=6)


def test_the_target_step_counts_a_group_s_collectives_and_a_rank_s_share_of_the_flops():
    """`plan --step-time` at a global batch: each micro batch waits for its group's collectives
    (t = 2: 4 allreduces of its hidden states per layer over the group's links; e = 8: its
    alltoalls over the network), as the layout table's one-stage slot does; a rank of a
    tensor-parallel group computes its share of the model's FLOPs, and the group's ranks read
    the same samples (tokens/s counts each once)."""
    whole = plan(llama_shaped(1), gpus=8, step_time=0.2)["target"]
    split = plan(llama_shaped(2), gpus=8, step_time=0.2)["target"]
    # 32 samples over 8 copies (t = 1) or 4 (t = 2): one micro batch of 4 or 8 on each
    assert (whole["micro_batch"], whole["grad_accum"], split["micro_batch"], split["grad_accum"]) == (4, 1, 8, 1)
    share = stage_memory(llama_shaped(2), 1, 8, False)[0]["flops_per_token"] / planmod.model_flops_per_token(llama_shaped(1))
    assert 0.5 < share < 0.6  # the embeddings and head stay whole
    sample_s = 0.2 / 32  # measured: micro batch 2 x accum 16 on one worker
    assert whole["compute_s"] == pytest.approx(4 * sample_s) and whole["group_s"] == 0
    assert split["compute_s"] == pytest.approx(8 * sample_s * share)
    sbh = 128 * 8 * 256
    assert split["group_s"] == pytest.approx(4 * 4 * ring_allreduce_seconds(sbh * 2, 2, 3600.0, 5e-6))
    assert split["step_s"] == pytest.approx(split["compute_s"] + split["group_s"] + split["exposed_s"])
    assert split["tokens_per_s"] == pytest.approx(32 * 128 / split["step_s"])
    recomputed = plan(llama_shaped(2, activation_checkpointing=True), gpus=8, step_time=0.2)["target"]
    assert not recomputed["checkpointing"] and recomputed["group_s"] == pytest.approx(split["group_s"])  # 4, not 6
    # ModernBERT's local attention: at t = 1 a rank computes the measured model's FLOPs, no more
    modernbert = plan(load_config(REPO / "recipes" / "modernbert-tiny.yaml"), gpus=2, step_time=1.0)["target"]
    assert modernbert["compute_s"] == pytest.approx(16 / 32)  # 16 samples; measured: 8 x accum 4 in 1 s
    # weak scaling: the measured (whole) model on every worker, whatever the config splits
    rows = [plan(llama_shaped(t), gpus=8, step_time=0.2)["scaling"]["rows"] for t in (1, 2)]
    assert rows[0] == rows[1]
    experts = plan(olmoe_shaped(8), gpus=8, step_time=20.0)["target"]
    alltoall = planmod.alltoall_bytes(olmoe_shaped(8), experts["micro_batch"], experts["grad_accum"]) * 8 / 100e9
    assert experts["group_s"] == pytest.approx(alltoall) and alltoall > 0
    assert experts["step_s"] == pytest.approx(experts["compute_s"] + alltoall + experts["exposed_s"])
    assert "collectives within tensor- or expert-parallel groups" in planmod.format_plan(plan(olmoe_shaped(8), gpus=8,
                                                                                      step_time=20.0))


def test_a_model_too_large_for_one_gpu_is_told_the_tensor_parallel_ranks_it_needs(capsys):
    """On a GPU between what t=1 and t=2 need at micro batch 1 with checkpointing, the plan
    names t=2 (`--tp 2`) beside the pipeline stages."""
    one = memory_bytes(llama_shaped(1), 1, True, copies=8)["total"]
    two = memory_bytes(llama_shaped(2), 1, True, copies=4)["total"]
    assert two < one
    result = plan(llama_shaped(1), gpus=8, gpu_memory_gib=(one + two) / 2 / planmod.USABLE_FRACTION / GIB)
    assert result["memory"]["tensor_parallel"] == 2
    assert "`--tp 2` plans it" in planmod.format_plan(result)


def test_stage_memory_with_tensor_parallel_ranks_by_hand():
    """t=2: each rank holds half of its stages' layers (49,984 parameters each, norms counted as
    split), the embeddings and head whole; its layers' FLOPs halve."""
    whole = stage_memory(small_gpt(), 4, 2, checkpointing=False)
    split = stage_memory(planmod.with_tensor_parallel(small_gpt(), 2), 4, 2, checkpointing=False)
    assert [r["params"] for r in split] == [118_400 - 49_984, 116_480 - 49_984]
    for a, b in zip(whole, split):
        assert b["parts"]["activations"] < a["parts"]["activations"]
        assert b["flops_per_token"] == pytest.approx(a["flops_per_token"] - 6.0 * 49_984 - 12.0 * 2 * 64 * 32 / 2)


def test_the_fit_table_picks_tensor_parallel_ranks_with_the_stages():
    """GPT-3 175B on 256 x 80 GB: the table holds t = 1, 2, 4, 8 with their stage counts; at the
    same p a larger t holds less per rank and sends the group's allreduces; the fastest layout
    that fits splits the layers (t > 1), and the text names it."""
    cfg = load_config(Path(__file__).resolve().parent.parent / "recipes" / "gpt3-175b.yaml")
    p = plan(cfg, gpus=256, gpu="H100")
    rows = [r for r in p["pipeline"]["rows"] if "error" not in r]
    assert {r["tensor_parallel"] for r in rows} == {1, 2, 4, 8}
    largest = {(r["tensor_parallel"], r["stages"]): r["largest"] for r in rows}
    assert largest[(1, 8)] > largest[(2, 8)] > largest[(4, 8)] > largest[(8, 8)]
    assert all(r["copies"] * r["tensor_parallel"] * r["stages"] == 256 for r in rows)
    fastest = p["pipeline"]["fastest"]
    assert fastest["fits"] and fastest["tensor_parallel"] > 1
    assert fastest["step_s"] == min(r["step_s"] for r in rows if r["fits"])
    text = planmod.format_plan(p)
    assert f"fastest that fits: t={fastest['tensor_parallel']} x p={fastest['stages']}" in text
