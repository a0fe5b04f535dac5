"""The typed configuration: every key, its type, its default and its bounds, in one place.

A run is described by a YAML file plus dotted overrides on the command line
(`train.lr=3e-4 data.seq_len=256`). `load_config` merges them, checks every key and
value against the dataclasses below and returns a `Config`. Any mistake raises a
UserError whose message names the key (or file) and what was expected.

Each section is a dataclass: its fields are the keys of that YAML section, each documented
where it is declared, and its `check()` holds the bounds of its own values. `validate` runs
every section's check, then the few checks that relate keys of different sections. A new key
is one field (with its comment) and, when it has bounds, one line in its section's check.

Not config keys, on purpose: the speed switches `HVDTRAIN_LOSS`, `HVDTRAIN_COMPILE_SCOPE` and
`HVDTRAIN_COMPILE_MODE` (environment variables, hvdtrain/models/common.py SWITCHES) are experiments that
`hvdtrain bench compare --vary env:NAME=a,b` measures in one process, until a GPU measurement
makes one the default or removes it; the `HVDTRAIN_TEST_*` variables are hooks of the tests
(tests/workers/) and the fault campaign (HVDTRAIN_TEST_CHECKPOINT_PAUSE in hvdtrain/checkpointing/checkpoint.py).
The config's own debug aids are train.slow_ranks and train.slow_seconds (see TrainConfig).
"""
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import yaml

from hvdtrain.errors import UserError
from hvdtrain.models import NAMES as FAMILY_NAMES
from hvdtrain.models import family, knob_owners
from hvdtrain.models.mixtral import EXPERTS as MIXTRAL_EXPERTS
from hvdtrain.models.mixtral import EXPERTS_PER_TOKEN as MIXTRAL_EXPERTS_PER_TOKEN

KNOBS = knob_owners()  # model.* keys that only some families have -> those families


def _require(ok: bool, key: str, expected: str, value):
    """The one-line error of a value out of bounds: the key, what it expects, what it got."""
    if not ok:
        raise UserError(f"config key '{key}': expected {expected}, got {value!r}")


