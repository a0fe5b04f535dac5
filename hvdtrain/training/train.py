"""The training loop: one worker's view of a data-parallel run.

Every worker runs this same function (under horovodrun, or alone as a world of one).
Read top to bottom it is the whole recipe: init Horovod, check the data, find the checkpoint
to resume from, build the model and optimizer and take their state from rank 0, then per
optimizer step
    fetch grad_accum micro batches -> forward/backward each (allreduce starts in backward)
    -> wait for the allreduce -> normalise by the step's target tokens -> clip -> optimizer step
with logging, evaluation and checkpoints when they are due (hvdtrain.training.periodic).

How a step's micro batches become reduced, clipped gradients and an optimizer step is the step
engine's, chosen once in set-up (hvdtrain.training.step_engine): the plain step, or with
parallel.pipeline_stages = p > 1 the pipelined step, where each worker holds one stage of the
model (hvdtrain.parallel.pipeline), the micro batches go through torch's pipeline schedule, Horovod
reduces gradients among the copies of the stage only, the tied embedding is summed between
first and last stage and the gradient norm is taken over all stages; and with
parallel.shard the sharded step around either of them (hvdtrain.parallel.sharded_optimizer):
gradients reduce-scattered, this copy's slices clipped and stepped, the weights allgathered.
The loop below is the same code for all of them.
"""
import dataclasses
import gc
import hashlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from hvdtrain.checkpointing import checkpoint
from hvdtrain.parallel import distributed, expert_parallel, layer_costs, parallel_dims, pipeline, tensor_parallel
from hvdtrain.observe import metrics
from hvdtrain.config import Config, last_step_of_run, resolve_batch
from hvdtrain.data import DataBundle, build_data
from hvdtrain.errors import UserError
from hvdtrain.checkpointing.export import export_checkpoint
from hvdtrain.optim.lr_schedule import lr_multiplier
from hvdtrain.models import family_of
from hvdtrain.models.common import apply_speedups, keep_generation_config, model_blueprint, statistics_record
from hvdtrain.models.ties import tie_aliases
from hvdtrain.optim.optimizers import build_optimizer
from hvdtrain.paths import check_writable_folder
from hvdtrain.observe.profiling import Profiler
from hvdtrain.tools import plan
from hvdtrain.training.run_guards import NonFiniteGuard, StallWatchdog
from hvdtrain.training.stopping import PREEMPTED_EXIT_CODE, PreemptionSignal, RunStopped, mark_preempted
from hvdtrain.training.periodic import Checkpointer, Commits, Evaluator, StepLog
from hvdtrain.observe.run_log import RunLog
from hvdtrain.observe.trackers import Trackers
from hvdtrain.data.sampler import EvalSampler, StreamSampler, share
from hvdtrain.parallel.sharded_optimizer import ShardedOptimizer
from hvdtrain.parallel.sharded_weights import materialise_slices
from hvdtrain.training.step_engine import PlainStep, autocast_for, build_engine
from hvdtrain.observe.step_timer import StepTimer
from hvdtrain.training.training_state import TrainingState, find_resume_checkpoint


def check_data(cfg: Config, world, shards: int, global_batch: int, grad_accum: int) -> DataBundle:
    """Tokenized and cached once per host, then loaded by every rank; checked on all of them.
    `shards`: the workers that read different samples (the data-parallel copies)."""
    with distributed.leader_first(world, "data"):  # Horovod: barriers, local rank 0 first
        data = build_data(cfg, cfg.train.seed)
    # Hosts without a shared cache prepare their data separately: make sure they agree.
    data_id = hashlib.sha256(repr((len(data.train), len(data.val), data.vocab.size, data.tokenizer and
                                   data.tokenizer.backend_tokenizer.to_str())).encode()).hexdigest()
    if len(set(distributed.allgather_object(data_id, name="data_id"))) > 1:  # Horovod: allgather
        raise UserError("workers on different hosts built different data or tokenizers; point data.cache_dir "
                        "at a shared folder or give data.tokenizer a pretrained tokenizer")
    if global_batch > len(data.train):
        raise UserError(f"the global batch ({global_batch} samples: {batch_layout(cfg, shards, global_batch, grad_accum)}"
                        f") is larger than the training set ({len(data.train)} blocks of data.seq_len="
                        f"{cfg.data.seq_len} tokens)")
    return data


