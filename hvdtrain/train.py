"""The training loop: one worker's view of a data-parallel run.

Every worker runs this same function (under horovodrun, or alone as a world of one).
Read top to bottom it is the whole recipe: init Horovod, build data and model, resume or
start, broadcast from rank 0, then per optimizer step
    fetch grad_accum micro batches -> forward/backward each (allreduce starts in backward)
    -> wait for the allreduce -> normalise by the step's target tokens -> clip -> optimizer step
with logging, evaluation and checkpoints at their intervals.
"""
import gc
import hashlib
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from hvdtrain import checkpoint, distributed
from hvdtrain.config import Config, resolve_batch
from hvdtrain.data import build_data
from hvdtrain.errors import UserError
from hvdtrain.export import save_hf
from hvdtrain.lr_schedule import lr_multiplier
from hvdtrain.models import IGNORE_INDEX, build_model, logits_and_labels, prepare
from hvdtrain.profiling import Profiler
from hvdtrain.run_log import RunLog
from hvdtrain.sampler import EvalSampler, StreamSampler
from hvdtrain.metrics import Throughput, summarize_ranks
from hvdtrain.step_timer import StepTimer

# Keys that must match between a checkpoint and the run resuming it: the data stream and
# the model's shapes. Batch sizes, world size, logging etc. may change on resume.
RESUME_MUST_MATCH = [("model", "arch"), ("model", "n_layer"), ("model", "n_head"), ("model", "d_model"),
                     ("model", "d_ff"), ("data", "source"), ("data", "seq_len"), ("data", "tokenizer"),
                     ("data", "vocab_size"), ("train", "seed")]