@dataclass
class ModelConfig:
    """The transformer trained, and its shape when it is built from scratch. The defaults are
    a toy model that trains in seconds on a CPU; the recipes set real shapes."""
    # The model family (hvdtrain.models): "gpt2" (causal LM, transformers' GPT2LMHeadModel),
    # "bert" (masked LM, BertForMaskedLM), "llama" (causal LM, LlamaForCausalLM: rotary
    # positions, RMSNorm, SwiGLU, grouped-query attention; Llama 3, Mistral and Qwen2 shapes) or
    # "modernbert" (masked LM, ModernBertForMaskedLM: rotary positions, GeGLU, alternating
    # local and global attention) or "mixtral" (causal LM, MixtralForCausalLM: Llama's with a
    # mixture of experts for each MLP, top-k routed, and a load-balancing loss).
    arch: Literal[FAMILY_NAMES] = "gpt2"
    # A local folder or hub name of a Hugging Face model of this arch to continue pretraining
    # from (safetensors only); its own shape and dropout then replace the keys below. null:
    # build a new model from them.
    pretrained: Optional[str] = None
    # With pretrained: when the data has more tokens (its tokenizer, or data.vocab_size) than the
    # folder's model has embedding rows, add rows up to the next multiple of 64 to the token
    # embedding and the output matrix (and its bias); each new row starts as the mean of the
    # folder's rows, as transformers' resize_token_embeddings starts them. false: such a run is
    # refused. A model with enough rows is never resized.
    resize_embeddings: bool = False
    n_layer: int = 2  # transformer blocks
    n_head: int = 2  # attention heads per block; must divide d_model
    d_model: int = 64  # hidden size: the width of the embeddings and of every block
    # Width of the feed-forward layer (Llama: SwiGLU's intermediate size; ModernBERT: GeGLU's);
    # null: 4 * d_model (GPT-2's and BERT's ratio, and Llama 3.2 1B's).
    d_ff: Optional[int] = None
    # Position embeddings: the longest sequence the model can take. null: data.seq_len. Set it
    # larger in a first phase that a later phase continues at a longer seq_len (BERT's phase 2).
    max_position: Optional[int] = None
    # Dropout probability of the embeddings, attention and residual paths; 0.1 as GPT-2 and BERT.
    # 0 makes runs with different world sizes comparable to rounding (the tests use it).
    dropout: float = 0.1
    compile: bool = False  # torch.compile per transformer block (keeps allreduce overlapped with backward)
    # Recompute each block's activations in backward instead of keeping them from the forward:
    # far less activation memory for one more forward of every block in each backward.
    activation_checkpointing: bool = False
    # The knobs of one family (KNOBS; null: the family's default). Set for another family, they
    # are an error. Llama (and Mixtral):
    # Key/value heads of grouped-query attention, shared by n_head / n_kv_head query heads each;
    # must divide n_head. null: n_head (multi-head attention). Llama 3 has 8.
    n_kv_head: Optional[int] = None
    rope_theta: Optional[float] = None  # the rotary embedding's base; null: 500000 (Llama 3)
    # The output matrix is the token embedding (one V x d matrix) or its own; null: tied
    # (Llama 3.2 1B and 3B; Llama 3 8B is untied); Mixtral: untied, as Mixtral 8x7B.
    tie_embeddings: Optional[bool] = None
    # Mixtral (a mixture of experts in each layer, in place of the SwiGLU MLP; d_ff is each
    # expert's width):
    experts: Optional[int] = None  # experts per layer; null: 8 (Mixtral 8x7B)
    # experts each token is routed to (top-k, dropless); at most model.experts; null: 2
    experts_per_token: Optional[int] = None
    # Weight of Switch Transformer's load-balancing loss in the training loss (experts_per_token when the
    # tokens spread evenly over the experts); 0 turns it off. null: 0.02 (Mixtral's)
    router_aux_loss_coef: Optional[float] = None
    # Weight of ST-MoE's router z-loss (the mean squared log-sum-exp of the router logits,
    # which keeps them small); null: 0, off (ST-MoE and OLMoE use 0.001)
    router_z_loss_coef: Optional[float] = None
    # Each expert takes at most capacity_factor x (tokens x experts_per_token / experts) of a
    # micro batch's tokens per layer (Switch Transformer, GShard): the rest of its tokens skip
    # it (their other experts and the residual connection carry them), first choices before
    # second ones, earlier tokens first; the log counts them (expert_dropped). null: dropless,
    # every token reaches its experts however many choose the same one.
    capacity_factor: Optional[float] = None
    # ModernBERT:
    # Tokens a local attention layer attends to around each position (half on each side);
    # null: 128 (ModernBERT-base and -large).
    local_attention: Optional[int] = None
    # Every this many layers one attends to the whole block (the first, then every N-th); the
    # others attend locally. null: 3 (ModernBERT's). 1: every layer global.
    global_attn_every: Optional[int] = None

    def check(self):
        for knob, owners in KNOBS.items():
            _require(getattr(self, knob) is None or self.arch in owners, f"model.{knob}",
                     f"null with model.arch {self.arch} (a knob of {', '.join(owners)} only)", getattr(self, knob))
        _require(self.n_kv_head is None or (self.n_kv_head >= 1 and self.n_head % self.n_kv_head == 0),
                 "model.n_kv_head", f"a divisor of model.n_head ({self.n_head}) or null", self.n_kv_head)
        experts = self.experts or MIXTRAL_EXPERTS
        _require(self.experts_per_token is None or 1 <= self.experts_per_token <= experts,
                 "model.experts_per_token", f"an integer in [1, model.experts ({experts})] or null",
                 self.experts_per_token)
        top_k = self.experts_per_token or MIXTRAL_EXPERTS_PER_TOKEN
        _require(self.experts is None or self.experts >= top_k, "model.experts",
                 f"an integer >= model.experts_per_token ({top_k}) or null", self.experts)
        _require(self.capacity_factor is None or self.capacity_factor > 0, "model.capacity_factor",
                 "a number > 0 or null", self.capacity_factor)
        for coefficient in ("router_aux_loss_coef", "router_z_loss_coef"):
            _require(getattr(self, coefficient) is None or getattr(self, coefficient) >= 0, f"model.{coefficient}",
                     "a number >= 0 or null", getattr(self, coefficient))
        _require(self.rope_theta is None or self.rope_theta > 0, "model.rope_theta", "a number > 0 or null",
                 self.rope_theta)
        _require(self.local_attention is None or (self.local_attention >= 2 and self.local_attention % 2 == 0),
                 "model.local_attention", "an even number of tokens >= 2 or null", self.local_attention)
        _require(self.global_attn_every is None or self.global_attn_every >= 1, "model.global_attn_every",
                 "an integer >= 1 or null", self.global_attn_every)
        _require(not self.resize_embeddings or self.pretrained, "model.resize_embeddings",
                 "false without model.pretrained (a new model is built with rows for the whole vocabulary)",
                 self.resize_embeddings)
        _require(self.n_layer >= 1, "model.n_layer", "an integer >= 1", self.n_layer)
        _require(self.d_model >= 1, "model.d_model", "an integer >= 1", self.d_model)
        _require(self.n_head >= 1 and self.d_model % self.n_head == 0, "model.n_head",
                 f"a divisor of model.d_model ({self.d_model})", self.n_head)
        _require(not family(self.arch).rotary or (self.d_model // self.n_head) % 2 == 0, "model.n_head",
                 f"a divisor of model.d_model ({self.d_model}) that leaves an even head dimension model.d_model / "
                 f"model.n_head (model.arch {self.arch} rotates pairs of its dimensions)", self.n_head)
        _require(self.d_ff is None or self.d_ff >= 1, "model.d_ff", "an integer >= 1 or null", self.d_ff)
        _require(0 <= self.dropout < 1, "model.dropout", "a number in [0, 1)", self.dropout)


@dataclass
class DataConfig:
    """Where the text comes from, how it is tokenized, and the blocks it is cut into
    (docs/data.md). Every key except num_workers, num_proc and cache_dir must match a
    checkpoint's to resume from it: they decide which samples a step reads."""
    # "builtin" (offline English prose shipped with Python), "synthetic" (random tokens),
    # a local file / directory / glob (.txt .jsonl .json .csv .parquet), or a hub dataset name.
    source: str = "builtin"
    hub_config: Optional[str] = None  # a hub dataset's configuration, e.g. wikitext-103-raw-v1
    split: str = "train"  # a hub dataset's split to train on (local files and builtin have none)
    validation_split: Optional[str] = None  # the dataset's own split; otherwise a held-out fraction
    # Without a validation_split: this share of the documents is held out for evaluation, chosen
    # by a hash of each document's position (the same documents whatever the seed or the workers).
    validation_fraction: float = 0.02
    # A hub dataset read as a stream to its end instead of being downloaded to the Hugging Face
    # cache first. Off by default: a download is kept and reused by later runs and other tools.
    streaming: bool = False
    text_column: str = "text"  # the column of the text in .jsonl/.json/.csv/.parquet files and hub datasets
    tokenizer: str = "train"  # "train", or a local path / hub name of a pretrained tokenizer
    vocab_size: int = 4096  # for a trained tokenizer (and synthetic data)
    # Tokens per training block, the sequence length (and the model's positions unless
    # model.max_position is set). Blocks are cut when the token files are read, so changing it
    # needs no new preparation.
    seq_len: int = 128
    # BERT only: the share of each block's tokens masked for prediction (of them 80% become
    # [MASK], 10% a random token, 10% stay as they are); 0.15 as in BERT.
    mlm_probability: float = 0.15
    synthetic_samples: int = 2048  # data.source "synthetic": training blocks made (validation: a tenth as many)
    # DataLoader worker processes per rank; 1 keeps the next batch ready in the background, 0
    # reads in the training process.
    num_workers: int = 1
    # Tokenizing processes per worker; null: the cores this worker may use (os.sched_getaffinity).
    num_proc: Optional[int] = None
    max_documents: Optional[int] = None  # read at most this many documents of each split of the source
    max_tokens: Optional[int] = None  # stop preparing once the training split has this many tokens
    tokenizer_sample_mb: float = 64.0  # a trained tokenizer learns from this many million characters
    cache_dir: Optional[str] = None  # where the token files are kept; default ~/.cache/hvdtrain

    def check(self):
        _require(self.seq_len >= 8, "data.seq_len", "an integer >= 8", self.seq_len)
        _require(0 < self.validation_fraction < 1, "data.validation_fraction", "a number in (0, 1)",
                 self.validation_fraction)
        _require(0 < self.mlm_probability < 1, "data.mlm_probability", "a number in (0, 1)", self.mlm_probability)
        _require(self.vocab_size >= 64, "data.vocab_size", "an integer >= 64", self.vocab_size)
        _require(self.num_workers >= 0, "data.num_workers", "an integer >= 0", self.num_workers)
        _require(self.num_proc is None or self.num_proc >= 1, "data.num_proc", "an integer >= 1 or null",
                 self.num_proc)
        _require(self.max_documents is None or self.max_documents >= 1, "data.max_documents",
                 "an integer >= 1 or null", self.max_documents)
        _require(self.max_tokens is None or self.max_tokens >= 1, "data.max_tokens", "an integer >= 1 or null",
                 self.max_tokens)
        _require(self.tokenizer_sample_mb > 0, "data.tokenizer_sample_mb", "a number > 0", self.tokenizer_sample_mb)
        _require(self.synthetic_samples >= 1, "data.synthetic_samples", "an integer >= 1", self.synthetic_samples)


@dataclass
class TrainConfig:
    """The optimisation: batch, steps, optimizer, learning-rate schedule, precision."""
    micro_batch_size: int = 8  # samples per forward/backward on one worker: what fits the device's memory
    # Micro batches per optimizer step on each worker (one gradient allreduce per step); derived
    # instead when global_batch_size is set.
    grad_accum: int = 1
    # When set, grad_accum is derived: global = micro_batch_size * grad_accum * world_size, or
    # where the workers do not divide it so, uneven shares of it in micro batches of at most
    # micro_batch_size (see resolve_batch).
    global_batch_size: Optional[int] = None
    max_steps: int = 100  # optimizer steps of the whole run; the schedule decays over them
    # A pause: a run that starts before this step stops cleanly after it, with a checkpoint (a
    # planned end within a time-limited allocation). A run that resumes at or past it, such as
    # the same command run again, ignores it and continues to max_steps. See last_step_of_run().
    stop_at_step: Optional[int] = None
    # "adamw" (torch's AdamW, fused on GPUs) or "lamb" (hvdtrain.optim.lamb, NVIDIA's LAMB for very
    # large batches; it needs weight_decay > 0).
    optimizer: Literal["adamw", "lamb"] = "adamw"
    lr: float = 3e-4  # the peak learning rate, reached at the end of warmup (times lr_scaling's factor)
    min_lr_ratio: float = 0.1  # the schedule's floor as a fraction of the peak lr
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # Adam's (beta1, beta2); 0.95 as GPT-3
    eps: float = 1e-8  # Adam's epsilon, added to the root of the second moment
    # Decoupled weight decay of the weight matrices (biases and LayerNorm weights get none); 0.1 as GPT-3.
    weight_decay: float = 0.1
    # With a fixed per-worker batch (global_batch_size null) the global batch grows with the
    # workers: "linear" multiplies lr by their number (Goyal et al.), "sqrt" by its square root
    # (gentler, often suits Adam). Must be "none" with a fixed global batch.
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    warmup_steps: int = 10  # steps of linear warmup, from lr / warmup_steps to lr; 0: none
    # After warmup: a "constant" rate, or a "linear" or "cosine" decay to min_lr_ratio * lr at
    # max_steps (hvdtrain.optim.lr_schedule).
    schedule: Literal["constant", "linear", "cosine"] = "cosine"
    # Seeds the model's initialisation (the same on every rank), the data order and the BERT
    # masks, and each rank's dropout stream, in [0, 2^32 - 1] (NumPy's seeds). A resume must use the checkpoint's.
    seed: int = 1234
    # "fp32" (matmuls in TF32 on GPUs), "bf16" autocast, or "fp16" autocast with a dynamic grad
    # scaler. fp32 by default: the CPU tests compare runs to rounding; the GPU recipes set bf16.
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    grad_clip: float = 1.0  # max global gradient norm; 0 turns clipping off
    # Steps with inf/NaN gradients are skipped (with fp16: by the grad scaler) and counted; this
    # many in a row stop the run, at the step the streak reaches it (not only at log points).
    max_bad_steps: int = 10
    # Debug aids, for the tests and scripts/bench_faults.py (a straggling rank), not for real
    # runs: seconds of extra sleep in every step's data phase on the ranks listed in slow_ranks.
    # They stay train.* keys because tests, campaigns and saved run configs write them so.
    slow_ranks: list[int] = field(default_factory=list)
    slow_seconds: float = 0.0

    def check(self):
        _require(self.micro_batch_size >= 1, "train.micro_batch_size", "an integer >= 1", self.micro_batch_size)
        _require(self.grad_accum >= 1, "train.grad_accum", "an integer >= 1", self.grad_accum)
        _require(self.global_batch_size is None or self.global_batch_size >= 1, "train.global_batch_size",
                 "an integer >= 1 or null", self.global_batch_size)
        _require(self.max_steps >= 1, "train.max_steps", "an integer >= 1", self.max_steps)
        _require(self.stop_at_step is None or 1 <= self.stop_at_step <= self.max_steps, "train.stop_at_step",
                 f"null or a step in [1, train.max_steps={self.max_steps}]", self.stop_at_step)
        _require(self.lr > 0, "train.lr", "a number > 0", self.lr)
        # The rate follows the global batch: scaling it with the workers is right only when the
        # batch grows with them. With a fixed global batch it would jump on a resume elsewhere.
        _require(self.lr_scaling == "none" or self.global_batch_size is None, "train.lr_scaling",
                 f"'none' while train.global_batch_size is fixed ({self.global_batch_size}), since the batch then "
                 "does not grow with the workers (or train.global_batch_size=null, to fix the per-worker batch)",
                 self.lr_scaling)
        _require(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", "a number in [0, 1]", self.min_lr_ratio)
        _require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "train.betas",
                 "two numbers in [0, 1)", self.betas)
        _require(self.warmup_steps >= 0, "train.warmup_steps", "an integer >= 0", self.warmup_steps)
        _require(self.grad_clip >= 0, "train.grad_clip", "a number >= 0", self.grad_clip)
        _require(self.max_bad_steps >= 1, "train.max_bad_steps", "an integer >= 1", self.max_bad_steps)
        _require(0 <= self.seed < 2 ** 32, "train.seed", "an integer in [0, 2^32 - 1]", self.seed)
        _require(all(r >= 0 for r in self.slow_ranks), "train.slow_ranks", "ranks >= 0", self.slow_ranks)
        _require(self.slow_seconds >= 0, "train.slow_seconds", "a number >= 0", self.slow_seconds)
        _require(self.weight_decay >= 0, "train.weight_decay", "a number >= 0", self.weight_decay)
        _require(self.optimizer != "lamb" or self.weight_decay > 0, "train.weight_decay",
                 "a number > 0 with train.optimizer 'lamb' (its trust ratio applies only to parameters with "
                 "weight decay, as in NVIDIA's FusedLAMB: with none, LAMB is Adam)", self.weight_decay)


@dataclass
class HorovodConfig:
    """How Horovod reduces the gradients, and its own tuning knobs and diagnostics."""
    # Gradients sent as fp16 and turned back (Horovod's Compression.fp16), with either
    # parallel.reduce_gradients; so is gradient_predivide_factor applied.
    compression: Literal["none", "fp16"] = "none"
    # How the workers' gradients are combined: "average" (Horovod's default) or "sum". The
    # token normalisation (hvdtrain.parallel.distributed.TokenNormalizer) turns either into the same
    # step. "adasum" is refused (see check below).
    op: Literal["average", "adasum", "sum"] = "average"
    # With op "average", Horovod divides the gradients by this factor before the sum and by
    # (workers / factor) after it, which keeps fp16 sums in range; 1.0: divide once, after.
    gradient_predivide_factor: float = 1.0
    # MiB of Horovod's fusion buffer, in which small gradients travel in one allreduce
    # (HOROVOD_FUSION_THRESHOLD); null: Horovod's default.
    fusion_threshold_mb: Optional[float] = None
    # Milliseconds between Horovod's background cycles, each of which sends the tensors that are
    # ready (HOROVOD_CYCLE_TIME); null: Horovod's default.
    cycle_time_ms: Optional[float] = None
    timeline: Optional[str] = None  # Horovod timeline of the whole run (relative paths: inside out_dir)
    # Horovod tunes its fusion buffer, cycle time and more while the run goes (HOROVOD_AUTOTUNE);
    # its log is copied to out_dir/horovod_autotune.csv.
    autotune: bool = False
    # A worker that stops taking part (stuck in I/O, a deadlock, SIGSTOP) leaves the others
    # waiting in a collective for ever: after this many seconds without a finished step (or
    # evaluation or checkpoint) every worker says where it is and exits, naming the stalled rank
    # (see hvdtrain.training.run_guards.StallWatchdog). 0: wait for ever. As torch's NCCL default, 10 min.
    stall_timeout_s: float = 600.0

    def check(self):
        _require(self.stall_timeout_s >= 0, "horovod.stall_timeout_s", "a number of seconds >= 0 (0: no limit)",
                 self.stall_timeout_s)
        _require(self.gradient_predivide_factor > 0, "horovod.gradient_predivide_factor", "a number > 0",
                 self.gradient_predivide_factor)
        _require(self.fusion_threshold_mb is None or self.fusion_threshold_mb >= 0, "horovod.fusion_threshold_mb",
                 "a number of MiB >= 0 (0: no fusion) or null", self.fusion_threshold_mb)
        _require(self.cycle_time_ms is None or self.cycle_time_ms > 0, "horovod.cycle_time_ms",
                 "a number of milliseconds > 0 or null", self.cycle_time_ms)
        if self.op == "adasum":
            # Horovod's Adasum optimizer applies each update inside the backward hooks, before the
            # token normalisation, fp16 unscaling and gradient clipping that every step needs.
            raise UserError("config key 'horovod.op': 'adasum' is not supported (Horovod's Adasum optimizer steps "
                            "inside backward, before hvdtrain's loss normalisation, clipping and fp16 unscaling); "
                            "use 'average'")
        _require(self.op == "average" or self.gradient_predivide_factor == 1.0,
                 "horovod.gradient_predivide_factor", "1.0 unless horovod.op is 'average'",
                 self.gradient_predivide_factor)


SHARD_LEVELS = ("none", "optimizer", "gradients", "full")  # parallel.shard's values, least sharded first


@dataclass
class ParallelConfig:
    """How the model is spread over the workers beyond data parallelism (docs/pipeline.md)."""
    # Pipeline parallelism, for models that do not fit one GPU: the transformer's layers are cut
    # into this many consecutive stages on different workers (embeddings on the first, the head
    # on the last), and Horovod data parallelism runs across the copies of each stage:
    # workers = pipeline_stages x data-parallel copies. 1: every worker holds the whole model.
    pipeline_stages: int = 1
    # torch.distributed.pipelining's schedule. interleaved1f1b runs stages_per_rank stages per worker.
    schedule: Literal["gpipe", "1f1b", "interleaved1f1b"] = "1f1b"
    # Stages each worker runs: >= 2 with interleaved1f1b, whose bubble it shrinks to
    # (p-1)/(v*m+p-1); 1 with the other schedules.
    stages_per_rank: int = 1
    # Micro batches per run of the schedule (>= pipeline_stages); each optimizer step runs
    # grad_accum micro batches, so grad_accum must be a multiple. Default: grad_accum (one run per
    # step, the smallest bubble: (p-1)/(m+p-1)).
    microbatches: Optional[int] = None
    # Hand-made split: stage i owns layers b[i] .. b[i+1]-1, from 0 to model.n_layer. Default:
    # even, counting the embedding and the head as one layer each. "auto": balanced on the
    # layers', embeddings' and head's forward + backward times, measured at the run's start on
    # its hardware and cached (hvdtrain.parallel.layer_costs, docs/pipeline.md).
    layer_boundaries: Optional[list[int] | Literal["auto"]] = None
    # When the copies of a pipeline stage (or of a tensor-parallel slice) reduce their gradients:
    # "during" the backward (Horovod's hooks, overlapped) or "after" it. On NCCL two
    # communicators in flight at once can hang, so the default is "after" on GPUs, "during" on CPUs.
    reduce_gradients: Optional[Literal["during", "after"]] = None
    # Sharding over the data-parallel copies (of each pipeline stage), over Horovod's
    # reduce-scatter and allgather (hvdtrain.parallel.sharded_optimizer, docs/memory.md); the same
    # maths as "none". Bytes per parameter, d copies (fp32 / bf16 weights):
    #   none       today's allreduce: 16 / 14 (+ autocast's copies)
    #   optimizer  ZeRO-1, Megatron-Core's distributed optimizer: each copy keeps and steps 1/d of
    #              the optimizer state (and of the fp32 masters where the weights are bf16), the
    #              step's gradients reduce-scattered at its last micro batch: 8 + 8/d / 6 + 12/d
    #   gradients  ZeRO-2: every micro batch's gradients reduce-scattered into fp32 slices that
    #              accumulate over the step: 4 + 12/d / 2 + 16/d
    #   full       ZeRO-3 / FSDP: the weights too live only as this copy's fp32 master slices; each
    #              unit (block, embeddings, head) allgathered just before its forward and its
    #              backward, the next one prefetched: 16/d + the units in flight
    # Needs horovod.compression "none" and op average or sum; elastic jobs refuse it. Off by
    # default: 2 collectives per step where one allreduce fits the memory (3 with "full").
    shard: Literal[SHARD_LEVELS] = "none"
    # Deprecated spelling of shard: "optimizer" (true); false leaves parallel.shard as it is.
    shard_optimizer: bool = False
    # Expert parallelism (model.arch mixtral, docs/experts.md): the experts of each layer split
    # over this many neighbouring workers, each token sent to the workers holding its experts and
    # back with Horovod's alltoall; the expert weights' gradients reduced over the workers / e
    # holding the same experts, the others' over all. Must divide model.experts and the workers.
    # With parallel.shard the expert weights (their state; with full, the weights themselves,
    # gathered unit by unit) are sharded over the workers holding the same experts. With pipeline
    # stages each stage's copies form the expert groups (must divide them), and with
    # parallel.shard the stage's copies shard its dense weights. 1: every worker holds every expert.
    expert_parallel: int = 1
    # Tensor parallelism (Megatron-LM's, docs/tensor-parallel.md): each layer's attention and MLP
    # matrices split over this many neighbouring workers (one node), which read the same samples,
    # with torch.distributed.tensor.parallel; the workers / t copies are data parallel as without.
    # Must divide the workers, model.n_head and model.n_kv_head. With parallel.shard each rank's
    # slices are sharded over the copies holding the same ones (full: its slices of the weights
    # too, gathered unit by unit). With pipeline stages each stage's layers are split (workers =
    # t x stages x copies). Not yet with model.arch mixtral or expert parallelism. 1: whole layers.
    tensor_parallel: int = 1

    def check(self):
        _require(self.pipeline_stages >= 1, "parallel.pipeline_stages", "an integer >= 1", self.pipeline_stages)
        _require(self.stages_per_rank >= 1, "parallel.stages_per_rank", "an integer >= 1", self.stages_per_rank)
        _require(self.expert_parallel >= 1, "parallel.expert_parallel", "an integer >= 1", self.expert_parallel)
        _require(self.tensor_parallel >= 1, "parallel.tensor_parallel", "an integer >= 1", self.tensor_parallel)
        _require(self.microbatches is None or self.microbatches >= 1, "parallel.microbatches",
                 "null or an integer >= 1", self.microbatches)
        _require(not self.shard_optimizer or self.shard in ("none", "optimizer"), "parallel.shard_optimizer",
                 f"false with parallel.shard={self.shard!r} (shard_optimizer: true is parallel.shard: optimizer)",
                 self.shard_optimizer)
        if self.shard_optimizer:  # the old spelling: everything reads parallel.shard
            self.shard = "optimizer"


@dataclass
class ElasticConfig:
    """Elastic jobs (hvdtrain launch --elastic, docs/elastic.md)."""
    # Steps between in-memory commits of the training state. A lost worker rolls every worker
    # back to the last commit; a commit also happens after every checkpoint (none at the run's
    # last step), and added workers join at one. 10: a reset redoes at most 10 steps, for a copy
    # of the training state to host memory every 10 steps.
    commit_every: int = 10

    def check(self):
        _require(self.commit_every >= 1, "elastic.commit_every", "an integer >= 1", self.commit_every)


@dataclass
class CheckpointConfig:
    """When checkpoints are written and kept (docs/checkpoints.md)."""
    every: int = 0  # steps between checkpoints; 0: only at the end
    keep: int = 2  # how many of the newest checkpoints to keep
    resume: bool = True  # resume from the newest checkpoint in out_dir when there is one

    def check(self):
        _require(self.every >= 0, "checkpoint.every", "an integer >= 0", self.every)
        _require(self.keep >= 1, "checkpoint.keep", "an integer >= 1", self.keep)


@dataclass
class WandbConfig:
    """The run in Weights & Biases (docs/research.md): from rank 0, every metric of each log point;
    the resolved config as the run's config. WANDB_MODE=offline keeps it in out_dir/wandb."""
    enabled: bool = False  # true: no wandb installed, or its run not started, is an error (exit 2)
    project: str = "hvdtrain"
    entity: Optional[str] = None  # the team or user; default: wandb's own (WANDB_ENTITY, the login's)
    name: Optional[str] = None  # the run's display name; default: out_dir's folder name
    tags: list[str] = field(default_factory=list)


@dataclass
class MlflowConfig:
    """The run in MLflow (docs/research.md): params from the config, every metric of each log point,
    the hf/ export as an artifact at the end."""
    enabled: bool = False  # true: no mlflow installed, or its store not reachable, is an error (exit 2)
    tracking_uri: Optional[str] = None  # default: a local store, out_dir/mlruns
    experiment: str = "hvdtrain"
    log_model: bool = True  # the exported hf/ folder as the run's artifact "hf" at the end


@dataclass
class LogConfig:
    """What is recorded of training, and how often (metrics.jsonl, TensorBoard, trackers, the console)."""
    # Steps between records of metrics.jsonl and TensorBoard; a record holds every step's loss
    # since the one before, and the step-time breakdown averaged over them.
    every: int = 10
    progress: bool = True  # progress bar on rank 0
    tensorboard: bool = True  # the records also as TensorBoard events in out_dir/tensorboard
    step_breakdown: bool = True  # data / compute / allreduce / optimizer timings per rank
    imbalance_threshold: float = 0.2  # warn when (slowest - fastest) / fastest compute passes this
    peak_tflops: Optional[float] = None  # MFU denominator; default from the GPU name
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)

    def check(self):
        _require(self.every >= 1, "log.every", "an integer >= 1", self.every)
        _require(self.imbalance_threshold >= 0, "log.imbalance_threshold", "a number >= 0", self.imbalance_threshold)
        _require(self.peak_tflops is None or self.peak_tflops > 0, "log.peak_tflops", "a number > 0 or null",
                 self.peak_tflops)