def batch_layout(cfg: Config, shards: int, global_batch: int, grad_accum: int) -> str:
    """How the workers share the global batch, in words: micro batch x accumulation x workers,
    or their uneven shares (see hvdtrain.data.sampler)."""
    micro = cfg.train.micro_batch_size
    if global_batch == micro * grad_accum * shards:
        return f"{shards} data-parallel workers x micro batch {micro} x accum {grad_accum}"
    shares = sorted({len(share(global_batch, r, shards)) for r in range(shards)}, reverse=True)
    return (f"{shards} data-parallel workers x {' or '.join(map(str, shares))} samples in {grad_accum} micro "
            f"batches of at most {micro} (uneven: {global_batch} is not a multiple of micro batch {micro} x "
            f"{shards} workers)")


def build_loaders(cfg: Config, data: DataBundle, world, shard: int, shards: int, grad_accum: int,
                  global_batch: int, state: TrainingState):
    """This rank's training batches from the state's stream position on, and its fixed
    validation batches: shard `shard` of `shards` (with pipeline stages every stage of a
    pipeline reads the same samples). The loaders get generators of their own: starting an
    iterator must not draw from the global RNG, whose state a resume restores for dropout."""
    t = cfg.train
    if state.position % global_batch:
        raise UserError(f"the checkpoint stopped after {state.position} samples, which is not a multiple of the "
                        f"global batch {global_batch}; resume with the global batch it was written with")
    # The sampler counts steps of this global batch from the stream's start; a resume with another
    # global batch starts at a different step number there than in training.
    sampler = StreamSampler(len(data.train), global_batch, grad_accum, shard, shards, t.seed,
                            start_position=state.position,
                            max_steps=state.position // global_batch + t.max_steps - state.step)
    loader = torch.utils.data.DataLoader(
        data.train, batch_sampler=sampler, collate_fn=data.collate, num_workers=cfg.data.num_workers,
        pin_memory=world.device.type == "cuda", prefetch_factor=4 if cfg.data.num_workers else None,
        persistent_workers=False, generator=torch.Generator().manual_seed(t.seed))
    eval_loader = torch.utils.data.DataLoader(
        data.val, batch_sampler=EvalSampler(len(data.val), t.micro_batch_size, cfg.eval.batches, shard, shards),
        collate_fn=data.collate, generator=torch.Generator().manual_seed(t.seed))
    return loader, eval_loader


def open_run_folder(cfg: Config, world, data: DataBundle, model, state: TrainingState, resumed_from: Path | None,
                    resolved: dict) -> RunLog | None:
    """Rank 0 writes the run folder, only now that every input has been checked."""
    if not world.is_main:
        return None
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(cfg.to_dict(), resolved=resolved)
    trackers = Trackers(cfg, cfg.out_dir, state.step, config)  # a tracker that cannot start: UserError, first
    (out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    if data.tokenizer is not None:
        data.tokenizer.save_pretrained(out / "tokenizer")
    if cfg.model.pretrained:
        keep_generation_config(cfg.model, out / "tokenizer")
    n_params = sum(p.numel() for p in model.parameters())
    stages = cfg.parallel.pipeline_stages
    world.print(f"hvdtrain: {cfg.model.arch} {n_params / 1e6:.2f}M parameters"
                + (f" on stage 0 of {stages} ({resolved['pipeline']})" if stages > 1 else "")
                + (f" on worker 0 ({resolved['experts']})" if "experts" in resolved else "")
                + f" | {resolved['batch']} = global batch {resolved['global_batch']} x {cfg.data.seq_len} tokens"
                f" | peak lr {resolved['peak_lr']:.3g}"
                + (f" | resuming at step {state.step} from {resumed_from}" if resumed_from else ""))
    return RunLog(cfg.out_dir, state.step, cfg.train.max_steps, cfg.log.progress, cfg.log.tensorboard, trackers)


@dataclass
class Setup:
    """What the step loop works with: made once by `set_up`, or again after every reset of an
    elastic job (hvdtrain.parallel.elastic), where the world can change size."""
    world: distributed.World
    data: DataBundle
    model: torch.nn.Module          # the whole model, or this worker's pipeline stage
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    state: TrainingState
    grad_accum: int
    global_batch: int
    peak_lr: float
    shard: int                      # which copy of the data this worker reads, of `shards`
    shards: int
    engine: PlainStep               # how a step is done (hvdtrain.training.step_engine)
    layout: parallel_dims.Layout | None = None
    resumed_from: Path | None = None


def stage_blueprint(cfg: Config, data: DataBundle, layout=None, bounds: list[int] | None = None):
    """The model's blueprint (parameters on the meta device, the same seed on every rank) with
    its speed-ups, cut to this worker's stage with layer `bounds` (with a layout), and the
    whole model's tied parameter names."""
    torch.manual_seed(cfg.train.seed)
    blueprint = model_blueprint(cfg.model, data.vocab, cfg.data.seq_len)  # parameters on the meta device
    model = blueprint.model
    apply_speedups(model, cfg.model)  # activation checkpointing, compiled blocks
    aliases = tie_aliases(model)  # of the whole model, before a split
    if layout is not None:  # keep this worker's stage only, under the whole model's names
        if bounds is None:
            bounds = pipeline.stage_bounds(model.config.num_hidden_layers, layout.stages, layout.stages_per_rank,
                                           cfg.parallel.layer_boundaries)
        model = pipeline.split_model(model, layout, bounds)
    return blueprint, model, aliases


def pipeline_bounds(cfg: Config, data: DataBundle, world, layout, grad_accum: int) -> list[int] | None:
    """The layer boundaries of the stages with parallel.layer_boundaries "auto", balanced on
    the layers' measured costs (hvdtrain.parallel.layer_costs); else None (stage_blueprint
    takes them from the config: given, or the even split)."""
    if layout is None or cfg.parallel.layer_boundaries != "auto":
        return None
    n_layer = stage_blueprint(cfg, data)[1].config.num_hidden_layers  # model.pretrained's, if given

    def build_probe(bounds):  # this rank's stage of `bounds`, weights only, on the device
        blueprint, model, _ = stage_blueprint(cfg, data, layout, bounds)
        return blueprint.materialise(model).to(world.device).train()

    def fits(bounds):  # every stage within 90% of the GPU, as `hvdtrain plan` counts it
        c = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, layer_boundaries=bounds))
        ranks = plan.stage_memory(c, cfg.parallel.microbatches or grad_accum, cfg.train.micro_batch_size,
                                  cfg.model.activation_checkpointing, copies=layout.dp)
        total = torch.cuda.get_device_properties(world.device).total_memory
        return max(r["total"] for r in ranks) <= plan.USABLE_FRACTION * total

    return layer_costs.auto_bounds(cfg, n_layer, layout, world, build_probe,
                                   autocast_for(world.device, cfg.train.precision),
                                   fits if world.device.type == "cuda" else None)


