"""The models hvdtrain trains, built with Hugging Face transformers, and the training loss.

A model of the family `model.arch` names (hvdtrain.models: GPT-2, BERT, Llama, ModernBERT) is
built from the config for training from scratch, or loaded from `model.pretrained` to continue
pretraining, in two steps (`model_blueprint`, hvdtrain.models.model_build): the model with its
parameters on the meta device, then the part a rank keeps made real (the whole model, or its
pipeline stage). Attention goes through PyTorch's scaled_dot_product_attention. The training
loss is summed here
(`token_loss_sum`), so it can normalise by the number of targets in the whole optimizer step.
"""
import os
import shutil
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import torch

from hvdtrain.config import ModelConfig
from hvdtrain.errors import UserError
from hvdtrain.models import family, family_of
from hvdtrain.models.model_build import Blueprint

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
    # The config key that decides `size`, for messages: data.vocab_size (synthetic data) or
    # data.tokenizer (text)
    origin: str = "data.vocab_size"

    @property
    def special_ids(self) -> list[int]:
        return sorted({i for i in (self.pad_id, self.bos_id, self.eos_id, self.cls_id, self.sep_id, self.mask_id)
                       if i is not None})


def build_model(cfg: ModelConfig, vocab: Vocab, seq_len: int) -> torch.nn.Module:
    """The whole model, initialised (or loaded from model.pretrained); see model_blueprint."""
    blueprint = model_blueprint(cfg, vocab, seq_len)
    return blueprint.materialise(blueprint.model)


def model_blueprint(cfg: ModelConfig, vocab: Vocab, seq_len: int) -> Blueprint:
    """The model with its parameters on the meta device (hvdtrain.models.model_build): a pipeline rank
    keeps its stage of it, then makes only that real. Weights are initialised per module from
    a seed drawn from torch's global generator (torch.manual_seed first), or read from the
    safetensors files of model.pretrained."""
    if cfg.pretrained:
        return pretrained_blueprint(cfg, vocab, seq_len)
    rows = embedding_rows(vocab.size)
    make = family(cfg.arch).modeling().model_maker(cfg, vocab, rows, positions=cfg.max_position or seq_len,
                                                   d_ff=cfg.d_ff or 4 * cfg.d_model)
    return Blueprint(make)


def embedding_rows(tokens: int) -> int:
    """The embedding rows of a model for a vocabulary of `tokens`: the next multiple of 64."""
    return -(-tokens // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def pretrained_folder(name: str) -> Path:
    """The local folder of model.pretrained: the folder itself, or the snapshot of a hub model's
    json and safetensors files (fetched once, then read from the Hugging Face cache)."""
    folder = Path(name)
    if folder.is_dir():
        return folder
    from huggingface_hub import snapshot_download
    return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors"]))


def keep_generation_config(cfg: ModelConfig, run_tokenizer: Path):
    """Copy model.pretrained's generation_config.json (its sampling settings, and the end tokens
    `generate` stops at, which config.json may not list) into the run's tokenizer folder, whose
    files every export puts beside the weights: transformers would otherwise write a default
    one made from config.json."""
    source = pretrained_folder(cfg.pretrained) / "generation_config.json"
    if source.is_file():
        run_tokenizer.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, run_tokenizer / source.name)


