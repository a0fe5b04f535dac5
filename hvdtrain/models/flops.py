"""Model size, training FLOPs per token, GPU peak throughput and MFU: plain arithmetic.

Model FLOPs Utilization (MFU) is the fraction of the GPUs' peak dense throughput that the
model's own arithmetic uses: MFU = tokens/s x FLOPs/token / peak FLOP/s. The FLOPs count is
the model's, not the hardware's: recomputation under activation checkpointing is not counted
(PaLM, Chowdhery et al. 2022, appendix B).

No torch import here: `hvdtrain plan` uses this module and must start fast.
"""
import re
from dataclasses import dataclass
from typing import Optional

from hvdtrain.models import family, family_of_model_type


def model_dims(cfg) -> dict:
    """The model shape a Config describes, with its defaults resolved (d_ff: 4 x d_model,
    max_position: data.seq_len): keyword arguments for count_params and flops_params."""
    m = cfg.model
    return dict(arch=m.arch, n_layer=m.n_layer, d_model=m.d_model, d_ff=m.d_ff or 4 * m.d_model,
                vocab_size=cfg.data.vocab_size, max_position=m.max_position or cfg.data.seq_len,
                tied_embeddings=family(m.arch).tie_embeddings if m.tie_embeddings is None else m.tie_embeddings,
                kv_width=(m.n_kv_head or m.n_head) * (m.d_model // m.n_head),
                **family(m.arch).family_shape(m))


def built_model_dims(config) -> Optional[dict]:
    """The shape of a model that exists, from its transformers config (e.g. GPT2Config):
    keyword arguments for count_params and flops_params. Training counts FLOPs
    from this rather than from model_dims(cfg): a `model.pretrained` checkpoint has its own
    sizes, which the model.* keys do not describe, and a model built here has its vocabulary
    padded to a multiple of 64. None for another model type (a pretrained model of another
    family), whose parameters these formulas do not count."""
    found = family_of_model_type(config.model_type)
    return None if found is None else dict(arch=found.name, **found.shape_of(config))


def count_params(arch: str, n_layer: int, d_model: int, d_ff: int, vocab_size: int, max_position: int,
                 tied_embeddings: bool = True, kv_width: Optional[int] = None, **shape) -> int:
    """Parameters of the family's model (e.g. HF GPT2LMHeadModel), counted as
    `sum(p.numel() for p in model.parameters())` counts them (a tied weight once). kv_width:
    the width of the key and value projections (null: d_model; smaller with grouped-query
    attention). `shape`: the family's own shape keys (Family.family_shape: ModernBERT's
    layout of local and global layers, a mixture's experts)."""
    parts = family(arch).parameter_counts(d_model, d_ff, vocab_size, max_position, kv_width or d_model, **shape)
    untied_output = 0 if tied_embeddings else parts.untied_output
    return parts.embeddings + n_layer * parts.layer + parts.head + untied_output


def stage_params(arch: str, n_layer: int, d_model: int, d_ff: int, vocab_size: int, max_position: int,
                 bounds: list[int], head_fraction: float = 1.0, tied_embeddings: bool = True,
                 kv_width: Optional[int] = None, **shape) -> list[dict]:
    """Parameters of each pipeline stage of a model with tied (or untied) embeddings, split
    at the layer `bounds` of hvdtrain.parallel.pipeline_plan.stage_bounds: stage i owns layers
    bounds[i] .. bounds[i+1]-1, the first stage also the embeddings, the last one the head.

    For each stage, "layers" (how many), "params" (as its StageModule counts them) and
    "flops_params" (its share of flops_params' N). With more than one stage the last stage holds
    its own copy of the tied embedding/output matrix (hvdtrain.parallel.pipeline keeps the copies equal),
    so the stages hold V·d more parameters than the model (untied: the last stage's own output
    matrix); with one stage both counts are those of count_params and flops_params. The head (e.g. GPT-2's ln_f and lm_head; BERT's MLM
    transform, decoder and bias) counts with `head_fraction` in flops_params, as there."""
    parts = family(arch).parameter_counts(d_model, d_ff, vocab_size, max_position, kv_width or d_model, **shape)
    v, d = vocab_size, d_model
    n = len(bounds) - 1
    stages = []
    for i in range(n):
        layers = bounds[i + 1] - bounds[i]
        params, flops_n = layers * parts.layer, float(layers * (parts.layer - parts.unused))
        if i == 0:
            params += parts.embeddings
            flops_n += parts.embeddings - parts.lookups  # e.g. BERT's embedding LayerNorm
        if i == n - 1:
            # the output matrix: the embedding itself on a single stage, else the last stage's copy
            params += parts.head + (parts.untied_output if not tied_embeddings else v * d if n > 1 else 0)
            flops_n += head_fraction * (parts.head + v * d)
        stages.append({"layers": layers, "params": params, "flops_params": flops_n})
    return stages


def head_fraction(cfg) -> float:
    """Share of positions whose hidden state goes through the output head (the vocabulary
    projection): all of them for a causal LM; for a masked LM only the masked ones,
    data.mlm_probability on average, since hvdtrain projects only those (models.head_inputs)."""
    return 1.0 if family(cfg.model.arch).causal else cfg.data.mlm_probability


def flops_params(arch: str, n_layer: int, d_model: int, d_ff: int, vocab_size: int, max_position: int,
                 tied_embeddings: bool = True, head_fraction: float = 1.0, kv_width: Optional[int] = None,
                 **shape) -> float:
    """N in the 6N term: the parameters every token multiplies with.

    That is all parameters except the lookup tables (position and token-type embeddings, and
    the input token embedding when it is not tied), but *including* the output projection
    V x d, a real matmul on every position that reaches it. This is nanoGPT's choice (all
    parameters minus position embeddings). Leaving the output projection out, as Kaplan et
    al.'s "non-embedding N" does, would under-count GPT-2 124M by ~30%.

    The output head (GPT-2's lm_head; BERT's MLM transform, decoder and its bias) counts with
    `head_fraction`, the share of positions it runs on (see head_fraction(cfg)).
    """
    total = count_params(arch, n_layer, d_model, d_ff, vocab_size, max_position, tied_embeddings, kv_width, **shape)
    parts = family(arch).parameter_counts(d_model, d_ff, vocab_size, max_position, kv_width or d_model, **shape)
    # The token table is the output projection when tied: a matmul, not a lookup. Untied, the
    # input table is a lookup and the separate output projection stays.
    lookups = parts.lookups - (vocab_size * d_model if tied_embeddings else 0)
    head = vocab_size * d_model + parts.head
    return total - n_layer * parts.unused - lookups - (1 - head_fraction) * head


def flops_per_token(n_params: float, n_layer: int, d_model: int, seq_len: int,
                    attended_keys: Optional[int] = None) -> float:
    """Training FLOPs per token: 6N + 12·L·H·Q·T (PaLM appendix B; nanoGPT's estimate_mfu).

    6N: forward 2N (a multiply and an add per parameter), backward 4N (gradients of inputs and
    of weights). 12·L·H·Q·T: per layer and token, the attention scores QK^T and the weighted
    sum of the values are T·d multiply-adds (2·T·d FLOPs) each in the forward, x3 for forward
    + backward; H·Q (heads x head size) = d_model. Pass N = flops_params(...). Causal masking
    is not discounted (PaLM's convention). L·T is `attended_keys` when given: the keys each
    query attends to summed over the layers, fewer than L·T where layers attend to a local
    window (ModernBERT; the FLOPs of the attention the model needs, not of a masked kernel).
    Grouped-query attention changes nothing here: every query head still scores T keys.
    """
    keys = n_layer * seq_len if attended_keys is None else attended_keys
    return 6.0 * n_params + 12.0 * d_model * keys


def model_flops_per_token(cfg, dims: Optional[dict] = None) -> float:
    """Training FLOPs per token of a model of shape `dims` (built_model_dims of the real model;
    default model_dims(cfg), the shape the config describes) trained as `cfg` says: its
    sequence length and, for BERT, its masking rate."""
    if dims is None:
        dims = model_dims(cfg)
    n = flops_params(**dims, head_fraction=head_fraction(cfg))
    shape = {k: v for k, v in dims.items() if k != "arch"}
    return flops_per_token(n, dims["n_layer"], dims["d_model"], cfg.data.seq_len,
                           family(dims["arch"]).attended_keys(cfg.data.seq_len, **shape))


def mfu(tokens_per_s: float, flops_per_token: float, peak_tflops_total: float) -> float:
    """Model FLOPs Utilization. tokens_per_s is the whole job's throughput and
    peak_tflops_total the peak of all its GPUs together (per-GPU peak x GPUs)."""
    return tokens_per_s * flops_per_token / (peak_tflops_total * 1e12)


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model: dense (no 2:4 sparsity) peak TFLOP/s per matmul format, and memory.

    bf16/fp16 are tensor-core rates with fp32 accumulation (what PyTorch autocast uses; on
    GeForce cards that is half the fp16-accumulate rate). tf32 is the tensor-core rate for fp32
    matmuls run in TF32, fp32 the plain CUDA-core rate. None: the GPU has no tensor-core path
    for that format (bf16 and TF32 before Ampere), or the vendor publishes no figure.
    memory_gib: nominal memory (the driver keeps 1-2% of it). Sources: NVIDIA datasheets and
    architecture whitepapers (Volta, Ampere GA100/GA102, Ada, Hopper, H200 and HGX B200
    product briefs); datasheets quote tensor-core rates with sparsity, these are half of those.
    """
    name: str
    pattern: str  # regex, searched case-insensitively in the device name
    memory_gib: float
    bf16: Optional[float]
    fp16: Optional[float]
    tf32: Optional[float]
    fp32: Optional[float]


# Ordered: the first pattern that matches wins, so variants come before the plain model name.
# \b keeps "A10" from matching "A100"/"A10G" and "L4" from matching "L40S".
# Names as torch.cuda.get_device_name() reports them: "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe",
# "NVIDIA A100-SXM4-40GB", "NVIDIA A100 80GB PCIe", "NVIDIA H200", "Tesla V100-SXM2-32GB", ...
GPUS = [
    #       name          pattern                    GiB   bf16    fp16    tf32    fp32
    GpuSpec("B200",       r"\bB200\b",               180,  2250,   2250,   1100,   75),
    GpuSpec("H200 NVL",   r"\bH200\b.*\bNVL\b",      141,  835,    835,    417.5,  60),
    GpuSpec("H200",       r"\bH200\b",               141,  989,    989,    494.5,  67),
    GpuSpec("H100 PCIe",  r"\bH100\b.*\bPCIe\b",     80,   756,    756,    378,    51),
    GpuSpec("H100 NVL",   r"\bH100\b.*\bNVL\b",      94,   835,    835,    417.5,  60),
    GpuSpec("H100 SXM",   r"\bH100\b",               80,   989,    989,    494.5,  67),
    GpuSpec("A100 40GB",  r"\bA100\b.*\b40\s*GB\b",  40,   312,    312,    156,    19.5),
    GpuSpec("A100 80GB",  r"\bA100\b",               80,   312,    312,    156,    19.5),
    GpuSpec("L40S",       r"\bL40S\b",               48,   362,    362,    183,    91.6),
    GpuSpec("L40",        r"\bL40\b",                48,   181,    181,    90.5,   90.5),
    GpuSpec("L4",         r"\bL4\b",                 24,   121,    121,    60,     30.3),
    GpuSpec("A40",        r"\bA40\b",                48,   149.7,  149.7,  74.8,   37.4),
    GpuSpec("A10",        r"\bA10\b",                24,   125,    125,    62.5,   31.2),
    GpuSpec("RTX 4090",   r"\bRTX\s*4090\b",         24,   165.2,  165.2,  82.6,   82.6),
    GpuSpec("RTX 3090",   r"\bRTX\s*3090\b",         24,   71,     71,     35.6,   35.6),
    GpuSpec("V100 32GB",  r"\bV100\b.*\b32\s*GB\b",  32,   None,   125,    None,   15.7),  # SXM2 figures
    GpuSpec("V100 16GB",  r"\bV100\b",               16,   None,   125,    None,   15.7),
    GpuSpec("T4",         r"\bT4\b",                 16,   None,   65,     None,   8.1),
]


def find_gpu(name: str) -> Optional[GpuSpec]:
    """The table entry for a device name ("NVIDIA H100 80GB HBM3") or a short one ("h100")."""
    for spec in GPUS:
        if re.search(spec.pattern, name, re.IGNORECASE):
            return spec
    return None


def peak_tflops(gpu_name: str, precision: str) -> tuple[Optional[float], str]:
    """(dense peak TFLOP/s of one GPU for a run at train.precision `precision`, which table
    entry gave it). The value is None on a CPU, an unknown GPU, or a precision the GPU has no
    figure for; the text says why.

    fp32 runs do their matmuls in TF32 where the GPU has it (hvdtrain.parallel.distributed.init sets
    torch.backends.cuda.matmul.allow_tf32), so their peak is the TF32 tensor-core rate, 7-8x
    the plain fp32 one on A100 and H100: against the plain rate, MFU would pass 100%.
    """
    if precision not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"unknown precision {precision!r}")
    spec = find_gpu(gpu_name)
    if spec is None:
        return None, f"no peak-throughput entry for device {gpu_name!r}"
    matmul = "tf32" if precision == "fp32" and spec.tf32 is not None else precision
    value = getattr(spec, matmul)
    if value is None:
        return None, f"{spec.name}: no dense {matmul} figure"
    return float(value), f"{spec.name} {matmul} dense"