def build_model_and_optimizer(cfg: Config, data: DataBundle, device, grad_accum: int, shards: int,
                              layout=None, groups=None, shard: int = 0, bounds: list[int] | None = None,
                              expert_groups=None, tensor_groups=None):
    """The model (or this worker's stage of it, cut by `bounds`; with `expert_groups` this
    rank's experts only, with `tensor_groups` this rank's slices of each layer), its optimizer
    (Horovod's, unless the pipeline reduces after its run or the experts or layers are split; sharded over the `shards` copies with parallel.shard, this being
    copy `shard`) and grad scaler; the same seed on every rank.
    Returns them with the whole model's tied parameter names and whether gradients are reduced
    after the pipeline."""
    t, par = cfg.train, cfg.parallel
    blueprint, model, aliases = stage_blueprint(cfg, data, layout, bounds)
    compute_dtype = torch.bfloat16 if t.precision == "bf16" else torch.float32
    masters = None
    if expert_groups is not None:  # one layer's experts whole at a time on the host, this rank's kept
        expert_parallel.build_own_experts(blueprint, model, family_of(model).modeling().PARTS.is_experts, expert_groups)
    elif par.shard != "none" and tensor_groups is None:  # made real a unit at a time,
        # each put where training keeps it (its slices); split layers: made whole, then split
        masters = materialise_slices(blueprint, model, shard, shards, compute_dtype, device, par.shard)
    else:  # only now real: initialised per module, or read from model.pretrained
        blueprint.materialise(model)
    model.to(device)
    if tensor_groups is not None:  # every rank made whole layers alike; this rank's slices are kept
        tensor_parallel.parallelize(model, tensor_groups)
    model.train()
    peak_lr = t.lr * distributed.lr_scale(t.lr_scaling, shards)
    # The copies of a stage or of a slice reduce gradients during backward (Horovod's hooks), or
    # after it where NCCL would otherwise run two communicators at once: torch.distributed's
    # (the pipeline's sends, the tensor-parallel group's allreduces) beside Horovod's. Split
    # layers' gradients along a pipeline do not go through its hooks: reduced after.
    beside_torch = layout is not None or tensor_groups is not None
    reduce_after = beside_torch and ((layout is not None and tensor_groups is not None) or (
        par.reduce_gradients or ("after" if device.type == "cuda" else "during")) == "after")
    if par.shard != "none":
        tied_copy = layout is not None and layout.is_last and not layout.is_first  # not counted in the norm twice
        # the copies that reduce this worker's gradients: of its stage, of its slices, or all workers
        copies = groups.process_set if groups else tensor_groups.copies_set if tensor_groups else None
        optimizer = ShardedOptimizer(model, t, peak_lr, device, cfg.horovod, grad_accum, shard, shards,
                                     copies, reduce_during=not reduce_after,
                                     compute_dtype=compute_dtype, level=par.shard, masters=masters,
                                     not_counted=pipeline.tied_parameters(model).values() if tied_copy else (),
                                     tensor_group=tensor_groups.group if tensor_groups else None,
                                     elsewhere=expert_parallel.expert_copies(
                                         model, expert_parallel.expert_weight_names(model), expert_groups,
                                         cfg.horovod.op) if expert_groups else None)
    else:
        optimizer = build_optimizer(model, t, peak_lr, device)
        if not reduce_after and expert_groups is None and tensor_groups is None:  # split: reduced after backward
            # Horovod: DistributedOptimizer, allreduce of gradients from backward hooks
            optimizer = distributed.wrap_optimizer(optimizer, model, cfg.horovod, grad_accum,
                                                   groups.process_set if groups else None)
    # fp16: split weights' gradients are unscaled as their local tensors
    grad_scaler = tensor_parallel.LocalGradScaler if tensor_groups is not None else torch.amp.GradScaler
    scaler = grad_scaler(device.type, enabled=t.precision == "fp16")
    return model, optimizer, scaler, aliases, peak_lr, reduce_after


