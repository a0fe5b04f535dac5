"""The training loop: one worker's view of a data-parallel run.

Every worker runs this same function (under horovodrun, or alone as a world of one).
Read top to bottom it is the whole recipe: init Horovod, check the data, find the checkpoint
to resume from, build the model and optimizer and take their state from rank 0, then per
optimizer step
    fetch grad_accum micro batches -> forward/backward each (allreduce starts in backward)
    -> wait for the allreduce -> normalise by the step's target tokens -> clip -> optimizer step
with logging, evaluation and checkpoints at their intervals.

With parallel.pipeline_stages = p > 1 each worker holds one stage of the model
(hvdtrain.pipeline): the micro batches go through torch's pipeline schedule instead of a plain
forward/backward, Horovod reduces gradients among the copies of the stage only, the tied
embedding is summed between first and last stage and the gradient norm is taken over all
stages. Everything else is the same code.

With parallel.shard_optimizer each copy keeps 1/copies of the optimizer state
(hvdtrain.sharded_optimizer): the gradients are reduce-scattered instead of allreduced, the
step updates this copy's slices and the weights are allgathered after it.
"""
import contextlib
import gc
import hashlib
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from hvdtrain import checkpoint, distributed, metrics, pipeline
from hvdtrain.config import Config, last_step_of_run, resolve_batch
from hvdtrain.data import DataBundle, build_data
from hvdtrain.errors import UserError
from hvdtrain.export import load_checkpoint_model, save_hf
from hvdtrain.lr_schedule import lr_multiplier
from hvdtrain.models import IGNORE_INDEX, build_model, logits_and_labels, prepare, token_loss_sum
from hvdtrain.optimizers import build_optimizer
from hvdtrain.paths import check_writable_folder
from hvdtrain.profiling import Profiler
from hvdtrain.run_control import (PREEMPTED_EXIT_CODE, NonFiniteGuard, PreemptionSignal, RunStopped,
                                  StallWatchdog, mark_preempted)
from hvdtrain.run_log import RunLog
from hvdtrain.sampler import EvalSampler, StreamSampler, share
from hvdtrain.sharded_optimizer import ShardedOptimizer
from hvdtrain.step_timer import StepTimer
from hvdtrain.training_state import TrainingState, find_resume_checkpoint


@torch.no_grad()
def evaluate(model, loader, device, autocast, pipe=None) -> dict:
    """Loss (and masked-token accuracy for BERT) on each rank's fixed validation slice,
    summed over all ranks before dividing, so it is the loss of the whole evaluated set.
    Through a pipeline (`pipe`) the last stage computes the loss (no accuracy there)."""
    model.eval()
    loss = correct = targets = 0.0
    if pipe is None:
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items() if torch.is_tensor(v)}
            with autocast:
                logits, labels = logits_and_labels(model, batch)
            picked = labels != IGNORE_INDEX
            loss += torch.nn.functional.cross_entropy(logits[picked].float(), labels[picked], reduction="sum").item()
            correct += (logits[picked].argmax(-1) == labels[picked]).sum().item()
            targets += picked.sum().item()
    else:
        batches = [{k: v.to(device) for k, v in b.items() if torch.is_tensor(v)} for b in loader]
        for i in range(0, len(batches), pipe.n_microbatches):
            group = batches[i:i + pipe.n_microbatches]
            # The schedule runs a fixed number of micro batches: fill the last group with ones
            # that predict nothing.
            group += [{"input_ids": group[0]["input_ids"], "labels": torch.full_like(group[0]["labels"], IGNORE_INDEX)}
                      ] * (pipe.n_microbatches - len(group))
            labels = torch.cat([b["labels"] for b in group])
            with autocast:
                loss += pipeline.run(pipe, torch.cat([b["input_ids"] for b in group]), labels, train=False).item()
            if pipe.layout.is_last:
                targets += (labels != IGNORE_INDEX).sum().item()
    model.train()
    loss, correct, targets = distributed.allreduce_sum([loss, correct, targets], name="eval")
    mean = loss / max(targets, 1)
    result = {"eval_loss": mean, "eval_ppl": math.exp(mean) if mean < 50 else float("inf")}
    if pipe is None:
        result["eval_accuracy"] = correct / max(targets, 1)
    return result


