"""The typed configuration: every key, its type and its default, in one place.

A run is described by a YAML file plus dotted overrides on the command line
(`train.lr=3e-4 data.seq_len=256`). `load_config` merges them, checks every key and
value against the dataclasses below and returns a `Config`. Any mistake raises a
UserError whose message names the key (or file) and what was expected.
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


@dataclass
class ModelConfig:
    arch: Literal["gpt2", "bert"] = "gpt2"
    pretrained: Optional[str] = None  # local folder or hub name to continue pretraining from
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 64
    d_ff: Optional[int] = None  # default 4 * d_model
    max_position: Optional[int] = None  # default: data.seq_len
    dropout: float = 0.1
    compile: bool = False  # torch.compile per transformer block (keeps allreduce overlapped with backward)
    activation_checkpointing: bool = False


@dataclass
class DataConfig:
    # "builtin" (offline English prose shipped with Python), "synthetic" (random tokens),
    # a local file / directory / glob (.txt .jsonl .json .csv .parquet), or a hub dataset name.
    source: str = "builtin"
    hub_config: Optional[str] = None  # e.g. wikitext-103-raw-v1
    split: str = "train"
    validation_split: Optional[str] = None  # the dataset's own split; otherwise a held-out fraction
    validation_fraction: float = 0.02
    streaming: bool = False
    text_column: str = "text"
    tokenizer: str = "train"  # "train", or a local path / hub name of a pretrained tokenizer
    vocab_size: int = 4096  # for a trained tokenizer (and synthetic data)
    seq_len: int = 128
    mlm_probability: float = 0.15
    synthetic_samples: int = 2048
    num_workers: int = 1  # DataLoader worker processes per rank
    # Tokenizing processes per worker; null: the cores this worker may use (os.sched_getaffinity).
    num_proc: Optional[int] = None
    max_documents: Optional[int] = None  # read at most this many documents of each split of the source
    max_tokens: Optional[int] = None  # stop preparing once the training split has this many tokens
    tokenizer_sample_mb: float = 64.0  # a trained tokenizer learns from this many million characters
    cache_dir: Optional[str] = None  # default ~/.cache/hvdtrain


@dataclass
class TrainConfig:
    micro_batch_size: int = 8
    grad_accum: int = 1
    # When set, grad_accum is derived: global = micro_batch_size * grad_accum * world_size, or
    # where the workers do not divide it so, uneven shares of it in micro batches of at most
    # micro_batch_size (see resolve_batch).
    global_batch_size: Optional[int] = None
    max_steps: int = 100
    # A pause: a run that starts before this step stops cleanly after it, with a checkpoint (a
    # planned end within a time-limited allocation). A run that resumes at or past it, such as
    # the same command run again, ignores it and continues to max_steps. See last_step_of_run().
    stop_at_step: Optional[int] = None
    optimizer: Literal["adamw", "lamb"] = "adamw"
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # the schedule's floor as a fraction of the peak lr
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    warmup_steps: int = 10
    schedule: Literal["constant", "linear", "cosine"] = "cosine"
    seed: int = 1234
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    grad_clip: float = 1.0  # max global gradient norm; 0 turns clipping off
    # Steps with inf/NaN gradients are skipped (with fp16: by the grad scaler) and counted; this
    # many in a row stop the run, at the step the streak reaches it (not only at log points).
    max_bad_steps: int = 10
    # Testing aid: seconds of extra sleep per optimizer step on the ranks listed in slow_ranks.
    slow_ranks: list[int] = field(default_factory=list)
    slow_seconds: float = 0.0


@dataclass
class HorovodConfig:
    # Gradients sent as fp16 and turned back (Horovod's Compression.fp16), with either
    # parallel.reduce_gradients; so is gradient_predivide_factor applied.
    compression: Literal["none", "fp16"] = "none"
    op: Literal["average", "adasum", "sum"] = "average"
    gradient_predivide_factor: float = 1.0
    fusion_threshold_mb: Optional[float] = None  # HOROVOD_FUSION_THRESHOLD
    cycle_time_ms: Optional[float] = None  # HOROVOD_CYCLE_TIME
    timeline: Optional[str] = None  # Horovod timeline of the whole run (relative paths: inside out_dir)
    autotune: bool = False  # HOROVOD_AUTOTUNE
    # A worker that stops taking part (stuck in I/O, a deadlock, SIGSTOP) leaves the others
    # waiting in a collective for ever: after this many seconds without a finished step (or
    # evaluation or checkpoint) every worker says where it is and exits, naming the stalled rank
    # (see hvdtrain.run_control.StallWatchdog). 0: wait for ever. As torch's NCCL default, 10 min.
    stall_timeout_s: float = 600.0


@dataclass
class ParallelConfig:
    # Pipeline parallelism, for models that do not fit one GPU: the transformer's layers are cut
    # into this many consecutive stages on different workers (embeddings on the first, the head
    # on the last), and Horovod data parallelism runs across the copies of each stage:
    # workers = pipeline_stages x data-parallel copies. 1: every worker holds the whole model.
    pipeline_stages: int = 1
    # torch.distributed.pipelining's schedule. interleaved1f1b runs stages_per_rank stages per worker.
    schedule: Literal["gpipe", "1f1b", "interleaved1f1b"] = "1f1b"
    stages_per_rank: int = 1
    # Micro batches per run of the schedule (>= pipeline_stages); each optimizer step runs
    # grad_accum micro batches, so grad_accum must be a multiple. Default: grad_accum (one run per
    # step, the smallest bubble: (p-1)/(m+p-1)).
    microbatches: Optional[int] = None
    # Hand-made split: stage i owns layers b[i] .. b[i+1]-1, from 0 to model.n_layer. Default:
    # even, counting the embedding and the head as one layer each.
    layer_boundaries: Optional[list[int]] = None
    # When the copies of a stage reduce their gradients: "during" the pipeline's backward
    # (Horovod's hooks, overlapped) or "after" it (one grouped allreduce). On NCCL two
    # communicators in flight at once can hang, so the default is "after" on GPUs, "during" on CPUs.
    reduce_gradients: Optional[Literal["during", "after"]] = None
    # ZeRO stage 1 (Megatron-Core's distributed optimizer) over Horovod: each data-parallel copy
    # (of each pipeline stage) keeps and steps 1/copies of the optimizer state, and of the fp32
    # master weights where the weights are 16-bit (bf16: the model computes in bf16 weights);
    # gradients are reduce-scattered and the updated weights allgathered, as many bytes on the
    # wire as one allreduce (hvdtrain.sharded_optimizer). The same maths as false; off by default
    # as it needs 2 collectives per step where one allreduce fits the memory.
    shard_optimizer: bool = False


@dataclass
class ElasticConfig:
    # Elastic jobs (hvdtrain launch --elastic): steps between in-memory commits of the training
    # state. A lost worker rolls every worker back to the last commit; a commit also happens
    # after every checkpoint (none at the run's last step), and added workers join at one.
    commit_every: int = 10


@dataclass
class CheckpointConfig:
    every: int = 0  # steps between checkpoints; 0: only at the end
    keep: int = 2  # how many of the newest checkpoints to keep
    resume: bool = True  # resume from the newest checkpoint in out_dir when there is one


@dataclass
class LogConfig:
    every: int = 10
    progress: bool = True  # progress bar on rank 0
    tensorboard: bool = True
    step_breakdown: bool = True  # data / compute / allreduce / optimizer timings per rank
    imbalance_threshold: float = 0.2  # warn when (slowest - fastest) / fastest compute passes this
    peak_tflops: Optional[float] = None  # MFU denominator; default from the GPU name


@dataclass
class EvalConfig:
    every: int = 0  # steps between evaluations; 0: only at the end
    batches: int = 8  # micro batches per evaluation, split across the ranks


@dataclass
class ProfileConfig:
    enabled: bool = False
    ranks: list[int] = field(default_factory=lambda: [0])
    wait: int = 1
    warmup: int = 1
    active: int = 3
    memory: bool = False
    timeline: bool = True  # Horovod timeline for the same run


@dataclass
class Config:
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


def _require(ok: bool, key: str, expected: str, value):
    if not ok:
        raise UserError(f"config key '{key}': expected {expected}, got {value!r}")


def validate(cfg: Config):
    """Value checks that types alone cannot express. Checks that need the data or the world
    size (e.g. global batch larger than the dataset) happen where those are known."""
    t, d, m = cfg.train, cfg.data, cfg.model
    _require(t.micro_batch_size >= 1, "train.micro_batch_size", "an integer >= 1", t.micro_batch_size)
    _require(t.grad_accum >= 1, "train.grad_accum", "an integer >= 1", t.grad_accum)
    _require(t.global_batch_size is None or t.global_batch_size >= 1, "train.global_batch_size",
             "an integer >= 1 or null", t.global_batch_size)
    _require(t.max_steps >= 1, "train.max_steps", "an integer >= 1", t.max_steps)
    _require(t.stop_at_step is None or 1 <= t.stop_at_step <= t.max_steps, "train.stop_at_step",
             f"null or a step in [1, train.max_steps={t.max_steps}]", t.stop_at_step)
    _require(t.lr > 0, "train.lr", "a number > 0", t.lr)
    # The rate follows the global batch: scaling it with the workers is right only when the
    # batch grows with them. With a fixed global batch it would jump on a resume elsewhere.
    _require(t.lr_scaling == "none" or t.global_batch_size is None, "train.lr_scaling",
             f"'none' while train.global_batch_size is fixed ({t.global_batch_size}), since the batch then "
             "does not grow with the workers (or train.global_batch_size=null, to fix the per-worker batch)",
             t.lr_scaling)
    _require(0 <= t.min_lr_ratio <= 1, "train.min_lr_ratio", "a number in [0, 1]", t.min_lr_ratio)
    _require(len(t.betas) == 2 and all(0 <= b < 1 for b in t.betas), "train.betas", "two numbers in [0, 1)", t.betas)
    _require(t.warmup_steps >= 0, "train.warmup_steps", "an integer >= 0", t.warmup_steps)
    _require(t.grad_clip >= 0, "train.grad_clip", "a number >= 0", t.grad_clip)
    _require(t.max_bad_steps >= 1, "train.max_bad_steps", "an integer >= 1", t.max_bad_steps)
    _require(t.weight_decay >= 0, "train.weight_decay", "a number >= 0", t.weight_decay)
    _require(t.optimizer != "lamb" or t.weight_decay > 0, "train.weight_decay",
             "a number > 0 with train.optimizer 'lamb' (its trust ratio applies only to parameters with "
             "weight decay, as in NVIDIA's FusedLAMB: with none, LAMB is Adam)", t.weight_decay)
    _require(d.seq_len >= 8, "data.seq_len", "an integer >= 8", d.seq_len)
    _require(0 < d.validation_fraction < 1, "data.validation_fraction", "a number in (0, 1)", d.validation_fraction)
    _require(0 < d.mlm_probability < 1, "data.mlm_probability", "a number in (0, 1)", d.mlm_probability)
    _require(d.vocab_size >= 64, "data.vocab_size", "an integer >= 64", d.vocab_size)
    _require(d.num_workers >= 0, "data.num_workers", "an integer >= 0", d.num_workers)
    _require(d.num_proc is None or d.num_proc >= 1, "data.num_proc", "an integer >= 1 or null", d.num_proc)
    _require(d.max_documents is None or d.max_documents >= 1, "data.max_documents", "an integer >= 1 or null",
             d.max_documents)
    _require(d.max_tokens is None or d.max_tokens >= 1, "data.max_tokens", "an integer >= 1 or null", d.max_tokens)
    _require(d.tokenizer_sample_mb > 0, "data.tokenizer_sample_mb", "a number > 0", d.tokenizer_sample_mb)
    _require(d.synthetic_samples >= 1, "data.synthetic_samples", "an integer >= 1", d.synthetic_samples)
    _require(m.n_layer >= 1, "model.n_layer", "an integer >= 1", m.n_layer)
    _require(m.n_head >= 1 and m.d_model % m.n_head == 0, "model.n_head",
             f"a divisor of model.d_model ({m.d_model})", m.n_head)
    _require(0 <= m.dropout < 1, "model.dropout", "a number in [0, 1)", m.dropout)
    _require(m.max_position is None or m.max_position >= d.seq_len, "model.max_position",
             f"null or >= data.seq_len ({d.seq_len})", m.max_position)
    _require(cfg.checkpoint.every >= 0, "checkpoint.every", "an integer >= 0", cfg.checkpoint.every)
    _require(cfg.checkpoint.keep >= 1, "checkpoint.keep", "an integer >= 1", cfg.checkpoint.keep)
    _require(cfg.log.every >= 1, "log.every", "an integer >= 1", cfg.log.every)
    _require(cfg.eval.every >= 0, "eval.every", "an integer >= 0", cfg.eval.every)
    _require(cfg.eval.batches >= 1, "eval.batches", "an integer >= 1", cfg.eval.batches)
    _require(cfg.horovod.stall_timeout_s >= 0, "horovod.stall_timeout_s", "a number of seconds >= 0 (0: no limit)",
             cfg.horovod.stall_timeout_s)
    _require(cfg.horovod.gradient_predivide_factor > 0, "horovod.gradient_predivide_factor", "a number > 0",
             cfg.horovod.gradient_predivide_factor)
    par = cfg.parallel
    _require(par.pipeline_stages >= 1, "parallel.pipeline_stages", "an integer >= 1", par.pipeline_stages)
    _require(par.stages_per_rank >= 1, "parallel.stages_per_rank", "an integer >= 1", par.stages_per_rank)
    _require(par.microbatches is None or par.microbatches >= 1, "parallel.microbatches", "null or an integer >= 1",
             par.microbatches)
    _require(par.pipeline_stages * par.stages_per_rank <= m.n_layer or m.pretrained, "parallel.pipeline_stages",
             f"at most model.n_layer={m.n_layer} stages in all (x parallel.stages_per_rank)", par.pipeline_stages)
    _require(not par.shard_optimizer or cfg.horovod.compression == "none", "horovod.compression",
             "'none' with parallel.shard_optimizer (the gradients are reduce-scattered in their own dtype)",
             cfg.horovod.compression)
    _require(cfg.elastic.commit_every >= 1, "elastic.commit_every", "an integer >= 1", cfg.elastic.commit_every)
    if cfg.horovod.op == "adasum":
        # Horovod's Adasum optimizer applies each update inside the backward hooks, before the
        # token normalisation, fp16 unscaling and gradient clipping that every step needs.
        raise UserError("config key 'horovod.op': 'adasum' is not supported (Horovod's Adasum optimizer steps "
                        "inside backward, before hvdtrain's loss normalisation, clipping and fp16 unscaling); "
                        "use 'average'")
    _require(cfg.horovod.op == "average" or cfg.horovod.gradient_predivide_factor == 1.0,
             "horovod.gradient_predivide_factor", "1.0 unless horovod.op is 'average'",
             cfg.horovod.gradient_predivide_factor)
    p = cfg.profile
    _require(p.wait >= 0 and p.warmup >= 0 and p.active >= 1, "profile.active", "an integer >= 1", p.active)


def resolve_batch(cfg: Config, world_size: int) -> tuple[int, int]:
    """(grad_accum, global_batch) for this world size. With train.global_batch_size set, the
    global batch stays fixed and accumulation absorbs the change of world size: every rank runs
    grad_accum = ceil(ceil(global / copies) / micro_batch_size) micro batches. When the copies
    do not divide the global batch evenly into micro batches of that size (an elastic job that
    lost a worker: 512 on 7 workers), ranks take uneven shares of it in micro batches of at most
    train.micro_batch_size (hvdtrain.sampler.StreamSampler); the loss is normalised by the
    step's target tokens on all ranks, so the step is exactly the same. With pipeline stages,
    the copies that read different data are world_size / parallel.pipeline_stages, and the
    division must be exact (a schedule's run splits into micro batches of one size)."""
    t, stages = cfg.train, cfg.parallel.pipeline_stages
    if world_size % stages:
        raise UserError(f"config key 'parallel.pipeline_stages': {stages} does not divide the {world_size} workers")
    copies = world_size // stages
    readers = "workers" if stages == 1 else f"data-parallel copies ({world_size} workers / {stages} stages)"
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
