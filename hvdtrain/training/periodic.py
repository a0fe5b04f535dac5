"""What follows a training step at its interval: the train record, evaluation, the checkpoint
and (elastic jobs) the in-memory commit. Each owner says when it is due (`due(step)`) and
does its work (every rank decides alike: the work is collective). hvdtrain.training.train.after_step
calls them in this order.

Each action's time is not step time: the step timer restarts after it (timer.reset()), and
the stall watchdog hears of the progress.
"""
import gc

import torch

from hvdtrain.parallel import distributed
from hvdtrain.observe import metrics


class StepLog:
    """The train records (metrics.jsonl): each step's loss sum and target count are kept (on the
    device) until a log point, where they are summed over ranks and rank 0 writes a record per
    step. `log`: the RunLog on rank 0, None elsewhere. With `statistics_record`
    (models.common.statistics_record: a family with an auxiliary loss), a step's sums are a
    vector, the loss sum followed by the auxiliary loss's statistics, which the record
    gets summed over the interval."""

    def __init__(self, cfg, world, log, timer, guard, throughput, global_batch: int, grad_accum: int,
                 copies_per_stage: int | None, statistics_record=None):
        self.cfg, self.world, self.log, self.timer = cfg, world, log, timer
        self.guard, self.throughput, self.statistics_record = guard, throughput, statistics_record
        self.global_batch, self.grad_accum, self.copies_per_stage = global_batch, grad_accum, copies_per_stage
        self.losses, self.targets = [], []  # this log interval: local loss sums and global target counts

    def add(self, loss_sum: torch.Tensor, global_targets: float):
        self.losses.append(loss_sum)
        self.targets.append(global_targets)

    def due(self, step: int) -> bool:
        return step % self.cfg.log.every == 0

    def write(self, step: int, lr: float, grad_norm: torch.Tensor):
        means, step_time = self.timer.interval()  # the steps only: logging below is not step time
        local = torch.stack(self.losses).double().reshape(len(self.losses), -1)
        # Horovod: allreduce (sum) of the interval's loss sums (and statistics)
        sums = torch.tensor(distributed.allreduce_sum(local.flatten().cpu().tolist(), name="loss"),
                            dtype=torch.float64).reshape(local.shape)
        per_step = [s / n for s, n in zip(sums[:, 0].tolist(), self.targets)]
        per_rank = distributed.allgather_floats(means + [step_time], name="timings")  # Horovod: allgather
        skipped = self.guard.interval()
        if self.log is not None:
            cfg = self.cfg
            breakdown = (metrics.summarize_ranks(per_rank, cfg.log.imbalance_threshold, self.copies_per_stage)
                         if cfg.log.step_breakdown else None)
            measured = {**self.throughput.record(step_time), **skipped, "grad_norm": float(grad_norm)}
            if self.statistics_record is not None:
                measured.update(self.statistics_record(sums[:, 1:].sum(dim=0).tolist(), sum(self.targets)))
            self.log.train_record(metrics.train_record(step, per_step, lr, self.world.size, self.global_batch,
                                                       self.grad_accum, measured, breakdown))
        self.losses, self.targets = [], []
        gc.collect(1)  # young garbage only, here rather than at a random point inside a step
        self.timer.reset()


class Evaluator:
    """The evaluation loss (hvdtrain.training.step_engine: `evaluate`) every eval.every steps and at the run's end."""

    def __init__(self, cfg, engine, loader, log, timer, watchdog, last_step: int):
        self.every, self.engine, self.loader, self.log = cfg.eval.every, engine, loader, log
        self.timer, self.watchdog, self.last_step = timer, watchdog, last_step

    def due(self, step: int) -> bool:
        return bool(self.every and step % self.every == 0) or step == self.last_step

    def run(self, step: int):
        result = self.engine.evaluate(self.loader)  # Horovod: allreduce of the sums (pipeline: send/recv too)
        if self.log is not None:
            self.log.eval_record({"step": step, **result})
        self.timer.reset()  # evaluation time is not training step time
        self.watchdog.progress(step)


class Checkpointer:
    """A checkpoint (TrainingState.save) every checkpoint.every steps, at the run's end and
    when the run stops early on purpose (preemption)."""

    def __init__(self, cfg, state, guard, timer, watchdog, last_step: int):
        self.every, self.state, self.guard = cfg.checkpoint.every, state, guard
        self.timer, self.watchdog, self.last_step = timer, watchdog, last_step

    def due(self, step: int, stop: bool) -> bool:
        return bool(self.every and step % self.every == 0) or step == self.last_step or stop

    def save(self, step: int):
        self.guard.check(step)  # a streak of bad steps that stops the run here gets no checkpoint
        self.state.save()  # Horovod: allgather, broadcast, barrier (TrainingState.save)
        self.timer.reset()
        self.watchdog.progress(step)


class Commits:
    """Elastic jobs only (`commit` given, hvdtrain.parallel.elastic): the in-memory commit every
    elastic.commit_every steps and after each checkpoint. It comes after the checkpoint, as it
    raises when the hosts changed; there is none at the step this run ends at (its last, a
    pause, a preemption), which has no steps left for new workers."""

    def __init__(self, cfg, commit, last_step: int):
        self.every, self.commit, self.last_step = cfg.elastic.commit_every, commit, last_step

    def due(self, step: int, stop: bool, checkpoint_due: bool) -> bool:
        return (self.commit is not None and step < self.last_step and not stop
                and (step % self.every == 0 or checkpoint_due))