def pretrained_blueprint(cfg: ModelConfig, vocab: Vocab, seq_len: int) -> Blueprint:
    """model.pretrained's architecture from its config.json, to be filled from its safetensors
    files (a local folder, or a hub name whose json and safetensors files are fetched). Weights
    from safetensors only: a pickled pytorch_model.bin can run code when loaded; and no Python
    code from the folder or the hub (a config's auto_map).

    The parameters are fp32 whatever dtype the folder was saved in (config.json's `dtype`, e.g.
    bfloat16 for Llama 3, float16 for Llama 2): they are the masters that train.precision's
    autocast computes from in 16 bits, and the run's config (its checkpoints', its export's)
    says float32. A data vocabulary larger than the folder's embedding is refused, or with
    model.resize_embeddings met by adding rows (`Blueprint.saved_rows`)."""
    import transformers
    from transformers import AutoConfig

    try:
        folder = pretrained_folder(cfg.pretrained)
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except (OSError, ValueError) as e:  # huggingface_hub's errors are OSErrors or ValueErrors
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"model.pretrained '{cfg.pretrained}': could not load ({first})") from None
    if config.model_type not in family(cfg.arch).model_types:
        raise UserError(f"model.pretrained '{cfg.pretrained}' is a {config.model_type} model, not of the "
                        f"family model.arch={cfg.arch}; set model.arch to the folder's family")
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if positions is not None and positions < seq_len:
        raise UserError(f"model.pretrained '{cfg.pretrained}' has {positions} positions, fewer than "
                        f"data.seq_len={seq_len} (train the first phase with model.max_position={seq_len})")
    saved_rows = config.vocab_size
    if saved_rows < vocab.size:
        if not cfg.resize_embeddings:
            own = (f"data.vocab_size={saved_rows}" if vocab.origin == "data.vocab_size"
                   else f"data.tokenizer={cfg.pretrained}, the model's own tokenizer")
            raise UserError(f"model.pretrained '{cfg.pretrained}' has {saved_rows} embedding rows, fewer than the "
                            f"{vocab.size} tokens {vocab.origin} gives; set model.resize_embeddings=true to add "
                            f"rows for them, or {own}")
        config.vocab_size = embedding_rows(vocab.size)
    config._attn_implementation = "sdpa"
    auto = getattr(transformers, family(cfg.arch).auto_class)
    # dtype: transformers' from_config would build in the folder's config.dtype (and keep it).
    build = partial(auto.from_config, config, dtype=torch.float32, trust_remote_code=False)
    # A family whose model.* keys include training settings (Mixtral's router loss and
    # capacity factor) sets them on the folder's config and the model: its pretrained_maker.
    modeling = family(cfg.arch).modeling()
    settings = getattr(modeling, "pretrained_maker", None)
    # A family whose hub folders hold some tensors in pieces (Mixtral: one per expert): saved_pieces.
    pieces = getattr(modeling, "saved_pieces", None)
    return Blueprint(settings(cfg, config, build) if settings else build, weights=folder, saved_rows=saved_rows,
                     pieces=partial(pieces, config) if pieces else None)


def transformer_blocks(model) -> torch.nn.ModuleList:
    """The repeated layers: the unit for torch.compile and activation checkpointing."""
    return model.get_submodule(family_of(model).modeling().PARTS.layers)


def model_body(model) -> torch.nn.Module:
    """Everything before the output head (GPT2Model, BertModel, LlamaModel, ModernBertModel)."""
    return model.get_submodule(family_of(model).modeling().PARTS.body)


# ---------------------------------------------------------------- switches for `bench compare`
# Speed choices not yet measured on a GPU, as environment switches that `hvdtrain bench compare
# --vary env:NAME=a,b` compares in one process. The first value of each is what hvdtrain does
# today. A switch that a GPU measurement shows to help becomes the default (or a config key);
# one that does not is removed.
SWITCHES = {
    # token_loss_sum: chunked linear + cross-entropy in eager ops; the same with each chunk's
    # softmax/gradient arithmetic compiled into fused kernels; or whole-batch logits (the former
    # path, kept to measure against).
    "HVDTRAIN_LOSS": ("chunked", "compiled", "logits"),
    # With model.compile: compile each transformer block (Horovod's hooks fire during backward,
    # so the allreduce overlaps it), or the whole body (one graph; gradients reach the hooks only
    # when its backward ends). One GPU has no allreduce: there the difference is compute alone.
    "HVDTRAIN_COMPILE_SCOPE": ("blocks", "body"),
    # torch.compile's mode: reduce-overhead adds CUDA graphs (fewer kernel launches).
    "HVDTRAIN_COMPILE_MODE": ("default", "reduce-overhead", "max-autotune-no-cudagraphs"),
    # parallel.shard=full: start the next unit's allgather while this one computes, or gather
    # each unit only when it is used (what the prefetch hides, measured against it).
    "HVDTRAIN_PREFETCH": ("on", "off"),
    # Pipeline stages: receive buffers for the micro batches in flight (parallel.pipeline.
    # InFlightStage), or torch's PipelineStage, which keeps one per micro batch of a run (what
    # the bounded buffers save, measured against it by `bench pipeline`).
    "HVDTRAIN_STAGE": ("in-flight", "torch"),
}