def set_up(cfg: Config) -> Setup:
    """Every step before the first training step, in order; collective."""
    # ---- set-up 1. Horovod: init, pin the GPU, seed
    check_writable_folder(cfg.out_dir, "out_dir")
    world = distributed.init(cfg)  # Horovod: hvd.init
    par = cfg.parallel
    grad_accum, global_batch = resolve_batch(cfg, world.size)
    # Pipeline stages: this worker's place in the stages x copies (x tensor slices) grid; the copies shard the data.
    layout = (parallel_dims.layout_for(world.rank, world.size, par.pipeline_stages, par.stages_per_rank,
                                       tp=par.tensor_parallel, ep=par.expert_parallel)
              if par.pipeline_stages > 1 else None)
    shard, shards = (layout.dp_rank, layout.dp) if layout else (world.rank, world.size)
    # Split experts: each rank of an expert group holds 1/e of every layer's experts; the groups
    # are the grid's "ep" (the stages' copies split in groups of e), opened in set-up 4
    expert_grid = ((layout.grid if layout else expert_parallel.expert_grid(world.size, par.expert_parallel))
                   if par.expert_parallel > 1 else None)
    # Split layers without stages: the t ranks of a tensor-parallel group read the same samples
    # (with stages, the pipeline's groups include theirs: set-up 4)
    tensor_groups = (tensor_parallel.open_tensor_groups(world.rank, world.size, par.tensor_parallel, world.device)
                     if par.tensor_parallel > 1 and layout is None else None)  # torch.distributed groups, Horovod process sets
    if tensor_groups is not None:
        shard, shards = tensor_groups.dp_rank, tensor_groups.dp

    # ---- set-up 2. data, checked on every rank
    data = check_data(cfg, world, shards, global_batch, grad_accum)

    # ---- set-up 3. the checkpoint to resume from (rank 0 decides, every rank is told)
    resume_from = find_resume_checkpoint(cfg, world)  # Horovod: broadcast from rank 0

    # ---- set-up 4. model, optimizer and their state: rank 0's values win (or each stage's part)
    groups = None
    if layout is not None:
        # Horovod + torch.distributed: process sets and groups, made by every rank
        groups = parallel_dims.open_groups(layout, "nccl" if world.device.type == "cuda" else "gloo")
        if layout.tp > 1:  # split layers within the stages
            tensor_groups = tensor_parallel.TensorGroups(layout, groups)
    expert_groups = None
    if expert_grid is not None:  # Horovod: process sets, made by every rank
        expert_groups = expert_parallel.open_expert_groups(expert_grid, world.rank, groups.process_set if groups else None)
    bounds = pipeline_bounds(cfg, data, world, layout, grad_accum)
    model, optimizer, scaler, aliases, peak_lr, reduce_after = build_model_and_optimizer(
        cfg, data, world.device, grad_accum, shards, layout, groups, shard, bounds, expert_groups, tensor_groups)
    state = TrainingState(model, optimizer, scaler, world, cfg, layout, aliases, expert_groups, tensor_groups)
    state.load_and_share(resume_from)  # Horovod: broadcast from rank 0 (with stages: each reads its part)
    # The step engine, chosen once: plain, or pipelined (torch's schedule over this stage)
    engine = build_engine(cfg, world.device, model, optimizer, scaler, grad_accum, shards, layout, groups, reduce_after,
                          expert_groups=expert_groups, tensor_groups=tensor_groups)
    return Setup(world, data, model, optimizer, scaler, state, grad_accum, global_batch, peak_lr, shard, shards,
                 engine, layout, resume_from)