@dataclass
class EvalConfig:
    """Evaluation on the validation blocks (also at step 0, the baseline)."""
    every: int = 0  # steps between evaluations; 0: only at the end
    # Micro batches per evaluation, split across the ranks: null (the default) scores the whole
    # validation split; a number caps it at its first `batches` x train.micro_batch_size blocks
    # (for a large split). The same blocks at every evaluation, whatever the world size.
    batches: Optional[int] = None

    def check(self):
        _require(self.every >= 0, "eval.every", "an integer >= 0", self.every)
        _require(self.batches is None or self.batches >= 1, "eval.batches", "null (all) or an integer >= 1",
                 self.batches)


@dataclass
class ProfileConfig:
    """A profiled run (hvdtrain profile; hvdtrain.observe.profiling): torch.profiler on some ranks,
    written to out_dir/profile. Steps count the optimizer steps of this run (a resume counts
    from where it starts)."""
    enabled: bool = False  # `hvdtrain profile CONFIG` sets it
    ranks: list[int] = field(default_factory=lambda: [0])  # the ranks that record a trace
    # torch.profiler's schedule: skip `wait` steps (the first step carries one-time costs), run
    # `warmup` steps with the profiler on but its records dropped (its own start-up cost), then
    # record `active` steps: a few, which keep the trace small enough to open in a viewer.
    wait: int = 1
    warmup: int = 1
    active: int = 3
    memory: bool = False  # also record memory allocations (the operator table gains memory columns)
    timeline: bool = True  # Horovod timeline for the same run

    def check(self):
        _require(all(r >= 0 for r in self.ranks), "profile.ranks", "ranks >= 0", self.ranks)
        _require(self.wait >= 0, "profile.wait", "an integer >= 0", self.wait)
        _require(self.warmup >= 0, "profile.warmup", "an integer >= 0", self.warmup)
        _require(self.active >= 1, "profile.active", "an integer >= 1", self.active)