def check_data(cfg: Config, world, shards: int, global_batch: int, grad_accum: int) -> DataBundle:
    """Tokenized and cached once per host, then loaded by every rank; checked on all of them.
    `shards`: the workers that read different samples (the data-parallel copies)."""
    with distributed.leader_first(world, "data"):
        data = build_data(cfg, cfg.train.seed)
    # Hosts without a shared cache prepare their data separately: make sure they agree.
    data_id = hashlib.sha256(repr((len(data.train), len(data.val), data.vocab.size, data.tokenizer and
                                   data.tokenizer.backend_tokenizer.to_str())).encode()).hexdigest()
    if len(set(distributed.allgather_object(data_id, name="data_id"))) > 1:
        raise UserError("workers on different hosts built different data or tokenizers; point data.cache_dir "
                        "at a shared folder or give data.tokenizer a pretrained tokenizer")
    if global_batch > len(data.train):
        raise UserError(f"the global batch ({global_batch} samples: {batch_layout(cfg, shards, global_batch, grad_accum)}"
                        f") is larger than the training set ({len(data.train)} blocks of data.seq_len="
                        f"{cfg.data.seq_len} tokens)")
    return data


def batch_layout(cfg: Config, shards: int, global_batch: int, grad_accum: int) -> str:
    """How the workers share the global batch, in words: micro batch x accumulation x workers,
    or their uneven shares (see hvdtrain.sampler)."""
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
    (out / "config.yaml").write_text(yaml.safe_dump(dict(cfg.to_dict(), resolved=resolved), sort_keys=False))
    if data.tokenizer is not None:
        data.tokenizer.save_pretrained(out / "tokenizer")
    n_params = sum(p.numel() for p in model.parameters())
    stages = cfg.parallel.pipeline_stages
    world.print(f"hvdtrain: {cfg.model.arch} {n_params / 1e6:.2f}M parameters"
                + (f" on stage 0 of {stages} ({resolved['pipeline']})" if stages > 1 else "")
                + f" | {resolved['batch']} = global batch {resolved['global_batch']} x {cfg.data.seq_len} tokens"
                f" | peak lr {resolved['peak_lr']:.3g}"
                + (f" | resuming at step {state.step} from {resumed_from}" if resumed_from else ""))
    return RunLog(cfg.out_dir, state.step, cfg.train.max_steps, cfg.log.progress, cfg.log.tensorboard)


@dataclass
class Setup:
    """What the step loop works with: made once by `set_up`, or again after every reset of an
    elastic job (hvdtrain.elastic), where the world can change size."""
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
    layout: pipeline.Layout | None = None
    groups: pipeline.Groups | None = None
    pipe: pipeline.Pipeline | None = None
    reduce_after: bool = False      # pipeline copies reduce gradients after the schedule's run
    resumed_from: Path | None = None


def build_model_and_optimizer(cfg: Config, data: DataBundle, device, grad_accum: int, shards: int,
                              layout=None, groups=None, shard: int = 0):
    """The model (or this worker's stage of it), its optimizer (Horovod's, unless the pipeline
    reduces after its run; sharded over the `shards` copies with parallel.shard_optimizer, this
    being copy `shard`) and grad scaler; the same seed on every rank. Returns them with the
    whole model's tied parameter names and whether gradients are reduced after the pipeline."""
    t, par = cfg.train, cfg.parallel
    torch.manual_seed(t.seed)
    model = build_model(cfg.model, data.vocab, cfg.data.seq_len)
    prepare(model, cfg.model)  # activation checkpointing, compiled blocks
    aliases = checkpoint.tie_aliases(model)  # of the whole model, before a split
    if layout is not None:  # keep this worker's stage only, under the whole model's names
        bounds = pipeline.stage_bounds(model.config.num_hidden_layers, layout.stages, layout.stages_per_rank,
                                       par.layer_boundaries)
        model = pipeline.split_model(model, layout, bounds)
    model.to(device)
    model.train()
    peak_lr = t.lr * distributed.lr_scale(t.lr_scaling, shards)
    # The copies of a stage reduce gradients during backward (Horovod's hooks), or after the
    # pipeline's step where NCCL would otherwise run two communicators at once.
    reduce_after = layout is not None and (par.reduce_gradients or
                                           ("after" if device.type == "cuda" else "during")) == "after"
    if par.shard_optimizer:
        tied_copy = layout is not None and layout.is_last and not layout.is_first  # not counted in the norm twice
        optimizer = ShardedOptimizer(model, t, peak_lr, device, cfg.horovod, grad_accum, shard, shards,
                                     groups.process_set if groups else None, reduce_during=not reduce_after,
                                     compute_dtype=torch.bfloat16 if t.precision == "bf16" else torch.float32,
                                     not_counted=pipeline.tied_parameters(model).values() if tied_copy else ())
    else:
        optimizer = build_optimizer(model, t, peak_lr, device)
        if not reduce_after:
            optimizer = distributed.wrap_optimizer(optimizer, model, cfg.horovod, grad_accum,
                                                   groups.process_set if groups else None)
    scaler = torch.amp.GradScaler(device.type, enabled=t.precision == "fp16")
    return model, optimizer, scaler, aliases, peak_lr, reduce_after