def train(cfg: Config) -> torch.nn.Module:
    """Run (or resume) the training described by `cfg` on this worker; returns the model."""
    return run_steps(cfg, set_up(cfg))


def run_steps(cfg: Config, s: Setup, commit=None, events: list[dict] = ()) -> torch.nn.Module:
    """From the state's step to the end of the run: the run's opening (loaders, run folder),
    then the step loop.

    `commit`: the elastic job's in-memory commit, called every elastic.commit_every steps and
    after each checkpoint, except at the run's end; it raises when workers were added or lost,
    which ends this call and lets hvdtrain.parallel.elastic re-enter it with the new world. `events`:
    records (e.g. that reset) for rank 0 to log first."""
    t, state, engine = cfg.train, s.state, s.engine
    with opened_run(cfg, s, commit, events) as run:
        timer = run.timer
        if state.step == 0:  # the baseline every later evaluation is compared with
            run.evaluator.run(0)
        while state.step < run.last_step:
            lr = s.peak_lr * lr_multiplier(state.step, t)
            for group in s.optimizer.param_groups:
                group["lr"] = lr

            # 1. data: this rank's micro batches; their target count (and this rank's stop vote)
            #    summed over ranks in the background
            with timer.phase("data"):
                if s.world.rank in t.slow_ranks:
                    time.sleep(t.slow_seconds)  # test aid: a straggling rank
                micro_batches = [next(run.batches) for _ in range(s.grad_accum)]
                # Horovod: allreduce (sum) in the background
                run.totals.start(sum(mb["num_targets"] for mb in micro_batches), run.preemption.requested)
                micro_batches = [{k: v.to(s.world.device, non_blocking=True) if torch.is_tensor(v) else v
                                  for k, v in mb.items()} for mb in micro_batches]

            # 2. forward/backward of every micro batch; Horovod's hooks start the allreduce during the last backward
            loss_sum = engine.forward_backward(micro_batches, timer)

            # 3. wait for the gradient allreduce, normalise by the step's tokens, clip, step
            #    (a step with inf/NaN gradients is skipped: by the fp16 scaler, or else by the guard)
            with timer.phase("allreduce"):
                engine.reduce_gradients()  # Horovod: wait for the gradient allreduce (and the pipeline's)
                global_targets, stop = run.totals.wait()  # Horovod: wait for the targets allreduce
                engine.normalize(global_targets)
            run.guard.check(state.step)  # the streak up to the step before: the device has finished it
            with timer.phase("optimizer"):
                # with pipeline stages, torch.distributed: the norm and the fp16 inf flag along the pipeline
                grad_norm = engine.clip_gradients(t.grad_clip if t.grad_clip > 0 else float("inf"))
                engine.optimizer_step(run.guard, grad_norm)
            state.step += 1
            state.position += s.global_batch
            timer.steps += 1
            run.profiler.step()
            run.step_log.add(loss_sum, global_targets)
            run.watchdog.progress(state.step)

            # 4. log, evaluate, checkpoint, commit when due; all ranks stop together when one was asked to
            after_step(run, state.step, lr, grad_norm, stop)
    engine.close()  # collective: only once every rank has finished the last step

    if s.world.is_main:
        # The Hugging Face folder, from the final checkpoint's parts (every layout's), one output
        # file at a time: no more than the gradients a step held (each step ends by freeing them)
        export_checkpoint(checkpoint.list_checkpoints(cfg.out_dir)[-1], Path(cfg.out_dir) / "tokenizer",
                          Path(cfg.out_dir) / "hf")
        run.log.end_trackers(Path(cfg.out_dir) / "hf")
        s.world.print(run.log.summary(Path(cfg.out_dir) / "hf"))
    return s.model