@dataclass
class Config:
    # The run folder: the resolved config, metrics.jsonl, checkpoints and the hf/ export at the
    # end. The same command run again resumes from it.
    out_dir: str = "runs/default"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    horovod: HorovodConfig = field(default_factory=HorovodConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- loading and checking

def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false",
            type(None): "null"}.get(tp, getattr(tp, "__name__", str(tp)))


def _convert(value, tp, key: str):
    """Check `value` against the type hint `tp`; return it converted (ints to floats)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _convert(value, arg, key)
            except UserError:
                pass
    elif origin is Literal:
        if value in typing.get_args(tp):
            return value
    elif origin is list:
        if isinstance(value, list):
            return [_convert(v, typing.get_args(tp)[0], key) for v in value]
    elif tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, str):  # PyYAML reads 3e-4 (no dot) as a string: YAML 1.1's float syntax
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, dict):
            return _build(tp, value, key + ".")
    raise UserError(f"config key '{key}': expected {_type_name(tp)}, got {value!r}")


def _build(cls, values: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in values:
        if key not in names:
            raise UserError(f"unknown config key '{prefix}{key}' (known: {', '.join(sorted(names))})")
    kwargs = {k: _convert(v, hints[k], prefix + k) for k, v in values.items()}
    return cls(**kwargs)


def parse_override(text: str) -> tuple[list[str], object]:
    """'train.lr=3e-4' -> (['train', 'lr'], 0.0003). Values are read as YAML scalars."""
    if "=" not in text:
        raise UserError(f"override '{text}': expected key.sub=value")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise UserError(f"override '{text}': expected key.sub=value")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def merge_override(tree: dict, path: list[str], value):
    node = tree
    for i, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"override '{'.'.join(path)}': '{'.'.join(path[:i + 1])}' is not a section")
        node = child
    node[path[-1]] = value


def deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def read_yaml(path: str, seen: tuple = ()) -> dict:
    """A recipe file; `base: other.yaml` (relative to this file) inherits that recipe's keys."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file '{path}' does not exist")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise UserError(f"config file '{path}'{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"config file '{path}': expected a mapping of keys at the top level")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise UserError(f"config file '{path}': 'base' must be the path of another recipe")
    base_path = (p.parent / base).resolve()
    if base_path in seen:
        raise UserError(f"config file '{path}': 'base' chain loops back to {base_path}")
    return deep_merge(read_yaml(str(base_path), seen + (base_path,)), data)