def set_up(cfg: Config) -> Setup:
    """Every step before the first training step, in order; collective."""
    # ---- set-up 1. Horovod: init, pin the GPU, seed
    check_writable_folder(cfg.out_dir, "out_dir")
    world = distributed.init(cfg)
    par = cfg.parallel
    grad_accum, global_batch = resolve_batch(cfg, world.size)
    # Pipeline stages: this worker's place in the stages x copies grid; the copies shard the data.
    layout = (pipeline.layout_for(world.rank, world.size, par.pipeline_stages, par.stages_per_rank)
              if par.pipeline_stages > 1 else None)
    shard, shards = (layout.dp_rank, layout.dp) if layout else (world.rank, world.size)

    # ---- set-up 2. data, checked on every rank
    data = check_data(cfg, world, shards, global_batch, grad_accum)

    # ---- set-up 3. the checkpoint to resume from (rank 0 decides, every rank is told)
    resume_from = find_resume_checkpoint(cfg, world)

    # ---- set-up 4. model, optimizer and their state: rank 0's values win (or each stage's part)
    groups = pipe = None
    if layout is not None:
        groups = pipeline.open_groups(layout, "nccl" if world.device.type == "cuda" else "gloo")
    model, optimizer, scaler, aliases, peak_lr, reduce_after = build_model_and_optimizer(
        cfg, data, world.device, grad_accum, shards, layout, groups, shard)
    state = TrainingState(model, optimizer, scaler, world, cfg, layout, aliases)
    state.restore(resume_from)
    if layout is not None:
        pipe = pipeline.build_schedule(model, layout, groups, par.schedule, par.microbatches or grad_accum,
                                       1.0, world.device)
    return Setup(world, data, model, optimizer, scaler, state, grad_accum, global_batch, peak_lr, shard, shards,
                 layout, groups, pipe, reduce_after, resume_from)


def train(cfg: Config) -> torch.nn.Module:
    """Run (or resume) the training described by `cfg` on this worker; returns the model."""
    return run_steps(cfg, set_up(cfg))