def after_step(run: "Run", done: int, lr: float, grad_norm: torch.Tensor, stop: bool):
    """What follows step `done`, each part when its owner says it is due (hvdtrain.training.periodic).
    A checkpoint or an elastic commit is a log point too: a run that resumes there finds the
    record of every step before (hvdtrain.observe.run_log keeps those up to its start)."""
    checkpoint_due = run.checkpointer.due(done, stop)
    commit_due = run.commits.due(done, stop, checkpoint_due)
    if run.step_log.due(done) or checkpoint_due or commit_due:
        run.step_log.write(done, lr, grad_norm)
    if run.evaluator.due(done):
        run.evaluator.run(done)
    if checkpoint_due:
        run.checkpointer.save(done)
    if commit_due:
        run.commits.commit()
    if stop:
        run.world.print(f"hvdtrain: preempted (a worker received a stop signal): checkpoint of step {done} "
                        f"written; run the same command again to continue")
        mark_preempted(run.world)
        raise RunStopped(f"preempted at step {done}", PREEMPTED_EXIT_CODE)


@dataclass
class Run:
    """What `opened_run` opened: where the steps' batches come from and what records them."""
    world: distributed.World
    last_step: int
    batches: Iterator[dict]
    timer: StepTimer
    totals: distributed.StepTotals
    guard: NonFiniteGuard
    preemption: PreemptionSignal
    watchdog: StallWatchdog
    profiler: Profiler
    step_log: StepLog
    evaluator: Evaluator
    checkpointer: Checkpointer
    commits: Commits
    log: RunLog | None  # rank 0's; None elsewhere