def load_config(path: Optional[str], overrides: list[str] = ()) -> Config:
    tree = read_yaml(path) if path else {}
    for text in overrides:
        merge_override(tree, *parse_override(text))
    cfg = _build(Config, tree)
    validate(cfg)
    return cfg


def config_from_dict(tree: dict) -> Config:
    """Rebuild a Config saved in a checkpoint or run folder."""
    cfg = _build(Config, tree)
    validate(cfg)
    return cfg


def validate(cfg: Config):
    """Value checks that types alone cannot express: every section's own `check()`, then the
    checks that relate keys of different sections. Checks that need the data or the world size
    (e.g. global batch larger than the dataset) happen where those are known."""
    for section in dataclasses.fields(cfg):
        value = getattr(cfg, section.name)
        if dataclasses.is_dataclass(value):
            value.check()
    m, d, par = cfg.model, cfg.data, cfg.parallel
    _require(m.max_position is None or m.max_position >= d.seq_len, "model.max_position",
             f"null or >= data.seq_len ({d.seq_len})", m.max_position)
    _require(par.pipeline_stages * par.stages_per_rank <= m.n_layer or m.pretrained, "parallel.pipeline_stages",
             f"at most model.n_layer={m.n_layer} stages in all (x parallel.stages_per_rank)", par.pipeline_stages)
    # transformers' grouped matmul of the experts takes 16-bit weights (parallel.shard keeps them
    # in bf16/fp16) only with rows of a multiple of 16 bytes
    _require(m.arch != "mixtral" or par.shard == "none" or cfg.train.precision == "fp32" or m.pretrained
             or all(v is None or v % 8 == 0 for v in (m.d_ff, m.d_model)), "model.d_ff",
             f"a multiple of 8 (and model.d_model too) with model.arch mixtral, train.precision "
             f"{cfg.train.precision} and parallel.shard {par.shard} (the experts' grouped matmul of 16-bit "
             "weights needs rows of 16 bytes)", m.d_ff)
    if par.expert_parallel > 1:
        _require(m.arch == "mixtral", "parallel.expert_parallel", f"1 with model.arch {m.arch!r} (a family without "
                 "experts)", par.expert_parallel)
        experts = m.experts or MIXTRAL_EXPERTS
        _require(experts % par.expert_parallel == 0, "parallel.expert_parallel",
                 f"a divisor of model.experts ({experts})", par.expert_parallel)
        # LAMB's trust ratio takes the norm of a whole weight; a rank holds some experts' rows.
        _require(cfg.train.optimizer != "lamb", "train.optimizer", "'adamw' with parallel.expert_parallel > 1 "
                 "(LAMB's trust ratio needs the norm of each whole expert weight)", cfg.train.optimizer)
    if par.tensor_parallel > 1:
        t = par.tensor_parallel
        _require(family(m.arch).splits_layers, "parallel.tensor_parallel",
                 f"1 with model.arch {m.arch!r} (its layers are not split yet)", t)
        for key, heads in (("model.n_head", m.n_head), ("model.n_kv_head", m.n_kv_head)):
            _require(m.pretrained or heads is None or heads % t == 0, "parallel.tensor_parallel",
                     f"a divisor of {key} ({heads}): each worker holds {key} / t heads", t)
        for key, value, other in (("parallel.expert_parallel", par.expert_parallel, 1),
                                  ("train.optimizer", cfg.train.optimizer, "adamw")):
            _require(value == other, key, f"{other!r} with parallel.tensor_parallel > 1 (not supported together yet)",
                     value)
        if par.pipeline_stages > 1:
            # split layers' gradients (DTensors) do not go through Horovod's hooks
            _require(par.reduce_gradients != "during", "parallel.reduce_gradients",
                     "'after' with parallel.tensor_parallel > 1 and pipeline stages", par.reduce_gradients)
    # Cross-section: sharding reduce-scatters the gradients itself, uncompressed.
    _require(par.shard == "none" or cfg.horovod.compression == "none", "horovod.compression",
             f"'none' with parallel.shard={par.shard!r} (the gradients are reduce-scattered in their own dtype)",
             cfg.horovod.compression)
    # Not yet tried: torch.compile over blocks whose weights are gathered and freed by module hooks.
    _require(par.shard != "full" or not m.compile, "model.compile",
             "false with parallel.shard='full' (compiled blocks with gathered weights are not supported yet)", m.compile)