def switch(name: str) -> str:
    choices = SWITCHES[name]
    value = os.environ.get(name) or choices[0]
    if value not in choices:
        raise UserError(f"environment variable {name}={value!r}: expected one of {', '.join(choices)}")
    return value


def apply_speedups(model, cfg: ModelConfig):
    """Optional speed-ups of the built model: activation checkpointing, compiled blocks."""
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.compile:
        mode = switch("HVDTRAIN_COMPILE_MODE")
        options = {} if mode == "default" else {"mode": mode}
        if switch("HVDTRAIN_COMPILE_SCOPE") == "body":
            model_body(model).compile(**options)
            return
        # Per block, not the whole model: a whole-model compiled backward hands gradients to
        # Horovod's hooks only at its end, which serialises allreduce after backward.
        for block in transformer_blocks(model):
            block.compile(**options)


# ---------------------------------------------------------------- the loss

def head_inputs(model, batch: dict, body_output=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(features, targets): the (positions, d_model) inputs of the vocabulary projection
    `model.get_output_embeddings()` and their labels; `body_output`: the body's output for
    `batch` when the caller has run it (training: training_sums).

    Labels are already aligned with the model's outputs (the collator shifts causal LM
    labels), so every family shares the loss. A causal LM projects every position; a masked LM
    only the masked ones, through its head's own transform first (the family's
    PARTS.masked_head): the other ~85% would be computed and thrown away."""
    masked_head = family_of(model).modeling().PARTS.masked_head
    if body_output is None:
        body_output = model_body(model)(input_ids=batch["input_ids"])
    hidden = body_output.last_hidden_state
    if masked_head is None:
        return hidden.flatten(0, 1), batch["labels"].flatten()
    hidden, labels = masked_positions(hidden, batch)
    return model.get_submodule(masked_head)(hidden), labels


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


def logits_and_labels(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (positions, vocab) logits and their labels (see head_inputs): the whole micro batch's
    logits, for tests. Training (training_sums, but for the HVDTRAIN_LOSS=logits switch) and
    evaluation (evaluation_sums) never hold them all."""
    features, labels = head_inputs(model, batch)
    return model.get_output_embeddings()(features), labels


# Logits computed at a time by token_loss_sum: 2^26 (256 MB in fp32), e.g. 1334 positions of
# GPT-2's 50,304-row vocabulary, where the whole batch of 16 x 1024 would take 3.3 GB.
LOSS_CHUNK_ELEMENTS = 2 ** 26


def token_loss_sum(model, batch: dict, chunk_elements: int = LOSS_CHUNK_ELEMENTS) -> torch.Tensor:
    """The loss sum training backpropagates for `batch` (training_sums), without its statistics."""
    return training_sums(model, batch, chunk_elements)[0]


def statistics_record(model) -> Optional[Callable[[list[float], float], dict]]:
    """What turns the statistics of training_sums, summed over a log interval's steps and the
    ranks, into entries of the train record (the family's PARTS.statistics_record); None for a
    family without an auxiliary loss."""
    record = family_of(model).modeling().PARTS.statistics_record
    return None if record is None else partial(record, model.config)