def run_steps(cfg: Config, s: Setup, commit=None, events: list[dict] = ()) -> torch.nn.Module:
    """From the state's step to the end of the run: loaders, run folder, then the step loop.

    `commit`: the elastic job's in-memory commit, called every elastic.commit_every steps and
    after each checkpoint, except at the run's end; it raises when workers were added or lost,
    which ends this call and lets hvdtrain.elastic re-enter it with the new world. `events`:
    records (e.g. that reset) for rank 0 to log first."""
    world, data, model, optimizer, scaler, state = s.world, s.data, s.model, s.optimizer, s.scaler, s.state
    layout, groups, pipe, reduce_after = s.layout, s.groups, s.pipe, s.reduce_after
    grad_accum, global_batch, peak_lr, shard, shards = s.grad_accum, s.global_batch, s.peak_lr, s.shard, s.shards
    device, t, par = world.device, cfg.train, cfg.parallel
    resume_from = s.resumed_from
    sharded = isinstance(optimizer, ShardedOptimizer)

    # ---- set-up 5. loaders from the state's stream position
    loader, eval_loader = build_loaders(cfg, data, world, shard, shards, grad_accum, global_batch, state)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16 if t.precision == "bf16" else torch.float16,
                              enabled=t.precision != "fp32")

    # ---- set-up 6. the run folder and what records the run
    resolved = {"world_size": world.size, "grad_accum": grad_accum, "global_batch": global_batch, "peak_lr": peak_lr,
                "batch": batch_layout(cfg, shards, global_batch, grad_accum)}
    if pipe is not None:
        m = pipe.n_microbatches
        bubble = pipeline.ideal_bubble(layout.stages, m, layout.stages_per_rank)
        resolved["pipeline"] = (f"{par.schedule}, {m} micro batches per run, ideal bubble {bubble:.0%}, gradients "
                                f"reduced {'after' if reduce_after else 'during'} the pipeline's backward")
    log = open_run_folder(cfg, world, data, model, state, resume_from, resolved)
    for event in events:
        if log is not None:
            log.event(event)
    timeline = distributed.timeline_path(cfg)
    if timeline is not None:
        distributed.start_timeline(timeline)
    timer = StepTimer(device, cfg.log.step_breakdown)
    throughput = metrics.Throughput(cfg, model.config, world, global_batch)
    profiler = Profiler(cfg.profile, cfg.out_dir, world, timer, whole_run_timeline=timeline is not None)
    normalizer = distributed.TokenNormalizer(cfg.horovod.op, shards, t.micro_batch_size * grad_accum * cfg.data.seq_len,
                                             stages=layout.stages if layout else 1)
    guard = NonFiniteGuard(device, t.max_bad_steps)
    preemption = PreemptionSignal()
    batches = iter(loader)
    step_losses, step_targets = [], []  # this log interval: local loss sums and global target counts

    # Python's garbage collector runs at log points only (as torchtitan does): an automatic
    # collection inside a step stalls this rank, and every other rank waits for it in the
    # next allreduce. Long-lived objects made so far are frozen out of future collections.
    gc.collect()
    gc.freeze()
    gc.disable()
    # A stalled worker ends the job instead of leaving the others waiting for ever. In an elastic
    # job Horovod's driver deals with lost workers (Gloo's timeout starts a reset).
    watchdog = StallWatchdog(cfg.horovod.stall_timeout_s if commit is None else 0, world.rank, state.step)
    try:
        if state.step == 0:  # the baseline every later evaluation is compared with
            result = evaluate(model, eval_loader, device, autocast, pipe)
            if log is not None:
                log.eval_record({"step": 0, **result})
            timer.reset()
            watchdog.progress(0)

        last_step = last_step_of_run(t, state.step)
        while state.step < last_step:
            lr = peak_lr * lr_multiplier(state.step, t)
            for group in optimizer.param_groups:
                group["lr"] = lr

            # 1. data: this rank's micro batches; their target count is summed over ranks in the background
            with timer.phase("data"):
                if world.rank in t.slow_ranks:
                    time.sleep(t.slow_seconds)  # test aid: a straggling rank
                micro_batches = [next(batches) for _ in range(grad_accum)]
                normalizer.start(sum(mb["num_targets"] for mb in micro_batches), preemption.requested)
                micro_batches = [{k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in mb.items()}
                                 for mb in micro_batches]

            # 2. forward/backward per micro batch; Horovod's hooks start the allreduce during the last backward
            loss_sum = torch.zeros((), device=device)
            if pipe is None:
                for mb in micro_batches:
                    with timer.phase("forward"), autocast:
                        loss = token_loss_sum(model, mb)  # chunked: never the whole batch's logits
                    with timer.phase("backward"):
                        scaler.scale(loss * normalizer.loss_scale).backward()
                    loss_sum += loss.detach()
            else:  # the schedule's runs of m micro batches: forward and backward of every stage interleaved
                pipe.loss.scale = normalizer.loss_scale * (scaler.get_scale() if scaler.is_enabled() else 1.0)
                m = pipe.n_microbatches
                for i in range(0, grad_accum, m):
                    run = micro_batches[i:i + m]
                    with timer.phase("pipeline"), autocast:
                        loss_sum += pipeline.run(pipe, torch.cat([mb["input_ids"] for mb in run]),
                                                 torch.cat([mb["labels"] for mb in run]))

            # 3. wait for the gradient allreduce, normalise by the step's tokens, clip, step
            #    (a step with inf/NaN gradients is skipped: by the fp16 scaler, or else by the guard)
            #    (with pipeline stages: the tied embedding summed between the ends, one norm over all stages)
            with timer.phase("allreduce"):
                if sharded:  # reduce-scatter: this copy's slices of the reduced gradients
                    optimizer.reduce_gradients()
                elif reduce_after:
                    pipeline.allreduce_grads_after(model.parameters(), groups, distributed.reduce_op(cfg.horovod),
                                                   distributed.compression(cfg.horovod),
                                                   cfg.horovod.gradient_predivide_factor)
                else:
                    optimizer.synchronize()
                if layout is not None and sharded:
                    optimizer.allreduce_tied(groups)
                elif layout is not None:
                    pipeline.allreduce_tied_grads(model, groups)
                global_targets, stop = normalizer.finish(
                    optimizer.grads() if sharded else [p.grad for p in model.parameters() if p.grad is not None])
            guard.check(state.step)  # the streak up to the step before: the device has finished it
            with timer.phase("optimizer"):
                max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
                if sharded:  # the same clip, skip agreement and step on the slices; then the allgather
                    grad_norm = optimizer.finish_step(scaler, guard, max_norm, groups)
                else:
                    scaler.unscale_(optimizer)
                    grad_norm = (torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) if layout is None
                                 else pipeline.clip_grad_norm_(model, max_norm, groups))
                    with optimizer.skip_synchronize() if not reduce_after else contextlib.nullcontext():
                        if not scaler.is_enabled():
                            guard.step(optimizer, grad_norm)
                        else:
                            if layout is not None:  # a stage that found no inf skips too, as the whole model would
                                pipeline.share_found_inf(scaler, optimizer, groups)
                            guard.scaler_step(scaler, optimizer)
                    distributed.zero_grad(optimizer)
            state.step += 1
            state.position += global_batch
            timer.steps += 1
            profiler.step()
            step_losses.append(loss_sum)
            step_targets.append(global_targets)
            done = state.step
            watchdog.progress(done)

            # 4. log, evaluate, checkpoint, commit; all ranks stop together when one was asked to.
            #    A checkpoint or an elastic commit is a log point too: a run that resumes there
            #    finds the record of every step before (hvdtrain.run_log keeps those up to its start).
            checkpoint_due = (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or done == last_step or stop
            # Elastic jobs only: the in-memory commit, after the checkpoint, as it raises when the
            # hosts changed; none at the step this run ends at (its last, a pause, a preemption),
            # which has no steps left for new workers.
            commit_due = (commit is not None and done < last_step and not stop
                          and (done % cfg.elastic.commit_every == 0 or checkpoint_due))
            if done % cfg.log.every == 0 or checkpoint_due or commit_due:
                means, step_time = timer.interval()  # the steps only: logging below is not step time
                local = torch.stack(step_losses).double().cpu().tolist()
                per_step = [s / n for s, n in zip(distributed.allreduce_sum(local, name="loss"), step_targets)]
                per_rank = distributed.allgather_floats(means + [step_time], name="timings")
                skipped = guard.interval()
                if log is not None:
                    breakdown = (metrics.summarize_ranks(per_rank, cfg.log.imbalance_threshold,
                                                           layout.dp if layout else None)
                                 if cfg.log.step_breakdown else None)
                    measured = {**throughput.record(step_time), **skipped, "grad_norm": float(grad_norm)}
                    log.train_record(metrics.train_record(done, per_step, lr, world.size, global_batch, grad_accum,
                                                          measured, breakdown))
                step_losses, step_targets = [], []
                gc.collect(1)  # young garbage only, here rather than at a random point inside a step
                timer.reset()
            if (cfg.eval.every and done % cfg.eval.every == 0) or done == last_step:
                result = evaluate(model, eval_loader, device, autocast, pipe)
                if log is not None:
                    log.eval_record({"step": done, **result})
                timer.reset()  # evaluation time is not training step time
                watchdog.progress(done)
            if checkpoint_due:
                guard.check(done)  # a streak of bad steps that stops the run here gets no checkpoint
                state.save()
                timer.reset()
                watchdog.progress(done)
            if commit_due:
                commit()
            if stop:
                world.print(f"hvdtrain: preempted (a worker received a stop signal): checkpoint of step {done} "
                            f"written; run the same command again to continue")
                mark_preempted(world)
                raise RunStopped(f"preempted at step {done}", PREEMPTED_EXIT_CODE)
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
    if groups is not None:  # collective: only once every rank has finished the last step
        groups.close()

    if world.is_main:  # the whole model: with pipeline stages or shards, rebuilt from the final checkpoint's parts
        whole = (model if layout is None and not sharded
                 else load_checkpoint_model(checkpoint.list_checkpoints(cfg.out_dir)[-1]))
        save_hf(whole, Path(cfg.out_dir) / "tokenizer", Path(cfg.out_dir) / "hf")
        world.print(f"hvdtrain: model saved as a Hugging Face folder in {Path(cfg.out_dir) / 'hf'}")
    return model