def resolve_batch(cfg: Config, world_size: int) -> tuple[int, int]:
    """(grad_accum, global_batch) for this world size. With train.global_batch_size set, the
    global batch stays fixed and accumulation absorbs the change of world size: every rank runs
    grad_accum = ceil(ceil(global / copies) / micro_batch_size) micro batches. When the copies
    do not divide the global batch evenly into micro batches of that size (an elastic job that
    lost a worker: 512 on 7 workers), ranks take uneven shares of it in micro batches of at most
    train.micro_batch_size (hvdtrain.data.sampler.StreamSampler); the loss is normalised by the
    step's target tokens on all ranks, so the step is exactly the same. With pipeline stages,
    the copies that read different data are world_size / parallel.pipeline_stages, and the
    division must be exact (a schedule's run splits into micro batches of one size). With tensor
    parallelism the copies are world_size / parallel.tensor_parallel."""
    t, stages, split = cfg.train, cfg.parallel.pipeline_stages, cfg.parallel.tensor_parallel
    for key, size in (("parallel.pipeline_stages", stages), ("parallel.tensor_parallel", split)):
        if world_size % size:
            raise UserError(f"config key '{key}': {size} does not divide the {world_size} workers")
    copies = world_size // (stages * split)  # the workers of a pipeline, or of a layer's slices, read the same samples
    readers = ("workers" if copies == world_size else
               f"data-parallel copies ({world_size} workers / {stages} stages / {split} slices of each layer)")
    if t.global_batch_size is None:
        grad_accum = t.grad_accum
    elif stages > 1 and t.global_batch_size % (t.micro_batch_size * copies):
        raise UserError(f"config key 'train.global_batch_size': {t.global_batch_size} is not a multiple of "
                        f"train.micro_batch_size x {readers} = {t.micro_batch_size} x {copies}")
    elif t.global_batch_size < copies:
        raise UserError(f"config key 'train.global_batch_size': {t.global_batch_size} is smaller than the "
                        f"{copies} {readers}; every worker needs at least one sample per step")
    else:
        largest_share = -(-t.global_batch_size // copies)  # ceiling divisions
        grad_accum = -(-largest_share // t.micro_batch_size)
    microbatches = cfg.parallel.microbatches or grad_accum
    if stages > 1 and grad_accum % microbatches:
        raise UserError(f"config key 'parallel.microbatches': {microbatches} does not divide the {grad_accum} micro "
                        f"batches of each step (train.micro_batch_size x micro batches x {readers} = global batch)")
    return grad_accum, t.global_batch_size or t.micro_batch_size * grad_accum * copies


def last_step_of_run(t: TrainConfig, start_step: int) -> int:
    """The step a run that starts (or resumes) at `start_step` ends after. train.stop_at_step
    is a pause: it ends a run that starts before it, and a run that resumes at or past it,
    such as the same command run again after that pause, continues to train.max_steps."""
    if t.stop_at_step is not None and start_step < t.stop_at_step:
        return t.stop_at_step
    return t.max_steps