def build_optimizer(model, cfg, peak_lr: float, device: torch.device):
    """AdamW (or LAMB) with weight decay on matrices only, not on biases and LayerNorm weights."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.optimizer == "lamb":
        from hvdtrain.lamb import Lamb
        return Lamb(groups, lr=peak_lr, betas=tuple(cfg.betas), eps=cfg.eps)
    return torch.optim.AdamW(groups, lr=peak_lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=device.type == "cuda")


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict):
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def resume_problem(saved: dict, cfg: Config, path: Path) -> str | None:
    """Why the checkpoint at `path` cannot continue this config, or None."""
    current = cfg.to_dict()
    for section, key in RESUME_MUST_MATCH:
        if saved[section][key] != current[section][key]:
            return (f"config key '{section}.{key}' is {current[section][key]!r} but the checkpoint {path} was "
                    f"written with {saved[section][key]!r}; use another out_dir to start afresh")
    return None


@torch.no_grad()
def evaluate(model, loader, device, autocast) -> dict:
    """Loss (and masked-token accuracy for BERT) on each rank's fixed validation slice,
    summed over all ranks before dividing, so it is the loss of the whole evaluated set."""
    model.eval()
    loss = correct = targets = 0.0
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items() if torch.is_tensor(v)}
        with autocast:
            logits, labels = logits_and_labels(model, batch)
        picked = labels != IGNORE_INDEX
        loss += torch.nn.functional.cross_entropy(logits[picked].float(), labels[picked], reduction="sum").item()
        correct += (logits[picked].argmax(-1) == labels[picked]).sum().item()
        targets += picked.sum().item()
    model.train()
    loss, correct, targets = distributed.allreduce_sum([loss, correct, targets], name="eval")
    mean = loss / max(targets, 1)
    return {"eval_loss": mean, "eval_ppl": math.exp(mean) if mean < 50 else float("inf"),
            "eval_accuracy": correct / max(targets, 1)}


def train(cfg: Config) -> torch.nn.Module:
    """Run (or resume) the training described by `cfg` on this worker; returns the model."""
    # ---- Horovod: init, pin the GPU, seed
    world = distributed.init(cfg)
    device = world.device
    grad_accum, global_batch = resolve_batch(cfg, world.size)
    t = cfg.train

    # ---- data: tokenized and cached once per host, then loaded by every rank
    with distributed.leader_first(world, "data"):
        data = build_data(cfg, t.seed)
    # Hosts without a shared cache prepare their data separately: make sure they agree.
    data_id = hashlib.sha256(repr((len(data.train), len(data.val), data.vocab.size, data.tokenizer and
                                   data.tokenizer.backend_tokenizer.to_str())).encode()).hexdigest()
    if len(set(distributed.allgather_object(data_id, name="data_id"))) > 1:
        raise UserError("workers on different hosts built different data or tokenizers; point data.cache_dir "
                        "at a shared folder or give data.tokenizer a pretrained tokenizer")
    if global_batch > len(data.train):
        raise UserError(f"the global batch ({global_batch} = train.micro_batch_size {t.micro_batch_size} x "
                        f"grad_accum {grad_accum} x {world.size} workers) is larger than the training set "
                        f"({len(data.train)} blocks of data.seq_len={cfg.data.seq_len} tokens)")

    # ---- resume: rank 0 decides and reads the checkpoint; the others receive it by broadcast
    ckpt_path, state, problem = None, None, None
    if world.is_main:
        checkpoint.remove_partial_writes(cfg.out_dir)
        ckpt_path = checkpoint.latest_checkpoint(cfg.out_dir) if cfg.checkpoint.resume else None
        if ckpt_path is not None:
            state = checkpoint.load_state(ckpt_path)
            problem = resume_problem(state["config"], cfg, ckpt_path)
    ckpt_path, problem = distributed.broadcast_object((ckpt_path, problem), name="ckpt_path")
    if problem:
        raise UserError(problem)

    # ---- model and optimizer; the same seed on every rank, and rank 0's values win anyway
    torch.manual_seed(t.seed)
    model = build_model(cfg.model, data.vocab, cfg.data.seq_len)
    if ckpt_path is not None and world.is_main:
        checkpoint.load_weights(model, ckpt_path)
    model.to(device)
    model.train()
    peak_lr = t.lr * distributed.lr_scale(t.lr_scaling, world.size)
    optimizer = distributed.wrap_optimizer(build_optimizer(model, t, peak_lr, device), model, cfg.horovod, grad_accum)
    scaler = torch.amp.GradScaler(device.type, enabled=t.precision == "fp16")
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
    distributed.broadcast_state(model, optimizer, resumed=ckpt_path is not None)
    prepare(model, cfg.model)

    progress = distributed.broadcast_object(
        {k: state[k] for k in ("step", "position", "world_size", "rng")} if state else None, name="progress")
    start_step = progress["step"] if progress else 0
    position = progress["position"] if progress else 0
    if progress and progress["world_size"] == world.size:
        set_rng_state(progress["rng"][world.rank])
    else:  # a new run, or a resume with another world size: derived, still reproducible
        distributed.reseed_for_training(t.seed, world.rank, start_step)
    if position % global_batch:
        raise UserError(f"the checkpoint {ckpt_path} stopped after {position} samples, which is not a multiple "
                        f"of the global batch {global_batch}; resume with the global batch it was written with")

    # The sampler counts steps of this global batch from the stream's start; a resume with another
    # global batch starts at a different step number there than in training.
    sampler = StreamSampler(len(data.train), t.micro_batch_size, grad_accum, world.rank, world.size, t.seed,
                            start_position=position, max_steps=position // global_batch + t.max_steps - start_step)
    loader = torch.utils.data.DataLoader(
        data.train, batch_sampler=sampler, collate_fn=data.collate, num_workers=cfg.data.num_workers,
        pin_memory=device.type == "cuda", prefetch_factor=4 if cfg.data.num_workers else None,
        persistent_workers=False)
    eval_loader = torch.utils.data.DataLoader(
        data.val, batch_sampler=EvalSampler(len(data.val), t.micro_batch_size, cfg.eval.batches, world.rank, world.size),
        collate_fn=data.collate)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16 if t.precision == "bf16" else torch.float16,
                              enabled=t.precision != "fp32")

    # ---- the run folder: written only now that every input has been checked
    log = None
    if world.is_main:
        Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
        resolved = dict(cfg.to_dict(), resolved={"world_size": world.size, "grad_accum": grad_accum,
                                                 "global_batch": global_batch, "peak_lr": peak_lr})
        (Path(cfg.out_dir) / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
        if data.tokenizer is not None:
            data.tokenizer.save_pretrained(Path(cfg.out_dir) / "tokenizer")
        n_params = sum(p.numel() for p in model.parameters())
        world.print(f"hvdtrain: {cfg.model.arch} {n_params / 1e6:.2f}M parameters | {world.size} workers x "
                    f"micro batch {t.micro_batch_size} x accum {grad_accum} = global batch {global_batch} "
                    f"x {cfg.data.seq_len} tokens | peak lr {peak_lr:.3g}"
                    + (f" | resuming at step {start_step} from {ckpt_path}" if ckpt_path else ""))
        log = RunLog(cfg.out_dir, start_step, t.max_steps, cfg.log.progress, cfg.log.tensorboard)

    timer = StepTimer(device, cfg.log.step_breakdown)
    throughput = Throughput(cfg, model.config.vocab_size, world, global_batch)
    profiler = Profiler(cfg.profile, cfg.out_dir, world, timer)
    normalizer = distributed.TokenNormalizer(cfg.horovod.op, world.size,
                                             t.micro_batch_size * grad_accum * cfg.data.seq_len)
    batches = iter(loader)
    step_losses, step_targets = [], []  # this log interval: local loss sums and global target counts

    def save(step):
        """Every rank contributes its RNG state; rank 0 writes."""
        rngs = distributed.allgather_object(rng_state(), name="rng")
        if world.is_main:
            checkpoint.save_checkpoint(cfg.out_dir, step, model, {
                "step": step, "position": position + (step - start_step) * global_batch,
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(), "rng": rngs, "config": cfg.to_dict(), "world_size": world.size,
            }, keep=cfg.checkpoint.keep)

    # Python's garbage collector runs at log points only (as torchtitan does): an automatic
    # collection inside a step stalls this rank, and every other rank waits for it in the
    # next allreduce. Long-lived objects made so far are frozen out of future collections.
    gc.collect()
    gc.freeze()
    gc.disable()

    if start_step == 0:  # the baseline every later evaluation is compared with
        result = evaluate(model, eval_loader, device, autocast)
        if log is not None:
            log.eval_record({"step": 0, **result})
        timer.reset()

    last_step = t.stop_at_step or t.max_steps
    for step in range(start_step, last_step):
        lr = peak_lr * lr_multiplier(step, t)
        for group in optimizer.param_groups:
            group["lr"] = lr

        # 1. data: this rank's micro batches; their target count is summed over ranks in the background
        with timer.phase("data"):
            if world.rank in t.slow_ranks:
                time.sleep(t.slow_seconds)  # test aid: a straggling rank
            micro_batches = [next(batches) for _ in range(grad_accum)]
            normalizer.start(sum(mb["num_targets"] for mb in micro_batches))
            micro_batches = [{k: v.to(device, non_blocking=True) for k, v in mb.items() if torch.is_tensor(v)}
                             for mb in micro_batches]

        # 2. forward/backward per micro batch; Horovod's hooks start the allreduce during the last backward
        loss_sum = torch.zeros((), device=device)
        for mb in micro_batches:
            with timer.phase("forward"), autocast:
                logits, labels = logits_and_labels(model, mb)
                loss = torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX,
                                                         reduction="sum")
            with timer.phase("backward"):
                scaler.scale(loss * normalizer.loss_scale).backward()
            loss_sum += loss.detach()

        # 3. wait for the gradient allreduce, normalise by the step's tokens, clip, step
        with timer.phase("allreduce"):
            optimizer.synchronize()
            global_targets = normalizer.finish(model)
        with timer.phase("optimizer"):
            scaler.unscale_(optimizer)
            if t.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            with optimizer.skip_synchronize():
                scaler.step(optimizer)
            scaler.update()
            distributed.zero_grad(optimizer)
        timer.steps += 1
        profiler.step()
        step_losses.append(loss_sum)
        step_targets.append(global_targets)
        done = step + 1

        # 4. log, evaluate, checkpoint
        if done % cfg.log.every == 0 or done == last_step:
            means, step_time = timer.interval()  # the steps only: logging below is not step time
            local = torch.stack(step_losses).double().cpu().tolist()
            per_step = [s / n for s, n in zip(distributed.allreduce_sum(local, name="loss"), step_targets)]
            per_rank = distributed.allgather_floats(means + [step_time], name="timings")
            if log is not None:
                record = {"step": done, "loss": sum(per_step) / len(per_step), "step_losses": per_step, "lr": lr,
                          "world_size": world.size, "global_batch": global_batch, "grad_accum": grad_accum}
                record.update(throughput.record(step_time))
                if cfg.log.step_breakdown:
                    record.update(summarize_ranks(per_rank, cfg.log.imbalance_threshold))
                log.train_record(record)
            step_losses, step_targets = [], []
            gc.collect(1)  # young garbage only, here rather than at a random point inside a step
            timer.reset()
        if (cfg.eval.every and done % cfg.eval.every == 0) or done == last_step:
            result = evaluate(model, eval_loader, device, autocast)
            if log is not None:
                log.eval_record({"step": done, **result})
            timer.reset()  # evaluation time is not training step time
        if (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or done == last_step:
            save(done)
            timer.reset()

    gc.enable()
    profiler.close()
    if log is not None:
        log.close()
        save_hf(model, Path(cfg.out_dir) / "tokenizer", Path(cfg.out_dir) / "hf")
        world.print(f"hvdtrain: model saved as a Hugging Face folder in {Path(cfg.out_dir) / 'hf'}")
    return model