@contextmanager
def opened_run(cfg: Config, s: Setup, commit, events) -> Iterator[Run]:
    """Set-up steps 5 and 6, again on every entry of an elastic job (they depend on the world),
    and on leaving, also when a step fails, everything they opened closed again."""
    world, state, t = s.world, s.state, cfg.train

    # ---- set-up 5. loaders from the state's stream position
    loader, eval_loader = build_loaders(cfg, s.data, world, s.shard, s.shards, s.grad_accum, s.global_batch, state)

    # ---- set-up 6. the run folder and what records the run
    resolved = {"world_size": world.size, "grad_accum": s.grad_accum, "global_batch": s.global_batch,
                "peak_lr": s.peak_lr, "batch": batch_layout(cfg, s.shards, s.global_batch, s.grad_accum),
                **s.engine.describe()}
    log = open_run_folder(cfg, world, s.data, s.model, state, s.resumed_from, resolved)
    for event in events:
        if log is not None:
            log.event(event)
    timeline = distributed.timeline_path(cfg)
    if timeline is not None:
        distributed.start_timeline(timeline)  # Horovod: every rank starts the (global) timeline
    timer = StepTimer(world.device, cfg.log.step_breakdown)
    throughput = metrics.Throughput(cfg, s.model.config, world, s.global_batch)
    profiler = Profiler(cfg.profile, cfg.out_dir, world, timer, whole_run_timeline=timeline is not None)
    guard = NonFiniteGuard(world.device, t.max_bad_steps)
    preemption = PreemptionSignal()
    last_step = last_step_of_run(t, state.step)
    batches = iter(loader)

    # Python's garbage collector runs at log points only (as torchtitan does): an automatic
    # collection inside a step stalls this rank, and every other rank waits for it in the
    # next allreduce. Long-lived objects made so far are frozen out of future collections.
    gc.collect()
    gc.freeze()
    gc.disable()
    # A stalled worker ends the job instead of leaving the others waiting for ever; in an elastic
    # job it leaves, and the others go on without it.
    watchdog = StallWatchdog(cfg.horovod.stall_timeout_s, world.rank, state.step, elastic=commit is not None)
    try:
        yield Run(world, last_step, batches, timer, distributed.StepTotals(s.engine.stages), guard, preemption,
                  watchdog, profiler,
                  StepLog(cfg, world, log, timer, guard, throughput, s.global_batch, s.grad_accum,
                          s.engine.copies_per_stage, statistics_record(s.model)),
                  Evaluator(cfg, s.engine, eval_loader, log, timer, watchdog, last_step),
                  Checkpointer(cfg, state, guard, timer, watchdog, last_step),
                  Commits(cfg, commit, last_step), log)
    except BaseException:  # a failure, a preemption or an elastic reset (whose next entry resumes them)
        if log is not None:
            log.end_trackers(failed=True)
        raise
    finally:  # also when a step fails: files closed, traces and timeline flushed, the collector back on.
        # Nothing here waits for the other ranks: after a failure on this rank they are inside a
        # step's collective and never come, and this rank must exit for its error to be shown.
        gc.enable()
        watchdog.close()
        preemption.close()
        profiler.close()
        if timeline is not None:
            distributed.stop_timeline()
        distributed.keep_autotune_log(cfg, world)
        if log is not None:
            log.close()
