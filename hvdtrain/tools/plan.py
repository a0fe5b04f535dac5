"""`hvdtrain plan`: before renting GPUs, will this config fit one GPU, and how will it scale?

    hvdtrain plan CONFIG [key=value ...] --gpus N [--gpu H100] [--net-gbps 100]
                  [--step-time S | --measured RUN_DIR] [--target-global-batch B]
                  [--pp P] [--mfu F]

Four estimates, each plain arithmetic on the config (no torch, no GPU):

1. Memory per GPU. hvdtrain keeps fp32 parameters and runs bf16/fp16 under autocast, so every
   parameter costs 4 B (weights) + 4 B (gradients) + 8 B (AdamW's or LAMB's two fp32 moments),
   in every precision; under autocast add 2 B per matmul weight for the 16-bit copies autocast
   makes and autograd keeps for backward. Activations follow Korthikanti et al. 2022 (below),
   plus the logits, Horovod's fusion buffer and a fixed CUDA overhead. All terms are added as
   if they peaked together, so the total is an upper bound: gradients actually fill up while
   activations are freed during backward.
   With sharding (parallel.shard, or --shard LEVEL; see hvdtrain.parallel.sharded_optimizer)
   over d data-parallel copies (of each stage), `weight_state_bytes`' table: "optimizer" keeps
   fp32 weights 4 + gradients 4 + moments 8/d (8 + 8/d); bf16 computes in bf16 weights
   2 + fp32 gradients 4 + fp32 master slices 4/d + moments 8/d (6 + 12/d), no autocast copies
   (the weights are 16-bit already); the reduced gradient slices take the freed full gradients'
   place, and live beside them only while their reduce-scatters are in flight (at most one
   fusion buffer's worth, divided by d). "gradients" keeps only fp32 gradient slices 4/d
   (4 + 12/d, bf16 2 + 16/d) plus the full gradients in flight (a fusion buffer); "full" the
   master slices too (16/d) plus the units whole at a time (largest_unit_params) and one unit's
   full gradients in flight (`fused_gradient_bytes`). With parallel.expert_parallel = e a
   worker holds 1/e of the experts, each sharded over the d/e copies holding it: its 1/d
   terms are of the dense weights and of all the model's experts.
2. Step time on N GPUs from a measured 1-worker step time and a ring-allreduce model
   (`ring_allreduce_seconds`) overlapped with backward (`exposed_comm_seconds`).
3. The micro batch and accumulation that keep a target global batch on N GPUs, or, when the
   model does not fit even at micro batch 1 with activation checkpointing, how many pipeline
   stages it needs (`stages_needed`).
4. Pipeline stages (`--pp P`, or parallel.pipeline_stages of the config): memory of each
   pipeline rank (`stage_memory`: its layers' parameters and optimizer state under the split
   hvdtrain uses, the activations of the micro batches its schedule keeps in flight, torch's
   receive buffers, the logits on the last stage), the ideal bubble (p-1)/(m+p-1) and the step
   time (m+p-1 slots of the slowest rank's micro batch per schedule run, then the gradient
   allreduce among the copies of a stage and the tied embedding's between first and last), for
   P and for every power of two of stages on N GPUs. The compute time comes from the measured
   step (--step-time / --measured, of the whole model on one worker), else from the GPU's peak
   at an assumed model FLOPs utilisation (--mfu).

The model shape comes from the config (data.vocab_size, model.*); a `model.pretrained`
checkpoint's own shape is not read.
"""
import dataclasses
import math
import statistics
from pathlib import Path
from typing import Optional

from hvdtrain.observe import metrics
from hvdtrain.config import load_config, resolve_batch
from hvdtrain.errors import UserError
from hvdtrain.models import family
from hvdtrain.models.flops import (count_params, find_gpu, flops_params, head_fraction, mfu, model_dims,
                            model_flops_per_token, peak_tflops, stage_params)
from hvdtrain.parallel.pipeline_plan import INTERLEAVED, balanced_bounds, check_schedule, ideal_bubble, stage_bounds

GIB = 2 ** 30
MIB = 2 ** 20

# Share of a GPU's nominal memory the plan fills at most: the caching allocator's fragmentation
# and the memory the driver keeps need the rest.
USABLE_FRACTION = 0.9
# CUDA context, cuBLAS/cuDNN workspaces and NCCL buffers, outside PyTorch's tensors.
CUDA_OVERHEAD_BYTES = 1 * GIB
# Horovod 0.28's HOROVOD_FUSION_THRESHOLD default (horovod/common/operations.cc): one GPU buffer
# of this size into which ready gradients are copied and allreduced together.
HOROVOD_FUSION_DEFAULT_MIB = 128
# Backward is two of the three matmul passes (gradients of inputs and of weights), so ~2/3 of
# the compute; only during it can the allreduce of ready gradients run in the background.
BACKWARD_FRACTION = 2 / 3
# Per-hop latency of one ring step: NCCL over InfiniBand/NVLink is a few microseconds.
DEFAULT_LATENCY_US = 5.0
# The links of a tensor-parallel group (one node): NVLink 4 (H100, H200) carries 450 GB/s each
# way per GPU, what NCCL's allreduce reaches as bus bandwidth within an 8-GPU node.
NVLINK_GBPS = 3600.0
# Activation checkpointing runs each layer's forward again in backward: forward is 1/3 of the
# compute, so the same work takes 4/3 as long.
RECOMPUTE_FACTOR = 4 / 3
# LayerNorm inputs and the checkpointed layer inputs are the residual stream, which stays fp32
# in every precision: weights are fp32, and a 16-bit sublayer output added to it promotes to fp32.
# It is also what pipeline stages send each other (a stage's output is the residual stream).
RESIDUAL_BYTES = 4
# Model FLOPs utilisation a pipeline stage's compute is assumed to reach when no step time was
# measured (--mfu): what well-tuned bf16 GPT training reaches on A100/H100 (Megatron-LM, PaLM: 40-55%).
DEFAULT_MFU = 0.4


# ---------------------------------------------------------------- memory

def _activation_elem(cfg) -> int:
    """Bytes of an activation value: 16-bit under autocast, else fp32."""
    return 4 if cfg.train.precision == "fp32" else 2


def layer_activation_bytes(seq_len: int, micro_batch: int, d_model: int, n_head: int, elem: int,
                           sdpa: bool = True, t: int = 1) -> int:
    """Bytes one transformer layer keeps for backward.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
    §4.1) count, for 16-bit activations and 1-byte dropout masks, s·b·h·(34 + 5·a·s/h):
      attention   11·sbh: QKV input 2, Q and K 4, V 2, output-projection input 2, dropout mask 1;
                  5·a·s²·b: softmax output 2, its dropout mask 1, dropout output 2
      MLP         19·sbh: first linear input 2, GELU input 8, GELU output 8, dropout mask 1
      LayerNorms   4·sbh: two inputs of 2
    Written for an activation element of `elem` bytes (2 under autocast, 4 in fp32) and the
    hvdtrain-specific sizes: LayerNorm inputs are the fp32 residual stream (RESIDUAL_BYTES), and
    autocast runs softmax in fp32. That gives s·b·h·(14·elem + 2 + 2·4) + a·s²·b·(4 + 1 + elem):
    for elem 2: sbh·(38 + 7·a·s/h); for fp32: sbh·(66 + 9·a·s/h), which is Korthikanti's own
    formula with every 16-bit value made 32-bit.

    With SDPA (the default attention of HF GPT-2 and BERT), the fused flash / memory-efficient
    kernels on GPU never materialise the a·s² scores: the a·s²·b term goes; the kernel keeps its
    output (elem·sbh) and a per-row fp32 logsumexp (4·a·s·b, left out as small) instead, and
    regenerates its dropout mask from the RNG state.

    With tensor parallelism over t ranks (parallel.tensor_parallel, without sequence
    parallelism: Korthikanti's sbh·(10 + 24/t + 5·a·s/(h·t))) the values inside the split
    matrices' span divide by t: Q, K, V, the output projection's input, the MLP's 4h-wide
    tensors (12·elem·sbh) and the attention output or scores; the layer's two inputs, the norms'
    fp32 inputs and the dropout masks of the residual branches stay whole.

    tests/test_plan.py checks the count against the tensors HF GPT-2 and BERT layers keep.
    It assumes a fused GELU: BERT's "gelu", and for GPT-2 `activation_function=
    "gelu_pytorch_tanh"`. HF GPT-2's default "gelu_new" is separate elementwise ops whose
    intermediates are kept too: three more 4h-wide fp32 tensors, 48·sbh more bytes per layer.
    """
    sbh = seq_len * micro_batch * d_model
    per_layer = sbh * (2 * elem + 2 + 2 * RESIDUAL_BYTES) + sbh * 12 * elem // t
    if sdpa:
        return per_layer + sbh * elem // t
    return per_layer + n_head * seq_len * seq_len * micro_batch * (4 + 1 + elem) // t


def activation_bytes(cfg, micro_batch: int, checkpointing: bool, sdpa: bool = True) -> int:
    """All layers' activations. With checkpointing only each layer's fp32 input is kept
    (RESIDUAL_BYTES·sbh per layer) and one layer's activations exist at a time, rebuilt during
    its backward. The embedding dropout mask and the final LayerNorm / MLM-head transform
    (a few sbh outside the layers) are left out."""
    s, b, h = cfg.data.seq_len, micro_batch, cfg.model.d_model
    one_layer = layer_activation_bytes(s, b, h, cfg.model.n_head, _activation_elem(cfg), sdpa,
                                       cfg.parallel.tensor_parallel)
    if checkpointing:
        return cfg.model.n_layer * RESIDUAL_BYTES * s * b * h + one_layer
    return cfg.model.n_layer * one_layer


# The logits hvdtrain.models.common's chunked loss computes at a time (its LOSS_CHUNK_ELEMENTS;
# tests/test_plan.py keeps the two equal: this module imports no torch).
LOSS_CHUNK_ELEMENTS = 2 ** 26