def training_sums(model, batch: dict, chunk_elements: int = LOSS_CHUNK_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss sum, statistics) of `batch`: the sum of the token cross-entropies over its labelled
    positions (fp32 scalar), plus a family's auxiliary loss; and a vector of what the run logs
    of that auxiliary loss (detached; empty without one).

    The cross-entropies are the same numbers, to fp32 rounding, as cross_entropy(logits.float(),
    labels, reduction="sum") on the logits of logits_and_labels, without holding those logits:
    see LinearCrossEntropySum. A family with an auxiliary loss (a mixture's load balancing:
    PARTS.auxiliary_loss) adds it once per target token, so that the step's loss per target
    token (what training divides by) is the token loss plus the auxiliary loss averaged over
    the step's micro batches, each weighted by its targets: the same at any number of workers
    whose micro batches hold the same samples."""
    parts = family_of(model).modeling().PARTS
    body_output = model_body(model)(input_ids=batch["input_ids"], **parts.body_options)
    features, labels = head_inputs(model, batch, body_output)
    head = model.get_output_embeddings()
    if switch("HVDTRAIN_LOSS") == "logits":
        loss = torch.nn.functional.cross_entropy(head(features).float(), labels, ignore_index=IGNORE_INDEX,
                                                 reduction="sum")
    else:
        loss = linear_cross_entropy_sum(features, head.weight, head.bias, labels, chunk_elements)
    if parts.auxiliary_loss is None:
        return loss, loss.new_zeros(0)
    auxiliary, statistics = parts.auxiliary_loss(model, body_output, (labels != IGNORE_INDEX).sum())
    return loss + auxiliary, statistics


def evaluation_sums(model, batch: dict, chunk_elements: int = LOSS_CHUNK_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(sum of token cross-entropies, number of targets whose argmax is right, number of
    targets) over the labelled positions of `batch`, without gradients: the loss and accuracy of
    evaluation, from the same chunks of positions as token_loss_sum, so that evaluation never
    holds more logits than a training step does (one chunk, not the micro batch's)."""
    features, labels = head_inputs(model, batch)
    head = model.get_output_embeddings()
    device_type = features.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else features.dtype
    rows = max(1, chunk_elements // head.weight.shape[0])
    with torch.no_grad():
        loss, _, _, _, hits = _chunked_forward(features, head.weight, head.bias, labels, rows, dtype,
                                               _softmax_cross_entropy_chunk, grads=False, hits=True)
    return loss, hits, int((labels != IGNORE_INDEX).sum())


def linear_cross_entropy_sum(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             targets: torch.Tensor, chunk_elements: int = LOSS_CHUNK_ELEMENTS) -> torch.Tensor:
    """sum_i cross_entropy(x_i @ weight.T + bias, targets_i) over targets_i != IGNORE_INDEX,
    in chunks of positions; under autocast the projection runs in its dtype, as nn.Linear would."""
    device_type = x.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    rows = max(1, chunk_elements // weight.shape[0])
    chunk = _compiled_chunk() if switch("HVDTRAIN_LOSS") == "compiled" else _softmax_cross_entropy_chunk
    inputs = (x, weight) if bias is None else (x, weight, bias)
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return LinearCrossEntropySum.apply(x, weight, bias, targets, rows, dtype, chunk)
    with torch.no_grad():
        return _chunked_forward(x, weight, bias, targets, rows, dtype, chunk, grads=False)[0]


class LinearCrossEntropySum(torch.autograd.Function):
    """Fused linear + cross-entropy, summed: the output projection and the loss of a chunk of
    positions at a time, with the gradients computed in the forward pass (the method of
    Liger-Kernel's fused linear cross-entropy, in plain PyTorch ops so it runs on CPUs too).

    Per chunk: logits = x W^T (+ b) in the compute dtype, log-softmax in fp32, the chunk's loss,
    then the logits' gradient softmax - onehot (zero on ignored positions) and from it the
    chunk's gradients of x, W and b. Only one chunk's logits exist at a time; what is kept for
    backward is grad x (positions x d_model) and grad W, b (fp32, vocabulary x d_model): about
    200 MB for GPT-2 124M instead of 3.3 GB of fp32 logits (plus their bf16 copy and both
    gradients). No matmul is recomputed: backward only multiplies by the incoming gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, targets, rows, dtype, chunk):
        loss, grad_x, grad_w, grad_b, _ = _chunked_forward(x, weight, bias, targets, rows, dtype, chunk, grads=True)
        ctx.save_for_backward(grad_x, grad_w, grad_b)
        ctx.has_bias = bias is not None
        ctx.weight_dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # Scaled in place, not copied: these gradients were made for this one backward (a
        # second backward through the same graph, retain_graph, would see them scaled twice).
        grad_x, grad_w, grad_b = ctx.saved_tensors
        w_dtype, b_dtype = ctx.weight_dtypes
        return (grad_x.mul_(grad_loss.to(grad_x.dtype)), grad_w.mul_(grad_loss).to(w_dtype),
                grad_b.mul_(grad_loss).to(b_dtype) if ctx.has_bias else None, None, None, None, None)


def _softmax_cross_entropy_chunk(logits: torch.Tensor, targets: torch.Tensor, grads: bool):
    """(log-probability of each target, gradient of the logits or None) of one chunk. The
    gradient is in fp32, softmax - onehot, left unmasked on ignored rows (the caller zeroes
    their contributions); their log-probability is that of token 0, which the sum skips."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    index = targets.clamp(min=0).unsqueeze(1)
    picked = log_probs.gather(1, index).squeeze(1)
    if not grads:
        return picked, None
    grad = log_probs.exp_()
    grad.scatter_add_(1, index, -(targets != IGNORE_INDEX).unsqueeze(1).to(grad.dtype))
    return picked, grad


_COMPILED_CHUNK = None


def _compiled_chunk():
    global _COMPILED_CHUNK
    if _COMPILED_CHUNK is None:
        _COMPILED_CHUNK = torch.compile(_softmax_cross_entropy_chunk, dynamic=True)
    return _COMPILED_CHUNK


def _chunked_forward(x, weight, bias, targets, rows, dtype, chunk, grads: bool, hits: bool = False):
    """(loss sum, grad x, grad W, grad b, argmax hits): the gradients None unless `grads`, the
    number of labelled positions whose largest logit is their target's None unless `hits`."""
    with torch.autocast(x.device.type, enabled=False):
        xc, wc = x.to(dtype), weight.to(dtype)
        bc = bias.to(dtype) if bias is not None else None
        picked = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        grad_x = torch.empty_like(x) if grads else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if grads else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if grads and bias is not None else None
        correct = torch.zeros((), dtype=torch.int64, device=x.device) if hits else None
        for start in range(0, x.shape[0], rows):
            xs, ts = xc[start:start + rows], targets[start:start + rows]
            logits = torch.nn.functional.linear(xs, wc, bc)
            picked[start:start + rows], grad = chunk(logits, ts, grads)
            if hits:  # ignored positions are -100, never an argmax
                correct += (logits.argmax(-1) == ts).sum()
            # Freed before the next chunk's logits are made, so that one chunk's logits and
            # log-softmax exist at a time, not the previous chunk's too.
            del logits
            if grads:
                # Ignored positions get no gradient: their rows of x are zeroed for grad W and
                # their rows of grad x afterwards (d_model wide), not the vocabulary-wide rows.
                keep = (ts != IGNORE_INDEX).unsqueeze(1).to(dtype)
                grad = grad.to(dtype)
                grad_x[start:start + rows] = (grad @ wc) * keep
                if dtype == torch.float32:  # accumulated in place: no vocabulary x d_model temporary
                    # (addmm with out=, not addmm_: FLOP counters such as torch's count aten.addmm)
                    torch.addmm(grad_w, grad.t(), xs * keep, out=grad_w)
                else:  # a 16-bit product, added in fp32
                    grad_w.add_(grad.t() @ (xs * keep))
                if grad_b is not None:
                    grad_b.add_((keep.t() @ grad).squeeze(0))
            del grad
        # The sum as cross_entropy(..., reduction="sum") adds up the whole batch's -log p(target)
        # with the same kernel; the values equal the whole batch's to fp32 rounding only (a chunk's
        # matmul may round differently from the whole batch's, depending on the CPU's kernels).
        column = torch.where(targets != IGNORE_INDEX, 0, IGNORE_INDEX).to(targets.dtype)
        loss = torch.nn.functional.nll_loss(picked.unsqueeze(1), column, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, grad_x, grad_w, grad_b, correct