def loss_chunk_bytes(cfg, micro_batch: int) -> int:
    """What the chunked loss (models.common.token_loss_sum, also a pipeline's last stage's:
    pipeline.TokenLoss; evaluation's evaluation_sums holds less) allocates beyond the weights
    and their gradients: one chunk of min(positions, LOSS_CHUNK_ELEMENTS / vocabulary) positions' logits in the activation
    precision and their fp32 log-softmax (turned into the logits' gradient in place), under
    autocast also the fp32 copy of the 16-bit logits it is computed from; the fp32 gradient of
    the head's weight accumulated over the chunks (vocabulary x d_model x 4 B; in fp32 in place,
    in 16 bits with one chunk's 16-bit product added to it); the gradient of its inputs, kept
    for backward."""
    elem = _activation_elem(cfg)
    positions = int(micro_batch * cfg.data.seq_len * head_fraction(cfg))
    rows = min(positions, max(1, LOSS_CHUNK_ELEMENTS // cfg.data.vocab_size))
    chunk = rows * cfg.data.vocab_size * (elem + 4 + (4 if elem < 4 else 0))
    grad_w = cfg.data.vocab_size * cfg.model.d_model * (4 + (elem if elem < 4 else 0))
    return chunk + grad_w + positions * cfg.model.d_model * elem


def weight_state_bytes(cfg, n_params: int, matmul_params: float, copies: int = 1, experts: int = 0) -> dict:
    """Bytes by component of the weights, gradients and optimizer state of `n_params`
    parameters (`matmul_params` of them in matmuls), as the module's notes count them, at
    parallel.shard's level over `copies` data-parallel copies (hvdtrain.parallel.sharded_optimizer);
    `experts` of them expert weights, which parallel.expert_parallel = e shards over the copies / e
    holding the same experts (1/d of the dense weights and of all the model's experts: d / e
    shards of each of the e ranks' experts):

        level       fp32 / fp16 (fp32 weights)      bf16 (bf16 weights, fp32 master slices)
        none        16 (+ autocast copies)           16 + autocast copies
        optimizer   8 + 8/d                          6 + 12/d
        gradients   4 + 12/d                         2 + 16/d
        full        16/d + the units in flight       16/d + the units in flight
    """
    opt, level, bf16 = cfg.train.optimizer, cfg.parallel.shard, cfg.train.precision == "bf16"
    if level == "none":
        parts = {"parameters (fp32)": 4 * n_params, "gradients (fp32)": 4 * n_params,
                 f"optimizer state ({opt}, 2 fp32 moments)": 8 * n_params}
        if cfg.train.precision != "fp32":
            # Autocast casts each matmul weight once per forward; the 16-bit copy stays referenced by
            # the autograd graph until backward. Those weights are the 6N parameters (flops_params).
            parts["autocast 16-bit weight copies"] = 2 * int(matmul_params)
        if cfg.horovod.compression == "fp16":
            # Horovod allreduces an fp16 copy of each gradient, made when the gradient is ready.
            parts["fp16-compressed gradients"] = 2 * n_params
        return parts
    in_flight = fused_gradient_bytes(cfg, n_params)
    sharded = f"sharded 1/{copies}"
    per_copy = (n_params - experts) // copies + experts * cfg.parallel.expert_parallel // copies
    parts = {}
    if level == "full":
        # The units whole at a time (sharded_weights), in the weights' dtype: at a unit's hook
        # the one before (until it is freed), this one and its allgather output being copied
        # in, then the next one arriving.
        unit = min(largest_unit_params(cfg), n_params)
        parts["units in flight (full)"] = unit * 4 * (2 if bf16 else 4)
        parts[f"master weights (fp32, {sharded})"] = 4 * per_copy
    elif bf16:
        parts["parameters (bf16)"] = 2 * n_params
        parts[f"master weights (fp32, {sharded})"] = 4 * per_copy
    else:
        parts["parameters (fp32)"] = 4 * n_params  # the master slices are views into them
    if level == "optimizer":  # the step's gradients whole (bf16: summed in fp32), then their slices
        parts["gradients (fp32)"] = 4 * n_params
        parts[f"reduce-scatter outputs in flight (1/{copies} of a fusion buffer)"] = in_flight // copies
    else:  # every micro batch's gradients reduce-scattered into slices that accumulate
        parts[f"gradient slices (fp32, {sharded})"] = 4 * per_copy
        batch = "one unit's" if level == "full" else "a fusion buffer"
        parts[f"full gradients in flight ({batch})"] = in_flight
    parts[f"optimizer state ({opt}, {sharded})"] = 8 * per_copy
    if cfg.train.precision == "fp16" and level != "full":
        parts["autocast 16-bit weight copies"] = 2 * int(matmul_params)
    return parts


def fused_gradient_bytes(cfg, n_params: int) -> int:
    """The full fp32 gradients whose reductions are in flight at a time: a fusion buffer's worth
    (Horovod's default size with fusion off: the reduce-scatters after backward still go in
    buckets), at most all of them; with parallel.shard=full at most one unit's, reduce-scattered
    as the unit's backward ends while the one before it is gathered (measured on the CPU, where
    the fusion buffer is resident only as far as it is written: `bench memory`)."""
    batch = min(fusion_buffer_bytes(cfg) or HOROVOD_FUSION_DEFAULT_MIB * MIB, 4 * n_params)
    if cfg.parallel.shard == "full":
        batch = min(batch, 4 * largest_unit_params(cfg))
    return batch


def parameter_parts(cfg):
    """The family's ParameterCounts of the config's model (a layer, the embeddings, the head)."""
    dims = model_dims(cfg)
    shape = family(dims["arch"]).family_shape(cfg.model)
    return family(dims["arch"]).parameter_counts(dims["d_model"], dims["d_ff"], dims["vocab_size"],
                                                 dims["max_position"], dims["kv_width"], **shape)


def largest_unit_params(cfg) -> int:
    """Parameters of parallel.shard=full's largest unit (hvdtrain.parallel.sharded_weights.units_of):
    a transformer layer (a worker's 1/t of it, with parallel.tensor_parallel = t; its 1/e of the
    experts with parallel.expert_parallel = e), the embeddings, or the head with its output
    matrix (tied or not)."""
    parts, e = parameter_parts(cfg), cfg.parallel.expert_parallel
    return max((parts.layer - parts.experts * (e - 1) // e) // cfg.parallel.tensor_parallel, parts.embeddings,
               parts.head + cfg.data.vocab_size * cfg.model.d_model)


def params_per_worker(cfg) -> int:
    """The parameters one worker holds: the model's, less the experts that
    parallel.expert_parallel = e puts on the other ranks of its expert group ((e-1)/e of them),
    and (parallel.tensor_parallel = t) less (t-1)/t of every layer's: its matrices split over t
    ranks (the layer's norms and row-wise biases, whole on each, are under 0.1% of it and are
    counted as split too)."""
    e, t = cfg.parallel.expert_parallel, cfg.parallel.tensor_parallel
    parts, n_layer = parameter_parts(cfg), cfg.model.n_layer
    return (count_params(**model_dims(cfg)) - n_layer * parts.experts * (e - 1) // e
            - n_layer * parts.layer * (t - 1) // t)


def tensor_parallel_allreduces(cfg, micro_batch: int, grad_accum: int) -> tuple[int, int]:
    """Bytes one worker allreduces within its tensor-parallel group in an optimizer step
    (hvdtrain.parallel.tensor_parallel, Megatron-LM's split without sequence parallelism): per
    layer and micro batch two allreduces of the hidden states in forward (after the attention's
    and the MLP's row-wise projections) and two in backward (the column-wise projections' input
    gradients), two more with activation checkpointing (the forward again), each s·b·h values
    in the activations' dtype. Returns (allreduces, bytes of each)."""
    m = cfg.model
    per_layer = 6 if m.activation_checkpointing else 4
    return per_layer * m.n_layer * grad_accum, micro_batch * cfg.data.seq_len * m.d_model * _activation_elem(cfg)


def alltoall_bytes(cfg, micro_batch: int, grad_accum: int) -> int:
    """Bytes one worker sends to the other ranks of its expert group in an optimizer step
    (hvdtrain.parallel.expert_parallel): per layer and micro batch four alltoalls (the tokens
    to their experts, the results back, and both in backward), six with activation
    checkpointing (backward runs the forward's two again), each of tokens x k hidden states in
    16 bits under bf16/fp16 autocast (the experts' matmuls take and give them so), else fp32, of
    which (e-1)/e leave the rank when the router spreads the tokens evenly."""
    e, m = cfg.parallel.expert_parallel, cfg.model
    shape = family(m.arch).family_shape(m)
    rows = micro_batch * cfg.data.seq_len * shape.get("experts_per_token", 0)
    exchanges = 6 if m.activation_checkpointing else 4
    elem = 4 if cfg.train.precision == "fp32" else 2
    return exchanges * m.n_layer * grad_accum * rows * m.d_model * elem * (e - 1) // e


def group_comm_seconds(cfg, micro_batch: int, share: float, net_gbps: float, tp_gbps: float,
                       latency_s: float) -> float:
    """Seconds one micro batch of `share` of the model's layers waits for the collectives within
    its group, each on the critical path (it waits for its layer's matmuls, and the next
    layer for it): with tensor parallelism the group's allreduces of the hidden states over
    `tp_gbps` (tensor_parallel_allreduces), with expert parallelism its alltoalls over
    `net_gbps` (alltoall_bytes). 0 without either."""
    seconds = share * alltoall_bytes(cfg, micro_batch, 1) * 8 / (net_gbps * 1e9)
    t = cfg.parallel.tensor_parallel
    if t > 1:
        count, each = tensor_parallel_allreduces(cfg, micro_batch, 1)
        seconds += count * share * ring_allreduce_seconds(each, t, tp_gbps, latency_s)
    return seconds


def memory_bytes(cfg, micro_batch: int, checkpointing: bool, sdpa: bool = True, copies: int = 1) -> dict:
    """Bytes per GPU by component, and their "total"; `copies`: the data-parallel workers (what
    a sharded optimizer divides its state by). With parallel.expert_parallel the weights and
    their state are this worker's (params_per_worker)."""
    dims = model_dims(cfg)
    # the matmul weights a worker holds: with parallel.tensor_parallel = t, 1/t of each layer's
    split_off = cfg.model.n_layer * parameter_parts(cfg).layer * (cfg.parallel.tensor_parallel - 1)
    matmul = flops_params(**dims) - split_off // cfg.parallel.tensor_parallel
    experts = cfg.model.n_layer * parameter_parts(cfg).experts // cfg.parallel.expert_parallel
    parts = weight_state_bytes(cfg, params_per_worker(cfg), matmul, copies, experts)
    parts.update({
        "activations": activation_bytes(cfg, micro_batch, checkpointing, sdpa),
        "logits and loss": loss_chunk_bytes(cfg, micro_batch),
        "Horovod fusion buffer": fusion_buffer_bytes(cfg),
        "CUDA context and workspaces": CUDA_OVERHEAD_BYTES,
    })
    return {"parts": parts, "total": sum(parts.values())}


def fusion_buffer_bytes(cfg) -> int:
    """Horovod's tensor-fusion buffer: horovod.fusion_threshold_mb (MiB), or Horovod's default."""
    mib = cfg.horovod.fusion_threshold_mb
    return int((HOROVOD_FUSION_DEFAULT_MIB if mib is None else mib) * MIB)


# ---------------------------------------------------------------- communication and step time

def gradient_bytes(n_params: int, compression: str) -> int:
    """Bytes each worker allreduces per optimizer step: fp32 gradients, or fp16 when Horovod's
    fp16 compression casts them before the allreduce."""
    return n_params * (2 if compression == "fp16" else 4)


def ring_allreduce_seconds(nbytes: float, workers: int, net_gbps: float, latency_s: float,
                           n_allreduces: int = 1) -> float:
    """Ring allreduce (Patarasuk & Yuan 2009; the NCCL / Horovod algorithm): each worker sends
    and receives 2(N-1)/N of the data over its link (reduce-scatter, then all-gather), in
    2(N-1) steps that each pay the link latency. Horovod runs one allreduce per fusion buffer,
    so the latency is paid n_allreduces times. net_gbps is the slowest link of the ring in
    Gbit/s (for GPUs joined by NVLink inside one node, its bandwidth). One worker: no traffic."""
    if workers == 1:
        return 0.0
    bandwidth = net_gbps * 1e9 / 8  # bytes/s
    return 2 * (workers - 1) / workers * nbytes / bandwidth + n_allreduces * 2 * (workers - 1) * latency_s


def exposed_comm_seconds(comm_s: float, tail_s: float, micro_compute_s: float) -> float:
    """Allreduce time that is not hidden behind computation.

    Horovod starts allreducing gradients from backward hooks as soon as they are ready, so the
    allreduce can overlap the backward of the last micro batch (BACKWARD_FRACTION of its
    compute; with gradient accumulation the earlier micro batches do not allreduce). Whatever
    does not fit in that window is exposed. The gradients ready last, the token and position
    embeddings (the token embedding, also the output projection when tied, is the largest
    tensor), complete only when backward ends, so their own allreduce time `tail_s` is exposed
    in any case.
    """
    return max(comm_s - BACKWARD_FRACTION * micro_compute_s, tail_s)


def sharded_exposed(cfg, comm_s: float, tail_s: float, micro_compute_s: float, passes: int = 1) -> float:
    """exposed_comm_seconds, with sharding, for a step of `passes` forward and backward passes
    (micro batches). `comm_s` is the fp32 allreduce's time: its reduce-scatter is one half
    (fp32), its allgather the other, in the weights' dtype (gather_seconds).

        optimizer   the reduce-scatter in the last pass's backward, hidden as the allreduce
                    would be; the allgather after the step, in full view
        gradients   a reduce-scatter in every pass's backward; the allgather after the step
        full        every pass reduce-scatters and gathers each unit twice, before its forward
                    and its backward (prefetched a unit ahead: hidden behind the pass while it
                    lasts); nothing after the step"""
    level = cfg.parallel.shard
    if level == "none":
        return exposed_comm_seconds(comm_s, tail_s, micro_compute_s)
    reduce_s, gather_s = comm_s / 2, gather_seconds(cfg, comm_s)
    if level == "optimizer":
        return exposed_comm_seconds(reduce_s, tail_s / 2, micro_compute_s) + gather_s
    if level == "gradients":
        return passes * exposed_comm_seconds(reduce_s, tail_s / 2, micro_compute_s) + gather_s
    return passes * max(reduce_s + 2 * gather_s - micro_compute_s, tail_s / 2)


def gather_seconds(cfg, comm_s: float) -> float:
    """The allgather of the weights: half the ring of an fp32 allreduce taking `comm_s`, in the
    weights' dtype (sharded_optimizer.on_the_wire: bf16 moves half of fp32's bytes)."""
    return comm_s / 2 * (0.5 if cfg.train.precision == "bf16" else 1.0)


def read_step_time(run_dir: str) -> float:
    """Median seconds per optimizer step of the 1-worker lines of a run's metrics.jsonl
    (`world_size` 1, `time_step`). The median ignores the slow first steps (warm-up,
    compilation). `run_dir` may also be the metrics file itself."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / metrics.FILE_NAME
    times = [float(r["time_step"]) for r in metrics.read_records(path, "--measured")
             if r.get("world_size") == 1 and r.get("time_step") is not None]
    if not times:
        raise UserError(f"--measured: '{path}' has no lines with world_size 1 and time_step; "
                        "measure a 1-worker run or pass --step-time")
    return statistics.median(times)


def _parameter_tensors(arch: str, n_layer: int) -> int:
    """How many parameter tensors the model has: the allreduce count with tensor fusion off."""
    spec = family(arch)
    return spec.tensors_per_layer * n_layer + spec.other_tensors


def step_comm(cfg, workers: int, net_gbps: float, latency_s: float) -> dict:
    """The gradient allreduce of one optimizer step on `workers`: its bytes, how many fused
    allreduces carry them, their seconds, and the seconds of the part that is ready last."""
    dims = model_dims(cfg)
    compression = cfg.horovod.compression
    grad_bytes = gradient_bytes(params_per_worker(cfg), compression)
    fusion_bytes = fusion_buffer_bytes(cfg)
    n_allreduces = (math.ceil(grad_bytes / fusion_bytes) if fusion_bytes > 0
                    else _parameter_tensors(dims["arch"], dims["n_layer"]))
    # The token and position embeddings' gradients are complete only when backward ends.
    tail_bytes = gradient_bytes((dims["vocab_size"] + dims["max_position"]) * dims["d_model"], compression)
    return {"gradient_bytes": grad_bytes, "compression": compression, "allreduces": n_allreduces,
            "workers": workers, "net_gbps": net_gbps, "latency_s": latency_s,
            "seconds": ring_allreduce_seconds(grad_bytes, workers, net_gbps, latency_s, n_allreduces),
            "tail_seconds": ring_allreduce_seconds(tail_bytes, workers, net_gbps, latency_s)}


def predict_step(cfg, comm: dict, micro_compute_s: float, grad_accum: int, micro_group_s: float = 0.0) -> dict:
    """Seconds of one optimizer step: `grad_accum` micro batches of compute, each with
    `micro_group_s` of collectives within its group on its critical path (group_comm_seconds),
    plus the allreduce time (or the sharding level's collectives: sharded_exposed) that backward
    does not hide; efficiency = compute / step (1.0 without communication, and for a fixed
    per-worker batch equal to step(1) / step(N))."""
    micro_s = micro_compute_s + micro_group_s
    exposed = sharded_exposed(cfg, comm["seconds"], comm["tail_seconds"], micro_s, grad_accum)
    compute, group = micro_compute_s * grad_accum, micro_group_s * grad_accum
    step = compute + group + exposed
    return {"comm_s": comm["seconds"], "exposed_s": exposed, "compute_s": compute, "group_s": group,
            "step_s": step, "efficiency": compute / step}


# ---------------------------------------------------------------- pipeline stages

def with_stages(cfg, stages: int):
    """The config with parallel.pipeline_stages = `stages` (its layer_boundaries only when they
    were written for that many stages)."""
    par = cfg.parallel
    keep_bounds = stages == par.pipeline_stages > 1
    return dataclasses.replace(cfg, parallel=dataclasses.replace(
        par, pipeline_stages=stages, stages_per_rank=par.stages_per_rank if stages > 1 else 1,
        layer_boundaries=par.layer_boundaries if keep_bounds else None))


def in_flight(schedule: str, stages: int, stages_per_rank: int, microbatches: int, rank: int) -> int:
    """How many micro batches (interleaved: stage forwards) pipeline rank `rank` keeps the
    activations of at once, at most: forward done, backward not yet. As torch's schedules run:
      gpipe             all m forwards before the first backward: m
      1f1b              p - rank warm-up forwards, then a backward before each further forward
                        (Schedule1F1B): min(m, p - rank), p on the first rank, 1 on the last
      interleaved1f1b   (v-1)·(m / rounds) + 2·(p-1-rank) warm-up forwards (_get_warmup_ops),
                        then a forward before each backward: min(warm-up + 1, v·m)
    Without stages (p = 1) the loop runs one micro batch at a time: 1."""
    if stages == 1:
        return 1
    name = schedule.lower()
    if name == "gpipe":
        return microbatches
    if name in INTERLEAVED:
        rounds = max(1, microbatches // stages)
        warmup = (stages_per_rank - 1) * (microbatches // rounds) + 2 * (stages - 1 - rank)
        return min(warmup + 1, stages_per_rank * microbatches)
    return min(microbatches, stages - rank)


def _boundary_elem(cfg) -> int:
    """Bytes of a value crossing between stages: the residual stream, fp32 under autocast with
    fp32 weights (a 16-bit sublayer output added to it promotes to fp32), bf16 when the weights
    themselves are bf16 (a sharded optimizer in bf16). Measured on GPT-2 and Llama layers."""
    return 2 if cfg.parallel.shard != "none" and cfg.train.precision == "bf16" else RESIDUAL_BYTES


def planned_bounds(cfg, stages: int, stages_per_rank: int) -> list[int]:
    """The split the plan counts: stage_bounds' (the even split, or the one given by hand), and
    for parallel.layer_boundaries "auto" the split a run would balance (pipeline_plan.balanced_bounds)
    on the plan's FLOPs of each piece, where the run measures their times: the embeddings, each
    layer (its matmuls and attention), the head with its loss. A large vocabulary's head weighs
    several layers here too; ModernBERT's global layers weigh as its local ones (the FLOPs count
    does not tell them apart, `flops.model_flops_per_token`)."""
    dims = model_dims(cfg)
    n_layer = dims["n_layer"]
    if cfg.parallel.layer_boundaries != "auto":
        return stage_bounds(n_layer, stages, stages_per_rank, cfg.parallel.layer_boundaries)
    fraction = head_fraction(cfg)
    embeddings, rest = (c["flops_params"] for c in stage_params(**dims, bounds=[0, 0, n_layer], head_fraction=fraction))
    head = stage_params(**dims, bounds=[0, n_layer, n_layer], head_fraction=fraction)[1]["flops_params"]
    layer = 6.0 * (rest - head) / n_layer + 12.0 * dims["d_model"] * cfg.data.seq_len
    costs = [6.0 * embeddings, *[layer] * n_layer, 6.0 * head]
    return balanced_bounds(costs, [0] * (n_layer + 2), stages * stages_per_rank)


def stage_memory(cfg, microbatches: int, micro_batch: int, checkpointing: bool, sdpa: bool = True,
                 copies: int = 1) -> list[dict]:
    """Bytes on each rank of a pipeline of cfg.parallel.pipeline_stages = p ranks running
    cfg.parallel.schedule over `microbatches` = m micro batches per run, by component, as
    memory_bytes counts them for the whole model (with p = 1 the one rank's "total" is
    memory_bytes' total):

    * parameters, gradients, optimizer state and autocast copies of the rank's own stages
      (weight_state_bytes; a sharded optimizer's over the `copies` of each stage):
      the layers of the split (planned_bounds), the embeddings on the first stage, the head and a copy
      of the tied embedding matrix on the last (flops.stage_params);
    * activations of the micro batches in flight (`in_flight`), each the stage's layers as
      activation_bytes counts them (with checkpointing: each layer's fp32 input, plus one
      layer's activations during its recompute), plus the stage's output, which the schedule
      keeps for the backward (not on the last stage); a stage's input is its receive buffer;
    * pipeline receive buffers (pipeline.InFlightStage):
      the received activations of the micro batches in flight (all stages but the first; they
      are the inputs kept for the backward) and one received gradient at a time (all but the
      last), each s·b·d values of the residual stream (fp32; bf16 when the weights are bf16);
    * on the last stage the chunked loss of one micro batch (loss_chunk_bytes, as without
      stages: pipeline.TokenLoss), and with gpipe the gradients that each of the other m-1 micro
      batches' losses keeps until its backward (models.common.LinearCrossEntropySum: its
      inputs' in the activation precision and the output matrix's in fp32);
    * Horovod's fusion buffer and the CUDA overhead, on every rank.

    With parallel.tensor_parallel = t each layer's weights, their state, the activations inside
    its split span (layer_activation_bytes) and its FLOPs are 1/t on each rank of a group
    (the stages' boundaries, embeddings and head are whole). With parallel.expert_parallel = e
    each layer's experts and their state are 1/e on each rank of an expert group; their FLOPs
    are not (each rank runs its experts on the tokens the others send it).

    Each entry: rank, stages (pipeline stage ids), layers ([first, end) per stage), params,
    flops_per_token (the rank's: 6 x its matmul weights and its layers' attention over the whole
    sequence, a family's local windows not counted; its ratio to the unsplit model's is the
    rank's share of model_flops_per_token), in_flight, parts, total."""
    par = cfg.parallel
    p, t = par.pipeline_stages, par.tensor_parallel
    v = par.stages_per_rank if p > 1 else 1
    dims = model_dims(cfg)
    bounds = planned_bounds(cfg, p, v)
    counts = stage_params(**dims, bounds=bounds, head_fraction=head_fraction(cfg))
    matmul_weights = [c["flops_params"] for c in stage_params(**dims, bounds=bounds)]  # all of BERT's head too
    per_layer, e = parameter_parts(cfg), par.expert_parallel
    layer_params, expert_params = per_layer.layer, per_layer.experts

    def split_off(g: int) -> int:  # the parameters of stage g's layers on the group's other ranks
        return counts[g]["layers"] * layer_params * (t - 1) // t

    def experts_elsewhere(g: int) -> int:  # stage g's experts on the other ranks of the expert group
        return counts[g]["layers"] * expert_params * (e - 1) // e
    n = p * v
    s, b, d = cfg.data.seq_len, micro_batch, cfg.model.d_model
    sbh = s * b * d
    boundary = _boundary_elem(cfg) * sbh  # one micro batch's activation (or gradient) between stages
    one_layer = layer_activation_bytes(s, b, d, cfg.model.n_head, _activation_elem(cfg), sdpa, t)
    kept_per_layer = RESIDUAL_BYTES * sbh if checkpointing else one_layer
    logits_positions = b * s * head_fraction(cfg)
    ranks = []
    for r in range(p):
        ids = [r + k * p for k in range(v)]
        mine = [counts[g] for g in ids]
        n_params = sum(counts[g]["params"] - split_off(g) - experts_elsewhere(g) for g in ids)
        k = in_flight(par.schedule, p, v, microbatches, r)

        def per_micro_batch(g: int) -> int:
            layers = counts[g]["layers"]
            kept = layers * kept_per_layer
            if g > 0 and layers:
                kept -= boundary  # the first layer's input is the receive buffer
            if g < n - 1:
                kept += boundary  # the stage's output, kept for its backward
            return kept

        parts = weight_state_bytes(cfg, n_params, sum(matmul_weights[g] - split_off(g) for g in ids), copies,
                                   sum(counts[g]["layers"] * expert_params // e for g in ids))
        activations = k * max(per_micro_batch(g) for g in ids)
        if checkpointing and any(c["layers"] for c in mine):
            activations += one_layer
        parts["activations"] = activations
        if p > 1:
            # pipeline.InFlightStage: a received activation is the kept input of a micro batch in
            # flight (k of them, on every stage but the first); a received gradient lives for one
            # backward (every stage but the last).
            received = (k if any(g > 0 for g in ids) else 0) + sum(g < n - 1 for g in ids)
            parts["pipeline receive buffers"] = received * boundary
        if n - 1 in ids:
            waiting = (microbatches - 1) if par.schedule.lower() == "gpipe" and p > 1 else 0
            kept = int(logits_positions * d * _activation_elem(cfg)) + 4 * cfg.data.vocab_size * d
            parts["logits and loss"] = loss_chunk_bytes(cfg, b) + waiting * kept
        parts["Horovod fusion buffer"] = fusion_buffer_bytes(cfg)
        parts["CUDA context and workspaces"] = CUDA_OVERHEAD_BYTES
        layers = sum(c["layers"] for c in mine)
        ranks.append({"rank": r, "stages": ids, "layers": [(bounds[g], bounds[g + 1]) for g in ids],
                      "params": n_params, "in_flight": k,
                      "flops_per_token": (6.0 * sum(counts[g]["flops_params"] - split_off(g) for g in ids)
                                          + 12.0 * layers * d * s / t),
                      "parts": parts, "total": sum(parts.values())})
    return ranks


def pipeline_batches(cfg, stages: int, gpus: int) -> dict:
    """The batch of `cfg` on `gpus` workers in `stages` pipeline stages: copies (data-parallel
    size: gpus / (stages x parallel.tensor_parallel)), grad_accum, global_batch, microbatches
    per schedule run (parallel.microbatches, default grad_accum) and runs per step. A layout
    hvdtrain would refuse is a UserError."""
    t = cfg.parallel.tensor_parallel
    if gpus % (stages * t):
        raise UserError(f"{stages} pipeline stages x {t} tensor-parallel ranks do not divide {gpus} GPUs")
    c = with_stages(cfg, stages)
    grad_accum, global_batch = resolve_batch(c, gpus)
    m = cfg.parallel.microbatches or grad_accum
    if stages == 1:
        m = grad_accum
    else:
        stage_bounds(cfg.model.n_layer, stages, c.parallel.stages_per_rank, c.parallel.layer_boundaries)
        check_schedule(cfg.parallel.schedule, stages, c.parallel.stages_per_rank, m)
    return {"copies": gpus // (stages * t), "grad_accum": grad_accum, "global_batch": global_batch,
            "microbatches": m, "runs": grad_accum // m}


def unsplit(cfg):
    """The config with the whole model on every worker: one stage, its layers and experts
    unsplit (the measured 1-worker run of `--step-time` and `--measured`; plan's weak scaling)."""
    whole = dataclasses.replace(with_stages(cfg, 1).parallel, tensor_parallel=1, expert_parallel=1)
    return dataclasses.replace(cfg, parallel=whole)


def flops_share(ranks: list[dict], cfg, micro_batch: int, checkpointing: bool, sdpa: bool) -> float:
    """The FLOPs a token of the busiest of `ranks` (stage_memory's rows) as a share of the
    unsplit model's, both from stage_memory's count (model_flops_per_token counts a family's
    local attention windows, which stage_memory's full-sequence count does not: the share
    scales the former)."""
    (whole,) = stage_memory(unsplit(cfg), 1, micro_batch, checkpointing, sdpa)
    return max(r["flops_per_token"] for r in ranks) / whole["flops_per_token"]


def measured_accum(cfg) -> int:
    """Micro batches per step of the measured 1-worker run."""
    return resolve_batch(unsplit(cfg), 1)[0]


def seconds_per_flop(cfg, peak: Optional[float], model_flops_utilisation: float,
                     step_time: Optional[float]) -> tuple[Optional[float], str]:
    """Seconds of compute per model FLOP, and where the figure comes from: the measured
    1-worker step time of this config (`step_time`, recomputation included as configured), or
    the GPU's peak at `model_flops_utilisation`, slowed by 4/3 with activation checkpointing."""
    if step_time is not None:
        tokens = cfg.train.micro_batch_size * measured_accum(cfg) * cfg.data.seq_len
        return step_time / (tokens * model_flops_per_token(cfg)), f"measured 1-worker step {step_time:g} s"
    if peak is None:
        return None, "no GPU peak known: pass --step-time"
    recompute = RECOMPUTE_FACTOR if cfg.model.activation_checkpointing else 1.0
    source = f"a stage computes at {model_flops_utilisation:.0%} of {peak:g} TFLOP/s, --mfu"
    if recompute != 1.0:
        source += ", x4/3 recompute"
    return recompute / (peak * 1e12 * model_flops_utilisation), source


def pipeline_plan(cfg, stages: int, gpus: int, budget: float, net_gbps: float, latency_s: float,
                  spf: Optional[float], peak: Optional[float], sdpa: bool = True, tp_gbps: float = NVLINK_GBPS) -> dict:
    """One layout: `stages` pipeline stages x t tensor-parallel ranks (parallel.tensor_parallel)
    x gpus / (stages x t) copies, at the config's micro batch,
    checkpointing, schedule and batch. `spf`: seconds per model FLOP (seconds_per_flop), None
    for no timing. Memory of every rank, the largest, whether it fits `budget`, the ideal
    bubble and the predicted step:

        compute = runs x (v·m + p - 1) x t / v    t: the slowest rank's forward + backward of one
                                                  micro batch (its FLOPs x spf, and with tensor
                                                  parallelism its layers' allreduces within the
                                                  group over `tp_gbps`, on the critical path:
                                                  tensor_parallel_allreduces; with expert
                                                  parallelism its alltoalls over `net_gbps`,
                                                  as `plan` counts them: alltoall_bytes);
                                                  v stages per rank
        + gradient allreduce among the copies of the slowest-to-reduce rank (ring over the
          copies): all of it exposed when reduced "after" the pipeline's run (the GPU default),
          else what the last micro batch's backward does not hide (exposed_comm_seconds)
        + the tied embedding's fp32 gradient summed between the first and the last stage (p > 1)

    With p = 1 this is the data-parallel step of `plan` (step_comm, predict_step)."""
    c = with_stages(cfg, stages)
    batches = pipeline_batches(cfg, stages, gpus)
    m, v = batches["microbatches"], c.parallel.stages_per_rank
    micro, ckpt = cfg.train.micro_batch_size, cfg.model.activation_checkpointing
    ranks = stage_memory(c, m, micro, ckpt, sdpa, batches["copies"])
    largest = max(ranks, key=lambda r: r["total"])
    row = {"stages": stages, "tensor_parallel": cfg.parallel.tensor_parallel, "stages_per_rank": v,
           "schedule": cfg.parallel.schedule if stages > 1 else None,
           **batches, "micro_batch": micro, "checkpointing": ckpt, "ranks": ranks, "largest_rank": largest["rank"],
           "largest": largest["total"], "fits": largest["total"] <= budget,
           "bubble": ideal_bubble(stages, m, v), "step_s": None}
    if spf is None:
        return row
    # one micro batch on the slowest rank: its share of the model's FLOPs
    slot = flops_share(ranks, cfg, micro, ckpt, sdpa) * model_flops_per_token(cfg) * micro * cfg.data.seq_len * spf
    share = max(sum(end - first for first, end in r["layers"]) for r in ranks) / cfg.model.n_layer  # its layers
    slot += group_comm_seconds(cfg, micro, share, net_gbps, tp_gbps, latency_s)
    compute = batches["runs"] * (v * m + stages - 1) * slot / v
    if stages == 1:
        comm = step_comm(c, batches["copies"], net_gbps, latency_s)
        exposed = sharded_exposed(cfg, comm["seconds"], comm["tail_seconds"], slot, batches["grad_accum"])
        tied = 0.0
        comm_s, mode = comm["seconds"], "during"
    else:
        mode = cfg.parallel.reduce_gradients or "after"
        fusion = fusion_buffer_bytes(cfg)
        comm_s = 0.0
        for r in ranks:
            nbytes = gradient_bytes(r["params"], cfg.horovod.compression)
            tensors = family(cfg.model.arch).tensors_per_layer
            n_allreduces = (math.ceil(nbytes / fusion) if fusion > 0
                            else tensors * sum(e - b for b, e in r["layers"]) + 4)
            comm_s = max(comm_s, ring_allreduce_seconds(nbytes, batches["copies"], net_gbps, latency_s, n_allreduces))
        passes = batches["grad_accum"]
        if mode == "during":
            exposed = sharded_exposed(cfg, comm_s, 0.0, slot, passes)
        elif c.parallel.shard == "full":  # reduced after the run; the units gathered for every pass
            exposed = comm_s / 2 + passes * max(2 * gather_seconds(cfg, comm_s) - slot, 0.0)
        else:
            exposed = comm_s
        tied = (ring_allreduce_seconds(4 * cfg.data.vocab_size * cfg.model.d_model, 2, net_gbps, latency_s)
                if model_dims(cfg)["tied_embeddings"] else 0.0)  # untied (Llama 3 8B): nothing to sum
    step = compute + exposed + tied
    tokens_per_s = batches["global_batch"] * cfg.data.seq_len / step
    row.update(slot_s=slot, compute_s=compute, comm_s=comm_s, exposed_s=exposed, tied_s=tied, reduce=mode,
               step_s=step, tokens_per_s=tokens_per_s,
               mfu=mfu(tokens_per_s, model_flops_per_token(cfg), peak * gpus) if peak else None)
    return row


def tensor_sweep(cfg, gpus: int) -> list[int]:
    """The tensor-parallel sizes to compare on `gpus` GPUs: the configured one, and 1, 2, 4 and 8
    (a group within one node) where the family splits its layers and t divides the heads, the
    key/value heads and `gpus`."""
    m, options = cfg.model, {1, cfg.parallel.tensor_parallel}
    if family(m.arch).splits_layers:
        options |= {t for t in (2, 4, 8) if gpus % t == 0 and m.n_head % t == 0 and (m.n_kv_head or m.n_head) % t == 0}
    return sorted(options)


def expert_sweep(cfg, copies: int) -> list[int]:
    """The expert-parallel sizes to compare over `copies` data-parallel copies: 1, and for a
    family with experts the configured e and 2, 4 and 8 where e divides the experts and the
    copies (an expert group is made of copies)."""
    experts = family(cfg.model.arch).family_shape(cfg.model).get("experts")
    if not experts:
        return [1]
    return sorted(e for e in {1, cfg.parallel.expert_parallel, 2, 4, 8} if copies % e == 0 and experts % e == 0)


def with_tensor_parallel(cfg, t: int):
    """The config with parallel.tensor_parallel = `t`."""
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tensor_parallel=t))


def stage_sweep(cfg, gpus: int, chosen: int) -> list[int]:
    """The stage counts to compare on `gpus` GPUs: 1 and every power of two that divides
    `gpus` and that the model's layers allow, and `chosen`."""
    v = max(1, cfg.parallel.stages_per_rank)
    options = {2 ** k for k in range(gpus.bit_length()) if gpus % 2 ** k == 0} | {1, chosen}
    return sorted(p for p in options if p == 1 or p * v <= cfg.model.n_layer)


def stages_needed(cfg, budget: float, sdpa: bool = True, gpus: int = 1) -> Optional[int]:
    """The fewest pipeline stages p (>= 2) whose largest rank fits `budget` at the least memory
    the config allows: micro batch 1, activation checkpointing, m = p micro batches per run (the
    fewest, so the fewest receive buffers), the config's schedule. None when even one layer per
    stage does not fit."""
    v = cfg.parallel.stages_per_rank if cfg.parallel.schedule.lower() in INTERLEAVED else 1
    base = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, stages_per_rank=v,
                                                                 layer_boundaries=None))
    for p in range(2, cfg.model.n_layer // v + 1):
        ranks = stage_memory(with_stages(base, p), p, 1, True, sdpa, max(1, gpus // p))
        if max(r["total"] for r in ranks) <= budget:
            return p
    return None


# ---------------------------------------------------------------- the plan

def plan(cfg, gpus: int, gpu: str = "H100", net_gbps: float = 100.0, step_time: Optional[float] = None,
         target_global_batch: Optional[int] = None, latency_us: float = DEFAULT_LATENCY_US,
         gpu_memory_gib: Optional[float] = None, sdpa: bool = True, pp: Optional[int] = None,
         model_flops_utilisation: float = DEFAULT_MFU, tp_gbps: float = NVLINK_GBPS) -> dict:
    """Every number of the plan, in a dict (bytes, seconds, FLOPs). `step_time`: measured seconds
    per optimizer step of this config on one worker. `target_global_batch`: defaults to
    train.global_batch_size. `gpu_memory_gib` overrides the memory of the `gpu` table entry
    (and allows GPUs the table lacks). `pp`: pipeline stages to plan (default
    parallel.pipeline_stages when above 1); `model_flops_utilisation`: what a stage's compute
    reaches of the GPU's peak when no step time is given. With parallel.tensor_parallel = t the
    gpus / t copies are the data-parallel workers, and the group's allreduces run over links of
    `tp_gbps` (one node's NVLink by default)."""
    _check(gpus >= 1, "--gpus", "an integer >= 1", gpus)
    _check(pp is None or pp >= 1, "--pp", "an integer >= 1", pp)
    _check(0 < model_flops_utilisation <= 1, "--mfu", "a number in (0, 1]", model_flops_utilisation)
    _check(net_gbps > 0, "--net-gbps", "a number > 0", net_gbps)
    _check(tp_gbps > 0, "--tp-gbps", "a number > 0", tp_gbps)
    t = cfg.parallel.tensor_parallel
    _check(gpus % t == 0, "--gpus", f"a multiple of parallel.tensor_parallel ({t})", gpus)
    copies = gpus // t  # the data-parallel workers: each holds one slice of every layer
    _check(latency_us >= 0, "--latency-us", "a number >= 0", latency_us)
    _check(step_time is None or step_time > 0, "--step-time", "a number > 0", step_time)
    _check(gpu_memory_gib is None or gpu_memory_gib > 0, "--gpu-memory", "a number > 0", gpu_memory_gib)
    _check(target_global_batch is None or target_global_batch >= 1, "--target-global-batch",
           "an integer >= 1", target_global_batch)
    spec = find_gpu(gpu)
    if spec is None and gpu_memory_gib is None:
        raise UserError(f"--gpu: unknown GPU '{gpu}'; pass its memory with --gpu-memory GIB")
    memory_gib = gpu_memory_gib if gpu_memory_gib is not None else spec.memory_gib
    peak, peak_source = peak_tflops(gpu, cfg.train.precision)

    dims = model_dims(cfg)
    model = {**dims, "n_head": cfg.model.n_head, "seq_len": cfg.data.seq_len, "params": count_params(**dims),
             "flops_params": flops_params(**dims, head_fraction=head_fraction(cfg)),
             "flops_per_token": model_flops_per_token(cfg)}
    memory = _memory_plan(cfg, spec.name if spec else gpu, memory_gib, sdpa, copies)
    comm = step_comm(cfg, copies, net_gbps, latency_us * 1e-6)
    stages = pp if pp is not None else cfg.parallel.pipeline_stages
    if stages > 1:
        _check_stages(cfg, stages, gpus, "--pp" if pp is not None else "config key 'parallel.pipeline_stages'")
    flat = with_stages(cfg, 1)  # the data-parallel estimates below: one stage on every worker
    whole_model = unsplit(cfg)  # ... its layers and experts unsplit too: the measured run's

    def with_throughput(row: dict, workers: int, samples_per_step: int) -> dict:
        row["tokens_per_s"] = samples_per_step * cfg.data.seq_len / row["step_s"]
        row["mfu"] = mfu(row["tokens_per_s"], model["flops_per_token"], peak * workers) if peak else None
        return row

    # Weak scaling: the measured 1-worker run (the whole model, micro x accum) on every worker.
    scaling = None
    micro = cfg.train.micro_batch_size
    if step_time is not None:
        accum_1 = measured_accum(cfg)
        rows = []
        for n in sorted({2 ** k for k in range(gpus.bit_length())} | {gpus}):
            row = predict_step(whole_model, step_comm(whole_model, n, net_gbps, latency_us * 1e-6),
                               step_time / accum_1, accum_1)
            rows.append(with_throughput({"gpus": n, **row}, n, n * micro * accum_1))
        scaling = {"step_time_1": step_time, "micro_batch": micro, "grad_accum": accum_1, "rows": rows}

    # A fixed global batch on `gpus` workers: the largest micro batch that fits.
    target = None
    global_batch = target_global_batch if target_global_batch is not None else cfg.train.global_batch_size
    if global_batch is not None:
        target = {"global_batch": global_batch, "gpus": gpus, "copies": copies}
        per_gpu, remainder = divmod(global_batch, copies)
        choice = None if remainder else _largest_micro_batch(cfg, per_gpu, memory["budget"], sdpa, copies)
        if remainder:
            target["error"] = f"global batch {global_batch} is not a multiple of {copies} data-parallel copies"
        elif choice is None:
            target["error"] = "does not fit at micro batch 1 even with activation checkpointing"
        else:
            m, ckpt, total = choice
            target.update(micro_batch=m, grad_accum=per_gpu // m, checkpointing=ckpt, total=total)
            if step_time is not None:
                # Compute scales with the samples per micro batch (optimistic for small micro
                # batches, which use the GPU less well), with recomputation, and with a rank's
                # share of the whole model's FLOPs (1/t of each layer's with tensor parallelism).
                share = flops_share(stage_memory(flat, 1, m, ckpt, sdpa, copies), cfg, m, ckpt, sdpa)
                per_sample_s = step_time / (micro * accum_1) * share
                if ckpt != cfg.model.activation_checkpointing:
                    per_sample_s *= RECOMPUTE_FACTOR if ckpt else 1 / RECOMPUTE_FACTOR
                chosen = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, activation_checkpointing=ckpt))
                group_s = group_comm_seconds(chosen, m, 1.0, net_gbps, tp_gbps, latency_us * 1e-6)
                target.update(with_throughput(predict_step(cfg, comm, per_sample_s * m, per_gpu // m, group_s),
                                              gpus, global_batch))

    pipeline = None
    if stages > 1:
        pipeline = _pipeline_section(cfg, stages, gpus, memory["budget"], net_gbps, latency_us * 1e-6, step_time,
                                     peak, model_flops_utilisation, global_batch, sdpa, tp_gbps)
        target = pipeline.pop("target")

    experts = None
    if cfg.parallel.expert_parallel > 1:
        _check(gpus % cfg.parallel.expert_parallel == 0, "--gpus", f"a multiple of parallel.expert_parallel "
               f"({cfg.parallel.expert_parallel})", gpus)
        nbytes = alltoall_bytes(cfg, micro, resolve_batch(flat, gpus)[0])
        experts = {"e": cfg.parallel.expert_parallel, "experts": family(cfg.model.arch).family_shape(cfg.model)["experts"],
                   "params_per_worker": params_per_worker(cfg), "alltoall_bytes": nbytes,
                   "alltoall_s": nbytes * 8 / (net_gbps * 1e9)}

    tensor = None
    if t > 1:
        count, each = tensor_parallel_allreduces(cfg, micro, resolve_batch(flat, gpus)[0])
        tensor = {"t": t, "copies": copies, "params_per_worker": params_per_worker(cfg), "allreduces": count,
                  "bytes": count * each, "gbps": tp_gbps,
                  "seconds": count * ring_allreduce_seconds(each, t, tp_gbps, latency_us * 1e-6)}

    return {"model": model, "precision": cfg.train.precision, "optimizer": cfg.train.optimizer,
            "peak_tflops": peak, "peak_source": peak_source, "memory": memory, "comm": comm,
            "gpus": gpus, "scaling": scaling, "target": target, "pipeline": pipeline, "experts": experts,
            "tensor": tensor}


def _check_stages(cfg, stages: int, gpus: int, source: str):
    v = cfg.parallel.stages_per_rank
    if gpus % stages:
        raise UserError(f"{source}: {stages} pipeline stages do not divide --gpus {gpus}")
    if stages * v > cfg.model.n_layer:
        raise UserError(f"{source}: {stages} pipeline stages" + (f" x parallel.stages_per_rank={v}" if v > 1 else "")
                        + f" is more than the model's {cfg.model.n_layer} layers (model.n_layer)")


def _pipeline_section(cfg, stages: int, gpus: int, budget: float, net_gbps: float, latency_s: float,
                      step_time: Optional[float], peak: Optional[float], model_flops_utilisation: float,
                      global_batch: Optional[int], sdpa: bool, tp_gbps: float = NVLINK_GBPS) -> dict:
    """`stages` pipeline stages on `gpus` GPUs: the layout as configured (every rank), the other
    tensor-parallel sizes and stage counts (`tensor_sweep`, `stage_sweep`) with the fastest that
    fits, and, for a global batch, the micro batch to use (`_pipeline_micro_batch`)."""
    spf, time_source = seconds_per_flop(cfg, peak, model_flops_utilisation, step_time)
    try:
        chosen = pipeline_plan(cfg, stages, gpus, budget, net_gbps, latency_s, spf, peak, sdpa, tp_gbps)
    except UserError as e:
        raise UserError(f"{stages} pipeline stages on {gpus} GPUs: {e}") from None
    rows = []
    for t in tensor_sweep(cfg, gpus):
        split = with_tensor_parallel(cfg, t)
        for p in stage_sweep(cfg, gpus // t, stages):
            if t != cfg.parallel.tensor_parallel and (gpus // t) % p:  # the configured p, not one of t's layouts
                continue
            if (t, p) == (cfg.parallel.tensor_parallel, stages):
                rows.append(chosen)
                continue
            try:
                rows.append(pipeline_plan(split, p, gpus, budget, net_gbps, latency_s, spf, peak, sdpa, tp_gbps))
            except UserError as e:
                rows.append({"stages": p, "tensor_parallel": t, "error": str(e)})
    timed = [r for r in rows if "error" not in r and r["fits"] and r["step_s"] is not None]
    fastest = min(timed, key=lambda r: r["step_s"]) if timed else None
    target = None
    if global_batch is not None:
        target = {"global_batch": global_batch, "gpus": gpus, "stages": stages}
        copies = gpus // (stages * cfg.parallel.tensor_parallel)
        per_copy, remainder = divmod(global_batch, copies)
        choice = None if remainder else _pipeline_micro_batch(cfg, stages, per_copy, budget, sdpa, copies)
        if remainder:
            target["error"] = f"global batch {global_batch} is not a multiple of {copies} data-parallel copies"
        elif choice is None:
            target["error"] = (f"no micro batch fits {stages} stages with at least {stages} micro batches per run, "
                               "even with activation checkpointing")
        else:
            micro, ckpt = choice
            c = dataclasses.replace(
                cfg, train=dataclasses.replace(cfg.train, micro_batch_size=micro, global_batch_size=global_batch),
                model=dataclasses.replace(cfg.model, activation_checkpointing=ckpt))
            target_spf = spf
            if spf is not None and ckpt != cfg.model.activation_checkpointing:
                target_spf *= RECOMPUTE_FACTOR if ckpt else 1 / RECOMPUTE_FACTOR
            row = pipeline_plan(c, stages, gpus, budget, net_gbps, latency_s, target_spf, peak, sdpa, tp_gbps)
            target.update({k: row[k] for k in ("micro_batch", "grad_accum", "microbatches", "runs", "copies",
                                               "checkpointing", "largest", "bubble", "step_s")})
            if row["step_s"] is not None:
                target.update(tokens_per_s=row["tokens_per_s"], mfu=row["mfu"])
    return {"stages": stages, "time_source": time_source, "chosen": chosen, "rows": rows, "fastest": fastest,
            "target": target}


def _pipeline_micro_batch(cfg, stages: int, per_copy: int, budget: float, sdpa: bool,
                          copies: int = 1) -> Optional[tuple[int, bool]]:
    """(micro batch, checkpointing) for the `per_copy` samples of a step in `stages` stages: the
    smallest divisor that fits, so the most micro batches per run and the smallest bubble
    (p-1)/(m+p-1), without activation checkpointing if any fits. Smaller micro batches use a
    GPU less well, which the plan does not model; the receive buffers, one per micro batch, can
    make the smallest one the one that does not fit."""
    c = with_stages(cfg, stages)
    for ckpt in (False, True):
        for micro in (d for d in range(1, per_copy + 1) if per_copy % d == 0):
            accum = per_copy // micro
            m = cfg.parallel.microbatches or accum
            if accum % m:
                continue
            try:
                check_schedule(cfg.parallel.schedule, stages, c.parallel.stages_per_rank, m)
            except UserError:
                continue
            if max(r["total"] for r in stage_memory(c, m, micro, ckpt, sdpa, copies)) <= budget:
                return micro, ckpt
    return None


def _memory_plan(cfg, gpu_name: str, memory_gib: float, sdpa: bool, gpus: int = 1) -> dict:
    """Memory at the configured micro batch: the breakdown with checkpointing as configured,
    the totals both ways, and at micro batch 1 with checkpointing, the least this config needs."""
    budget = USABLE_FRACTION * memory_gib * GIB
    micro, checkpointing = cfg.train.micro_batch_size, cfg.model.activation_checkpointing
    configured = memory_bytes(cfg, micro, checkpointing, sdpa, gpus)
    parts = configured["parts"]
    fixed = parts["Horovod fusion buffer"] + parts["CUDA context and workspaces"]
    if budget <= fixed:
        raise UserError(f"--gpu-memory: {memory_gib:g} GiB leaves no room beyond the fixed "
                        f"{fixed / GIB:.2f} GiB overhead")
    smallest = memory_bytes(cfg, 1, True, sdpa, gpus)["total"]
    return {"gpu": gpu_name, "gpu_memory_gib": memory_gib, "budget": budget, "micro_batch": micro,
            "checkpointing": checkpointing, "sdpa": sdpa, "parts": parts, "total": configured["total"],
            "fits": configured["total"] <= budget,
            "total_without_checkpointing": memory_bytes(cfg, micro, False, sdpa, gpus)["total"],
            "total_with_checkpointing": memory_bytes(cfg, micro, True, sdpa, gpus)["total"],
            "smallest_total": smallest,
            "pipeline_stages": stages_needed(cfg, budget, sdpa, gpus) if smallest > budget else None,
            "tensor_parallel": tensor_parallel_needed(cfg, budget, sdpa, gpus) if smallest > budget else None}


def tensor_parallel_needed(cfg, budget: float, sdpa: bool = True, gpus: int = 1) -> Optional[int]:
    """The fewest tensor-parallel ranks t (2, 4 or 8: within one node; dividing the heads, the
    key/value heads and --gpus) with which micro batch 1 with activation checkpointing fits
    `budget`; None when none does (or the family is not split)."""
    for t in tensor_sweep(cfg, gpus):
        if t > cfg.parallel.tensor_parallel and memory_bytes(with_tensor_parallel(cfg, t), 1, True, sdpa,
                                                             gpus // t)["total"] <= budget:
            return t
    return None


def _largest_micro_batch(cfg, per_gpu: int, budget: float, sdpa: bool,
                         gpus: int = 1) -> Optional[tuple[int, bool, int]]:
    """(micro batch, checkpointing, total bytes): the largest divisor of `per_gpu` that fits,
    without activation checkpointing if any does (no recomputation), else with it."""
    for ckpt in (False, True):
        for m in sorted((d for d in range(1, per_gpu + 1) if per_gpu % d == 0), reverse=True):
            total = memory_bytes(cfg, m, ckpt, sdpa, gpus)["total"]
            if total <= budget:
                return m, ckpt, total
    return None


def _check(ok: bool, name: str, expected: str, value):
    if not ok:
        raise UserError(f"{name}: expected {expected}, got {value!r}")


# ---------------------------------------------------------------- output

def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB"


def format_plan(p: dict) -> str:
    """The plan as a plain-text report."""
    m, mem, comm = p["model"], p["memory"], p["comm"]
    ckpt_word = "on" if mem["checkpointing"] else "off"
    lines = [
        f"Model: {m['arch']}, {m['n_layer']} layers, d_model {m['d_model']}, {m['n_head']} heads, "
        f"d_ff {m['d_ff']}, vocab {m['vocab_size']}, seq_len {m['seq_len']}",
        f"  parameters        {m['params']:,} ({m['flops_params']:,.0f} in matmuls per token, the N of 6N)",
        f"  training FLOPs    {m['flops_per_token'] / 1e9:.3f} GFLOP/token (6N + 12·L·d·T)",
        "",
        f"Memory per GPU: {mem['gpu']} {mem['gpu_memory_gib']:g} GiB, plan within {_gib(mem['budget'])} "
        f"({USABLE_FRACTION:.0%}); {p['precision']}, {p['optimizer']}, micro batch {mem['micro_batch']}, "
        f"activation checkpointing {ckpt_word}, {'SDPA' if mem['sdpa'] else 'eager'} attention",
    ]
    lines += [f"  {name:<46} {_gib(value):>12}" for name, value in mem["parts"].items()]
    verdict = "fits" if mem["fits"] else "DOES NOT FIT"
    lines.append(f"  {'total':<46} {_gib(mem['total']):>12}  {verdict}")
    lines.append(f"  (checkpointing off: {_gib(mem['total_without_checkpointing'])}, "
                 f"on: {_gib(mem['total_with_checkpointing'])})")
    if mem["smallest_total"] > mem["budget"]:
        if mem["pipeline_stages"]:
            needed = mem["pipeline_stages"]
            split = mem["tensor_parallel"]
            lines.append(f"  Even micro batch 1 with activation checkpointing needs {_gib(mem['smallest_total'])} "
                         f"on one GPU: this model needs at least {needed} pipeline stages "
                         f"(parallel.pipeline_stages; `--pp {needed}` plans them)"
                         + (f", or its layers split over {split} GPUs (parallel.tensor_parallel; `--tp {split}` plans "
                            f"it)" if split else "") + ", or a GPU with more memory.")
        else:
            lines.append(f"  Even micro batch 1 with activation checkpointing needs {_gib(mem['smallest_total'])} "
                         f"on one GPU, and with one layer per pipeline stage the largest stage still does not fit.")

    grad_dtype = "fp16" if comm["compression"] == "fp16" else "fp32"
    lines += ["", f"Gradient allreduce per optimizer step: {comm['gradient_bytes'] / 1e6:,.1f} MB "
              f"({grad_dtype}) in {comm['allreduces']} fused allreduce(s), ring over {comm['net_gbps']:g} Gbit/s, "
              f"{comm['latency_s'] * 1e6:g} µs per hop: {comm['seconds'] * 1e3:.1f} ms on {comm['workers']} "
              f"{'GPUs' if comm['workers'] == p['gpus'] else 'data-parallel copies'}"]
    x = p["experts"]
    if x is not None:
        lines += [f"Experts split over {x['e']} workers (parallel.expert_parallel): {x['experts'] // x['e']} of each "
                  f"layer's {x['experts']} on each, {x['params_per_worker']:,} parameters per worker; alltoall "
                  f"{x['alltoall_bytes'] / 1e9:,.1f} GB sent per worker per optimizer step (tokens to their "
                  f"experts and back, forward and backward): {x['alltoall_s']:.2f} s at "
                  f"{comm['net_gbps']:g} Gbit/s, not overlapped"]
    x = p["tensor"]
    if x is not None:
        lines += [f"Layers split over {x['t']} workers (parallel.tensor_parallel), {x['copies']} data-parallel copies: "
                  f"{x['params_per_worker']:,} parameters per worker; {x['allreduces']:,} allreduces of the hidden "
                  f"states per optimizer step within the group ({x['bytes'] / 1e9:,.1f} GB): {x['seconds']:.3f} s "
                  f"at {x['gbps']:g} Gbit/s, on the critical path (each waits for its layer's matmul)"]

    peak = f"{p['peak_tflops']:g} TFLOP/s ({p['peak_source']})" if p["peak_tflops"] else p["peak_source"]
    s = p["scaling"]
    if s is None:
        lines.append("  Step time and scaling: pass --step-time SECONDS or --measured RUN_DIR (a 1-worker run).")
    else:
        lines += ["", f"Scaling with the whole model and micro batch {s['micro_batch']} x grad_accum {s['grad_accum']} "
                  f"on every worker (1-worker step {s['step_time_1']:.3f} s); MFU against {peak}",
                  f"  {'GPUs':>5} {'step s':>9} {'allreduce s':>12} {'exposed s':>10} {'efficiency':>11} "
                  f"{'tokens/s':>12} {'MFU':>6}"]
        for r in s["rows"]:
            mfu_text = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
            lines.append(f"  {r['gpus']:>5} {r['step_s']:>9.3f} {r['comm_s']:>12.4f} {r['exposed_s']:>10.4f} "
                         f"{r['efficiency']:>11.1%} {r['tokens_per_s']:>12,.0f} {mfu_text:>6}")
        if s["rows"][0]["mfu"] is not None and s["rows"][0]["mfu"] > 1:
            lines.append("  warning: this step time means more than the GPU's peak throughput; was it measured "
                         f"for micro batch {s['micro_batch']} x grad_accum {s['grad_accum']} of this model?")

    if p["pipeline"] is not None:
        lines += [""] + _format_pipeline(p)

    t = p["target"]
    if t is not None and "stages" in t:
        lines += ["", f"Global batch {t['global_batch']} on {t['gpus']} GPUs in {t['stages']} pipeline stages:"]
        if "error" in t:
            lines.append(f"  {t['error']}")
        else:
            lines.append(f"  micro batch {t['micro_batch']} x {t['microbatches']} micro batches per run x {t['runs']} "
                         f"run(s) x {t['copies']} copies, activation checkpointing "
                         f"{'on' if t['checkpointing'] else 'off'}: largest stage {_gib(t['largest'])}, "
                         f"ideal bubble {t['bubble']:.1%}")
            if t["step_s"] is not None:
                mfu_text = f", MFU {t['mfu']:.1%}" if t.get("mfu") is not None else ""
                lines.append(f"  predicted step {t['step_s']:.3f} s, {t['tokens_per_s']:,.0f} tokens/s{mfu_text}")
    elif t is not None:
        lines += ["", f"Global batch {t['global_batch']} on {t['gpus']} GPUs:"]
        if "error" in t:
            lines.append(f"  {t['error']}")
        else:
            lines.append(f"  micro batch {t['micro_batch']} x grad_accum {t['grad_accum']} x {t['copies']} "
                         f"{'GPUs' if t['copies'] == t['gpus'] else 'data-parallel copies'}, "
                         f"activation checkpointing {'on' if t['checkpointing'] else 'off'}: "
                         f"{_gib(t['total'])} per GPU")
            if "step_s" in t:
                group = (f" (of which {t['group_s']:.3f} s the collectives within tensor- or expert-parallel groups)"
                         if t["group_s"] else "")
                lines.append(f"  predicted step {t['step_s']:.3f} s{group}, efficiency {t['efficiency']:.1%}, "
                             f"{t['tokens_per_s']:,.0f} tokens/s")
    return "\n".join(lines)


def _layers_text(rank: dict, n_stages: int) -> str:
    """'0-4 +emb', '35-39 +head', '-' for a stage of no layer."""
    pieces = []
    for g, (first, end) in zip(rank["stages"], rank["layers"]):
        text = f"{first}-{end - 1}" if end - first > 1 else (f"{first}" if end > first else "")
        extras = (["emb"] if g == 0 else []) + (["head"] if g == n_stages - 1 else [])
        pieces.append(" +".join([text] + extras if text else extras) if extras else text)
    return ", ".join(pieces)


# weight_state_bytes' parts the pipeline table sums in its weights+grads+optimizer column; the
# buffers in flight (full's units, a fusion buffer's gradients or reduce-scatter outputs) are
# not the stage's weights: only its total counts them
WEIGHT_STATE_PARTS = ("parameters", "gradient", "master", "optimizer", "autocast", "fp16-compressed")


def _format_pipeline(p: dict) -> list[str]:
    pipe, mem = p["pipeline"], p["memory"]
    c = pipe["chosen"]
    n_stages = c["stages"] * c["stages_per_rank"]
    per_rank = f" ({c['stages_per_rank']} stages per rank)" if c["stages_per_rank"] > 1 else ""
    width = max(16, *(len(_layers_text(r, n_stages)) for r in c["ranks"]))
    lines = [f"Pipeline: {c['stages']} stages{per_rank} x {c['copies']} data-parallel copies on {p['gpus']} GPUs, "
             f"{c['schedule']}, micro batch {c['micro_batch']} x {c['microbatches']} micro batches per run x "
             f"{c['runs']} run(s) per step = global batch {c['global_batch']}; activation checkpointing "
             f"{'on' if c['checkpointing'] else 'off'}; plan within {_gib(mem['budget'])} per GPU",
             f"  {'rank':>4}  {'layers':<{width}} {'params':>9} {'weights+grads+optimizer':>24} {'activations':>12} "
             f"{'recv buffers':>13} {'logits':>10} {'total':>11}  in flight"]
    for r in c["ranks"]:
        parts = r["parts"]
        state = sum(v for k, v in parts.items() if k.startswith(WEIGHT_STATE_PARTS))
        lines.append(f"  {r['rank']:>4}  {_layers_text(r, n_stages):<{width}} {r['params'] / 1e9:>8.2f}B "
                     f"{state / GIB:>20.2f} GiB {parts['activations'] / GIB:>8.2f} GiB "
                     f"{parts.get('pipeline receive buffers', 0) / GIB:>9.2f} GiB "
                     f"{parts.get('logits and loss', 0) / GIB:>6.2f} GiB {r['total'] / GIB:>7.2f} GiB  "
                     f"{r['in_flight']:>4}")
    verdict = "fits" if c["fits"] else "DOES NOT FIT"
    lines.append(f"  largest: rank {c['largest_rank']}, {_gib(c['largest'])} of {_gib(mem['budget'])}: {verdict} "
                 f"(each rank also holds the Horovod fusion buffer and {_gib(CUDA_OVERHEAD_BYTES)} of CUDA overhead)")
    v = c["stages_per_rank"]
    formula, m_text = ("(p-1)/(v·m+p-1)", f"{v} x {c['microbatches']}") if v > 1 else ("(p-1)/(m+p-1)",
                                                                                      f"{c['microbatches']}")
    lines.append(f"  ideal bubble {formula} = {c['stages'] - 1}/({m_text}+{c['stages'] - 1}) = {c['bubble']:.1%}")
    if c["step_s"] is None:
        lines.append(f"  step time: {pipe['time_source']}")
    else:
        slots = v * c["microbatches"] + c["stages"] - 1
        lines.append(f"  predicted step {c['step_s']:.3f} s: compute {c['runs']} x {slots} slots x "
                     f"{c['slot_s'] / v * 1e3:.1f} ms = {c['compute_s']:.3f} s ({pipe['time_source']}), "
                     f"gradient allreduce over {c['copies']} copies {c['comm_s']:.3f} s ({c['reduce']} the pipeline: "
                     f"{c['exposed_s']:.3f} s exposed), tied embedding {c['tied_s'] * 1e3:.1f} ms; "
                     f"{c['tokens_per_s']:,.0f} tokens/s" + (f", MFU {c['mfu']:.1%}" if c["mfu"] is not None else ""))
    lines += ["", f"Tensor-parallel ranks t x pipeline stages p on {p['gpus']} GPUs at micro batch {c['micro_batch']}, "
                  f"activation checkpointing {'on' if c['checkpointing'] else 'off'}, {c['schedule']} (p = 1: no "
                  "pipeline; t: each layer split within a node, its allreduces in the step):",
              f"  {'t':>2} {'p':>3} {'copies':>6} {'m':>5} {'largest rank':>13} {'fits':>5} {'bubble':>7} {'step s':>9} "
              f"{'tokens/s':>11} {'MFU':>6}"]
    for r in pipe["rows"]:
        if "error" in r:
            lines.append(f"  {r['tensor_parallel']:>2} {r['stages']:>3}  -  {r['error']}")
            continue
        step = "-" if r["step_s"] is None else f"{r['step_s']:.3f}"
        rate = "-" if r["step_s"] is None else f"{r['tokens_per_s']:,.0f}"
        mfu_text = "-" if r.get("mfu") is None else f"{r['mfu']:.1%}"
        lines.append(f"  {r['tensor_parallel']:>2} {r['stages']:>3} {r['copies']:>6} {r['microbatches']:>5} "
                     f"{_gib(r['largest']):>13} {'yes' if r['fits'] else 'no':>5} {r['bubble']:>7.1%} {step:>9} "
                     f"{rate:>11} {mfu_text:>6}")
    best = pipe["fastest"]
    if best is not None:
        lines.append(f"  fastest that fits: t={best['tensor_parallel']} x p={best['stages']} x {best['copies']} copies, "
                     f"{best['step_s']:.3f} s per step")
    return lines


# ---------------------------------------------------------------- command line

def add_cli(subparsers):
    """Register `hvdtrain plan` on the CLI's subparsers."""
    p = subparsers.add_parser("plan", help="estimate memory per GPU, step time and scaling for a config",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, as for train")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs (Horovod workers)")
    p.add_argument("--gpu", default="H100", help="GPU model, e.g. H100, H200, A100-40GB, L4 (default H100)")
    p.add_argument("--gpu-memory", type=float, metavar="GIB", help="GPU memory in GiB (for GPUs the table lacks)")
    p.add_argument("--net-gbps", type=float, default=100.0,
                   help="bandwidth of the slowest link in the ring, Gbit/s (default 100)")
    p.add_argument("--latency-us", type=float, default=DEFAULT_LATENCY_US,
                   help=f"latency per ring step, microseconds (default {DEFAULT_LATENCY_US:g})")
    timing = p.add_mutually_exclusive_group()
    timing.add_argument("--step-time", type=float, metavar="S", help="measured seconds per step on 1 worker")
    timing.add_argument("--measured", metavar="RUN_DIR",
                        help="1-worker run folder whose metrics.jsonl gives the step time")
    p.add_argument("--target-global-batch", type=int, metavar="B",
                   help="global batch to keep on --gpus (default train.global_batch_size)")
    p.add_argument("--eager-attention", action="store_true",
                   help="the model materialises attention scores (no SDPA / flash attention)")
    p.add_argument("--pp", type=int, metavar="P",
                   help="pipeline stages: memory of every stage, bubble and step time with P stages, compared with "
                        "the other stage counts (default parallel.pipeline_stages when above 1)")
    p.add_argument("--tp", type=int, metavar="T",
                   help="tensor-parallel ranks (parallel.tensor_parallel): each layer's matrices and activations "
                        "split over T GPUs of a node; memory per GPU and their allreduces' time")
    p.add_argument("--tp-gbps", type=float, default=NVLINK_GBPS, metavar="G",
                   help=f"links within a tensor-parallel group in Gbit/s (default {NVLINK_GBPS:g}: NVLink 4)")
    p.add_argument("--shard", choices=("none", "optimizer", "gradients", "full"),
                   help="count the state sharded over the data-parallel copies at this level (parallel.shard)")
    p.add_argument("--shard-optimizer", action="store_true", help="the same as --shard optimizer")
    p.add_argument("--mfu", type=float, default=DEFAULT_MFU, metavar="F",
                   help=f"model FLOPs utilisation assumed for the pipeline's compute when no step time is given "
                        f"(default {DEFAULT_MFU:g})")
    p.set_defaults(func=run_plan)


def run_plan(args) -> int:
    level = args.shard or ("optimizer" if args.shard_optimizer else None)
    cfg = load_config(args.config, args.overrides + ([f"parallel.shard={level}"] if level else [])
                      + ([f"parallel.tensor_parallel={args.tp}"] if args.tp else []))
    step_time = read_step_time(args.measured) if args.measured else args.step_time
    result = plan(cfg, args.gpus, gpu=args.gpu, net_gbps=args.net_gbps, step_time=step_time,
                  target_global_batch=args.target_global_batch, latency_us=args.latency_us,
                  gpu_memory_gib=args.gpu_memory, sdpa=not args.eager_attention, pp=args.pp,
                  model_flops_utilisation=args.mfu, tp_gbps=args.tp_gbps)
    print(format_plan(result))
    return 0
