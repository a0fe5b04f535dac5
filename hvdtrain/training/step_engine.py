"""One optimizer step's work on this worker, done one of five ways, chosen once at set-up.

    PlainStep       the whole model on every worker; hvd.DistributedOptimizer allreduces the
                    gradients over all workers, started by its hooks during the last backward
                    (StandInStep: the one worker left of an elastic job of two runs the micro
                    batches of both and sums their gradients as the two did)
    ExpertParallelStep  parallel.expert_parallel: as PlainStep, with each layer's experts split
                    over the ranks of an expert group (hvdtrain.parallel.expert_parallel); the
                    dense and the expert gradients allreduced during backward, over different ranks
    TensorParallelStep  parallel.tensor_parallel: as PlainStep, with each layer's matrices split over
                    the ranks of a tensor-parallel group (hvdtrain.parallel.tensor_parallel), which
                    read the same samples; the gradients allreduced over the copies during backward
                    (or after it: parallel.reduce_gradients)
    PipelinedStep   this worker's pipeline stage (hvdtrain.parallel.pipeline): torch's schedule runs the
                    micro batches, Horovod reduces gradients among the copies of the stage only
                    (during the schedule's backward, or after it), the tied embedding is summed
                    between the first and last stage, and one gradient norm is taken over all
                    stages; with parallel.tensor_parallel too, the stage's layers are split over
                    a tensor-parallel group (reduced after, as local tensors); with
                    parallel.expert_parallel, its experts over groups of the stage's copies
    ShardedStep     parallel.shard (optimizer, gradients, full), around either of them: their
                    forward/backward and evaluation; the reduction (reduce-scatter), normalisation,
                    clip, non-finite agreement and step are the hvdtrain.parallel.sharded_optimizer's,
                    on this copy's slices

All of them answer the same calls, which the loop (hvdtrain.training.train.run_steps) makes in this order:

    loss_sum = engine.forward_backward(micro_batches, timer)  # this rank's summed token losses (+ statistics)
    engine.reduce_gradients()                     # every copy holds the reduced gradients (sharded: its slices)
    engine.normalize(global_targets)              # ... divided by the step's target tokens (distributed.StepTotals)
    grad_norm = engine.clip_gradients(max_norm)   # unscaled, one norm, clipped
    engine.optimizer_step(guard, grad_norm)       # step, or skip on inf/NaN (all ranks alike)
    result = engine.evaluate(loader)              # the loss of every rank's validation slice
    engine.close()                                # at the run's end; collective

Collective calls are tagged `# Horovod:` (or `# torch.distributed:` along a pipeline).
"""
import functools
import math
from contextlib import nullcontext

import torch

from hvdtrain.parallel import distributed, expert_parallel, parallel_dims, pipeline, tensor_parallel
from hvdtrain.parallel.distributed import hvd
from hvdtrain.parallel.sharded_weights import ShardedWeights
from hvdtrain.config import Config, HorovodConfig
from hvdtrain.models.common import IGNORE_INDEX, evaluation_sums, training_sums


def autocast_for(device: torch.device, precision: str):
    """train.precision as torch.autocast (off for fp32)."""
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16,
                          enabled=precision != "fp32")


def evaluation_result(loss: float, correct: float, targets: float, accuracy: bool) -> dict:
    """Sums of this rank's evaluation, summed over all ranks before dividing, so it is the loss
    of the whole evaluated set."""
    # Horovod: allreduce (sum) of the evaluation's sums
    loss, correct, targets = distributed.allreduce_sum([loss, correct, targets], name="eval")
    mean = loss / max(targets, 1)
    result = {"eval_loss": mean, "eval_ppl": math.exp(mean) if mean < 50 else float("inf")}
    if accuracy:
        result["eval_accuracy"] = correct / max(targets, 1)
    return result


def even_batches(loader, process_set, micro_batch_shape: tuple[int, int]) -> list[dict]:
    """The validation batches of `loader`, as many on every rank of `process_set` (whose ranks
    each run a collective in every forward): a rank with fewer (batches r, r+d, ...) adds
    batches of `micro_batch_shape` (samples, tokens) that predict nothing."""
    batches = list(loader)
    # Horovod: allreduce (max) of the ranks' batch counts
    most = int(hvd.allreduce(torch.tensor([len(batches)]), name="eval_batches", op=hvd.Max,
                             process_set=process_set)[0])
    if len(batches) < most:
        ids = torch.zeros(micro_batch_shape, dtype=torch.long)
        batches += [{"input_ids": ids, "labels": torch.full_like(ids, IGNORE_INDEX)}] * (most - len(batches))
    return batches


class PlainStep:
    """The whole model, Horovod data parallelism over all workers. `optimizer` is Horovod's
    DistributedOptimizer; `normalizer` a distributed.TokenNormalizer."""
    stages = 1                # workers that read the same samples (distributed.StepTotals)
    copies_per_stage = None   # with pipeline stages: the data-parallel copies of each (for the step breakdown)

    def __init__(self, model, optimizer, scaler: torch.amp.GradScaler, normalizer, autocast, device: torch.device):
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.normalizer, self.autocast, self.device = normalizer, autocast, device

    def forward_backward(self, micro_batches: list[dict], timer) -> torch.Tensor:
        """Forward and backward of each micro batch; Horovod's hooks start the allreduce during
        the last backward. Returns this rank's sum of token losses (a device tensor), followed,
        for a family with an auxiliary loss, by the statistics of it that the run logs (a
        vector then: models.common.training_sums)."""
        sums = torch.zeros((), device=self.device)
        for mb in micro_batches:
            with timer.phase("forward"), self.autocast:
                loss, statistics = training_sums(self.model, mb)  # chunked: never the whole batch's logits
            with timer.phase("backward"):
                self.scaler.scale(loss * self.normalizer.loss_scale).backward()
            step_sums = loss.detach() if statistics.numel() == 0 else torch.cat([loss.detach().reshape(1), statistics])
            sums = sums + step_sums
        return sums

    def reduce_gradients(self):
        """Wait for the gradient allreduce started in backward."""
        self.optimizer.synchronize()  # Horovod: wait for the allreduce of gradients

    def normalize(self, global_targets: float):
        """Make the reduced gradients those of the loss per target token of the whole step."""
        # local tensors: one list of split (DTensor) and whole gradients would not go through torch's foreach kernels
        self.normalizer.finish([tensor_parallel.local(p.grad) for p in self.model.parameters() if p.grad is not None],
                               global_targets)

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Unscale (fp16), clip to `max_norm`; returns the norm before clipping."""
        self.scaler.unscale_(self.optimizer)
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def agree_on_nonfinite(self):
        """fp16: make every rank's scaler see the same inf/NaN. Here nothing to do: the
        gradients were reduced, so an inf on one rank is on all of them."""

    def stepping(self):
        """The context of the optimizer's step: Horovod's wrapper must not reduce again."""
        return self.optimizer.skip_synchronize()

    def optimizer_step(self, guard, grad_norm: torch.Tensor):
        """The optimizer's step, or a skip when the gradients are not finite (by the fp16 scaler,
        or else by the guard: hvdtrain.training.run_guards), then the gradients zeroed."""
        with self.stepping():
            if not self.scaler.is_enabled():
                guard.step(self.optimizer, grad_norm)
            else:
                self.agree_on_nonfinite()
                guard.scaler_step(self.scaler, self.optimizer)
        self.zero_grad()

    def zero_grad(self):
        distributed.zero_grad(self.optimizer)

    @torch.no_grad()
    def evaluate(self, loader) -> dict:
        """Loss and next/masked-token accuracy on each rank's fixed validation slice, over all
        ranks; in chunks of positions (evaluation_sums), never a micro batch's whole logits."""
        self.model.eval()
        loss = correct = targets = 0.0
        for batch in loader:
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items() if torch.is_tensor(v)}
            with self.autocast:
                batch_loss, batch_correct, batch_targets = evaluation_sums(self.model, batch)
            loss += batch_loss.item()
            correct += batch_correct.item()
            targets += batch_targets
        self.model.train()
        return evaluation_result(loss, correct, targets, accuracy=True)

    def describe(self) -> dict:
        """What the run folder's config.yaml records of this engine (`resolved`)."""
        return {}

    def close(self):
        """At the run's end, once every rank has finished its last step."""


class StandInStep(PlainStep):
    """An elastic job of at most 2 workers, down to 1 (hvdtrain.parallel.elastic): the worker left
    stands in for both. It runs the first worker's micro batches into one gradient and the
    second's into another, and adds the two, as their allreduce did (a + b, the same bits either
    way round). The step's gradient and loss sum are then bitwise those of the 2-worker job:
    summed in one gradient, ((g0 + g1) + g2) + g3 instead of (g0 + g1) + (g2 + g3), they differ
    in the last bits, and training amplifies that. (With more workers Horovod's ring allreduce
    sums in an order that depends on how it fused the tensors, so there is no one order to
    keep.) It costs one more gradient in memory while the job is down to one worker."""

    def __init__(self, *args, grad_accum: int):
        super().__init__(*args)
        # Horovod's hooks would start the allreduce at the step's last backward, before the two
        # gradients are added: give them one pass more than the step has, and synchronize()
        # (reduce_gradients) starts them all. On one worker there is nothing to overlap.
        self.optimizer.set_backward_passes_per_step(grad_accum + 1)

    def forward_backward(self, micro_batches, timer):
        half = len(micro_batches) // 2
        first_loss = super().forward_backward(micro_batches[:half], timer)
        first = {p: p.grad for p in self.model.parameters() if p.grad is not None}
        for p in first:
            p.grad = None
        second_loss = super().forward_backward(micro_batches[half:], timer)
        for p, grad in first.items():
            p.grad = grad if p.grad is None else p.grad.add_(grad)
        # The two workers' loss sums were added in float64 (periodic.StepLog's allreduce)
        return first_loss.double() + second_loss.double()


class ExpertParallelStep(PlainStep):
    """parallel.expert_parallel: the whole model on every worker, each layer's experts split over
    the ranks of an expert group, which exchange tokens in every forward
    (hvdtrain.parallel.expert_parallel). `optimizer` is a plain one: during the last backward
    the dense gradients are allreduced over all workers, the experts' over the ranks holding the
    same experts (expert_parallel.gradient_reduction); the norm counts each expert once."""

    def __init__(self, *args, groups, horovod: HorovodConfig, micro_batch_shape: tuple[int, int], grad_accum: int,
                 reduce: bool = True):
        """`reduce`: allreduce the gradients (False: a ShardedStep around this one reduce-scatters them)."""
        super().__init__(*args)
        self.groups, self.micro_batch_shape = groups, micro_batch_shape
        self.expert_names = expert_parallel.expert_weight_names(self.model)
        self.reduction = (expert_parallel.gradient_reduction(self.model, self.expert_names, groups, horovod, grad_accum)
                          if reduce else None)

    def reduce_gradients(self):
        self.reduction.wait()  # Horovod: wait for the allreduces started in backward

    def clip_gradients(self, max_norm):
        self.scaler.unscale_(self.optimizer)
        # Horovod: allreduce of the squared norms of the expert group's experts
        return expert_parallel.clip_grad_norm_(self.model, self.expert_names, self.groups, max_norm)

    def agree_on_nonfinite(self):
        """A rank whose experts found no inf skips too, as the whole model would."""
        expert_parallel.share_found_inf(self.scaler, self.optimizer, self.groups)  # Horovod: allreduce (max)

    def stepping(self):
        return nullcontext()  # a plain optimizer: nothing to hold back

    def evaluate(self, loader):
        """Every rank of an expert group runs as many forwards (each exchanges tokens)."""
        return super().evaluate(even_batches(loader, self.groups.group_set, self.micro_batch_shape))

    def describe(self):
        return {"experts": f"each layer's experts split over {self.groups.size} workers (alltoall), gradients "
                           f"reduced during backward"}

    def close(self):
        self.groups.close()  # Horovod: remove the process sets (collective)


class TensorParallelStep(PlainStep):
    """parallel.tensor_parallel: each layer's matrices split over the t ranks of a
    tensor-parallel group, which read the same samples (hvdtrain.parallel.tensor_parallel).
    `optimizer` is a plain one over the model's parameters, DTensors where split: during the
    last backward (or after it) the gradients are allreduced over the copies holding the same
    slices (tensor_parallel.gradient_reduction); the norm counts each slice once. The loss sum is the
    group's first rank's (every rank of a group computes the same one)."""

    def __init__(self, *args, groups, horovod: HorovodConfig, grad_accum: int, reduce_after: bool, reduce: bool = True):
        """`reduce_after`: the allreduces wait for the end of backward (parallel.reduce_gradients);
        `reduce`: allreduce the gradients (False: a ShardedStep around this one reduce-scatters them)."""
        super().__init__(*args)
        self.groups = groups
        self.stages = groups.size  # the ranks of a group read the same samples (distributed.StepTotals)
        self.reduction = (tensor_parallel.gradient_reduction(self.model, groups, horovod, grad_accum, not reduce_after)
                          if reduce else None)

    def forward_backward(self, micro_batches, timer):
        sums = super().forward_backward(micro_batches, timer)
        return sums if self.groups.rank == 0 else torch.zeros_like(sums)

    def reduce_gradients(self):
        self.reduction.wait()  # Horovod: wait for the allreduces started in backward

    def clip_gradients(self, max_norm):
        self.scaler.unscale_(self.optimizer)
        # torch.distributed: allreduce of the squared norms of the group's slices
        return tensor_parallel.clip_grad_norm_(self.model, self.groups, max_norm)

    def agree_on_nonfinite(self):
        """fp16: each rank unscaled its own slices (tensor_parallel.LocalGradScaler): all of a
        group skip if one found inf."""
        # torch.distributed: allreduce (max) over the group
        distributed.share_found_inf(self.scaler, self.optimizer, self.groups.group)

    def stepping(self):
        return nullcontext()  # a plain optimizer: nothing to hold back

    # evaluate: PlainStep's. The ranks of a group evaluate the same batches (their forwards sum
    # over the group); their loss and target sums are each counted t times, so the mean is right.

    def describe(self):
        when = "after" if self.reduction is not None and not self.reduction.during else "during"
        return {"tensor_parallel": f"each layer's matrices split over {self.groups.size} workers, gradients "
                                   f"reduced over {self.groups.dp} copies {when} backward"}

    def close(self):
        self.groups.close()  # Horovod and torch.distributed: remove the process sets and groups


class PipelinedStep(PlainStep):
    """This worker's pipeline stage (`model`, a pipeline.StageModule). `optimizer` is Horovod's
    DistributedOptimizer over the copies of the stage, or (`reduce_after`) a plain one whose
    gradients are reduced in one grouped allreduce after the schedule's run, where NCCL would
    otherwise run two communicators at once. With split experts (`expert_groups`) it is a plain
    one: the dense gradients are allreduced over the copies of the stage, the experts' over the
    ranks holding the same experts (expert_parallel.gradient_reduction, during the schedule's
    backward or after it), and the norm counts each expert once. With parallel.shard it is a
    ShardedOptimizer and a ShardedStep around this one reduces, clips and steps: only this
    one's forward_backward and evaluate run."""

    def __init__(self, model, optimizer, scaler, normalizer, autocast, device, layout: parallel_dims.Layout,
                 groups: parallel_dims.Groups, pipe: pipeline.Pipeline, reduce_after: bool, cfg: Config,
                 grad_accum: int = 1, expert_groups=None, reduce: bool = True):
        """`reduce`: reduce the split experts' gradients here (False: a ShardedStep around this
        one reduce-scatters them)."""
        super().__init__(model, optimizer, scaler, normalizer, autocast, device)
        self.layout, self.groups, self.pipe, self.reduce_after, self.cfg = layout, groups, pipe, reduce_after, cfg
        # the stages of a pipeline and the ranks of a tensor-parallel group read the same samples
        self.stages, self.copies_per_stage = layout.stages * layout.tp, layout.dp
        self.expert_groups, self.reduction, self.experts = expert_groups, None, None
        if expert_groups is not None:
            names = expert_parallel.expert_weight_names(model)
            if reduce:
                self.reduction = expert_parallel.gradient_reduction(model, names, expert_groups, cfg.horovod,
                                                                    grad_accum, during=not reduce_after)
            self.experts = ({p for n, p in model.named_parameters() if n in names},
                            functools.partial(expert_parallel.sum_over_group, groups=expert_groups))

    def forward_backward(self, micro_batches, timer):
        """The schedule's runs of m micro batches: forward and backward of every stage
        interleaved (sends and receives along the pipeline). The sum of token losses (and of a
        family's auxiliary loss, followed by its statistics, as PlainStep's) is the last
        stage's (with split layers its first tensor-parallel rank's); 0 on the others."""
        pipe, scaler = self.pipe, self.scaler
        # fp16: torch's schedule runs the backward of the loss, scaled by hand here; scaler.scale
        # (not get_scale) makes the scaler's scale tensor on the first step, as unscale_ needs
        scale = scaler.scale(torch.ones((), device=self.device)).item() if scaler.is_enabled() else 1.0
        pipe.loss.scale = self.normalizer.loss_scale * scale
        loss_sum = torch.zeros((), device=self.device)
        statistics = torch.zeros(self.model.parts.statistics_size(self.model.config), device=self.device)
        m = pipe.n_microbatches
        for i in range(0, len(micro_batches), m):
            run = micro_batches[i:i + m]
            with timer.phase("pipeline"), self.autocast:
                # torch.distributed: send/recv of activations and gradients along the pipeline
                loss_sum += pipeline.run(pipe, torch.cat([mb["input_ids"] for mb in run]),
                                         torch.cat([mb["labels"] for mb in run]))
            # the run's m micro batches' (the first run after a switch between training and
            # evaluation adds torch's shape inference, one more call of the loss, before them)
            statistics += sum(pipe.loss.statistics[-m:], torch.zeros_like(statistics))
        sums = loss_sum if statistics.numel() == 0 else torch.cat([loss_sum.reshape(1), statistics])
        return sums if self.layout.tp_rank == 0 else torch.zeros_like(sums)  # a group's ranks computed the same

    def reduce_gradients(self):
        """The copies of the stage agree, then the tied embedding's two ends."""
        if self.reduction is not None:
            self.reduction.wait()  # Horovod: wait for (or start) the allreduces of the dense and expert gradients
        elif self.reduce_after:
            h = self.cfg.horovod
            # Horovod: grouped allreduce of the gradients within the stage's process set
            distributed.allreduce_grads(self.model.parameters(), self.groups.process_set, "pipeline.grads",
                                        distributed.reduce_op(h), distributed.compression(h),
                                        h.gradient_predivide_factor)
        else:
            self.optimizer.synchronize()  # Horovod: wait for the allreduce within the stage's process set
        pipeline.allreduce_tied_grads(self.model, self.groups)  # torch.distributed: allreduce, first + last stage

    def clip_gradients(self, max_norm):
        self.scaler.unscale_(self.optimizer)
        # torch.distributed: allreduce of the squared norms along the pipeline (Horovod: over the expert group)
        return pipeline.clip_grad_norm_(self.model, max_norm, self.groups, self.experts)

    def agree_on_nonfinite(self):
        """A stage (or a rank of a tensor-parallel group) that found no inf skips too, as the
        whole model would."""
        if self.groups.tensor is not None:  # each rank unscaled its own slices (tensor_parallel.LocalGradScaler)
            # torch.distributed: allreduce (max) over the tensor-parallel group
            distributed.share_found_inf(self.scaler, self.optimizer, self.groups.tensor.get_group())
        if self.expert_groups is not None:  # Horovod: allreduce (max) over the expert group
            expert_parallel.share_found_inf(self.scaler, self.optimizer, self.expert_groups)
        # torch.distributed: allreduce (max) along the pipeline
        distributed.share_found_inf(self.scaler, self.optimizer, self.groups.pipeline)

    def stepping(self):
        plain = self.reduce_after or self.reduction is not None  # no Horovod wrapper to hold back
        return nullcontext() if plain else self.optimizer.skip_synchronize()

    @torch.no_grad()
    def evaluate(self, loader):
        """The loss only (the last stage computes it; no accuracy), in runs of the schedule's m
        micro batches; with split experts every rank of an expert group runs as many (each
        exchanges tokens)."""
        pipe, cfg = self.pipe, self.cfg
        self.model.eval()
        loss = targets = 0.0
        if self.expert_groups is not None:
            loader = even_batches(loader, self.expert_groups.group_set, (cfg.train.micro_batch_size, cfg.data.seq_len))
        batches = [{k: v.to(self.device) for k, v in b.items() if torch.is_tensor(v)} for b in loader]
        for i in range(0, len(batches), pipe.n_microbatches):
            group = batches[i:i + pipe.n_microbatches]
            # The schedule runs a fixed number of micro batches: fill the last group with ones
            # that predict nothing.
            group += [{"input_ids": group[0]["input_ids"], "labels": torch.full_like(group[0]["labels"], IGNORE_INDEX)}
                      ] * (pipe.n_microbatches - len(group))
            labels = torch.cat([b["labels"] for b in group])
            with self.autocast:
                # torch.distributed: send/recv of activations along the pipeline
                loss += pipeline.run(pipe, torch.cat([b["input_ids"] for b in group]), labels, train=False).item()
            if self.layout.is_last:
                targets += (labels != IGNORE_INDEX).sum().item()
        self.model.train()
        return evaluation_result(loss, 0.0, targets, accuracy=False)

    def describe(self):
        layout, m = self.layout, self.pipe.n_microbatches
        bubble = pipeline.ideal_bubble(layout.stages, m, layout.stages_per_rank)
        split = {"tensor_parallel": f"each stage's layers split over {layout.tp} workers"} if layout.tp > 1 else {}
        if self.expert_groups is not None:
            split["experts"] = f"each layer's experts split over {self.expert_groups.size} workers (alltoall)"
        return {"pipeline": f"{self.cfg.parallel.schedule}, {m} micro batches per run, ideal bubble {bubble:.0%}, "
                            f"gradients reduced {'after' if self.reduce_after else 'during'} the pipeline's backward",
                **split}

    def close(self):
        if self.expert_groups is not None:
            self.expert_groups.close()  # Horovod: remove the expert groups' process sets (collective)
        self.groups.close()  # Horovod + torch.distributed: remove the process sets and groups (collective)


class ShardedStep(PlainStep):
    """parallel.shard: `layout_step` (a PlainStep or PipelinedStep, over a
    sharded_optimizer.ShardedOptimizer) runs the micro batches and evaluates; the gradients are
    the optimizer's: reduce-scattered from its hooks in backward (or after a pipeline's run) into
    this copy's slices, which are normalised, clipped to the global norm and stepped here, the
    weights allgathered in its step (with "full", unit by unit before each use:
    hvdtrain.parallel.sharded_weights). The order of the step (PlainStep.optimizer_step) is the same."""

    def __init__(self, layout_step: PlainStep, groups: parallel_dims.Groups | None = None,
                 micro_batch_shape: tuple[int, int] = (1, 1)):
        s = layout_step
        self.micro_batch_shape = micro_batch_shape  # (samples, tokens) of a validation batch
        super().__init__(s.model, s.optimizer, s.scaler, s.normalizer, s.autocast, s.device)
        self.layout_step, self.groups = layout_step, groups
        self.stages, self.copies_per_stage = s.stages, s.copies_per_stage
        # "full": from here on the weights are the master slices, gathered unit by unit when used
        self.weights = ShardedWeights(s.model, s.optimizer) if s.optimizer.level == "full" else None

    def forward_backward(self, micro_batches, timer):
        if not self.optimizer.reduces_each_run:
            return self.layout_step.forward_backward(micro_batches, timer)
        # ZeRO-2/3 with a pipeline reducing after its runs: each run's gradients reduce-scattered
        # after it, so that no full gradient outlives a run of the schedule
        loss_sum, m = 0.0, self.layout_step.pipe.n_microbatches
        for i in range(0, len(micro_batches), m):
            loss_sum = loss_sum + self.layout_step.forward_backward(micro_batches[i:i + m], timer)
            self.optimizer.reduce_run()  # Horovod: grouped reduce-scatter of the run's gradients
        return loss_sum

    def reduce_gradients(self):
        """This copy's slices of the reduced gradients, then (with stages) the tied embedding's two ends."""
        self.free_weights()  # "full": the step changes the masters; the units are gathered anew
        self.optimizer.reduce_gradients()  # Horovod: wait for (or start) the reduce-scatter of gradients
        if self.groups is not None:
            self.optimizer.allreduce_tied(self.groups)  # torch.distributed: allreduce, first + last stage

    def normalize(self, global_targets):
        self.normalizer.finish(self.optimizer.grads(), global_targets)

    def clip_gradients(self, max_norm):
        self.scaler.unscale_(self.optimizer)
        # Horovod (+ torch.distributed along the pipeline): allreduce of the slices' squared norms
        return self.optimizer.clip_grad_norm_(max_norm, self.groups)

    def agree_on_nonfinite(self):
        """Each copy's scaler found inf in its own slices only: all skip if one did."""
        self.optimizer.agree_found_inf(self.scaler, self.groups)  # Horovod (+ torch.distributed): allreduce (max)

    def stepping(self):
        return nullcontext()  # the optimizer's step ends in the allgather of the weights (Horovod)

    def zero_grad(self):
        self.optimizer.zero_grad()

    def evaluate(self, loader):
        if self.weights is None:
            return self.layout_step.evaluate(loader)
        # "full": every copy gathers each unit for each forward, so all run as many
        result = self.layout_step.evaluate(even_batches(loader, self.optimizer.process_set, self.micro_batch_shape))
        self.free_weights()
        return result

    def free_weights(self):
        """"full": give back the units still gathered (Horovod: waits for prefetches no one used)."""
        if self.weights is not None:
            self.weights.free_all()

    def describe(self):
        opt = self.optimizer
        fewer = sorted({s.copies.size for s in opt.slices} - {opt.size})  # the experts' weights' copies
        return {**self.layout_step.describe(),
                "optimizer": f"sharded ({opt.level}) over {opt.size} copies"
                             + "".join(f" (the experts' weights over the {n} holding them)" if n > 1 else
                                       " (the experts' weights whole on the one holding them)" for n in fewer)
                             + " (reduce-scatter, allgather)"}

    def close(self):
        if self.weights is not None:
            self.weights.close()
        self.layout_step.close()


def build_engine(cfg: Config, device, model, optimizer, scaler, grad_accum: int, shards: int, layout=None,
                 groups=None, reduce_after: bool = False, stand_in: bool = False,
                 expert_groups=None, tensor_groups=None) -> PlainStep:
    """The step engine of this run: pipelined when `layout` is given (then `groups` too), and
    sharded around it with parallel.shard (`optimizer` then a ShardedOptimizer); with
    `expert_groups` (parallel.expert_parallel) the experts split, with `tensor_groups`
    (parallel.tensor_parallel) the layers.
    `stand_in`: one worker standing in for the two of an elastic job (StandInStep)."""
    t = cfg.train
    normalizer = distributed.TokenNormalizer(cfg.horovod.op, shards, t.micro_batch_size * grad_accum * cfg.data.seq_len)
    autocast = autocast_for(device, t.precision)
    if layout is None:
        args = (model, optimizer, scaler, normalizer, autocast, device)
        if tensor_groups is not None:
            engine = TensorParallelStep(*args, groups=tensor_groups, horovod=cfg.horovod, grad_accum=grad_accum,
                                        reduce_after=reduce_after, reduce=cfg.parallel.shard == "none")
        elif expert_groups is not None:
            engine = ExpertParallelStep(*args, groups=expert_groups, horovod=cfg.horovod,
                                        micro_batch_shape=(t.micro_batch_size, cfg.data.seq_len), grad_accum=grad_accum,
                                        reduce=cfg.parallel.shard == "none")
        else:
            engine = StandInStep(*args, grad_accum=grad_accum) if stand_in else PlainStep(*args)
    else:
        pipe = pipeline.build_schedule(model, layout, groups, cfg.parallel.schedule,
                                       cfg.parallel.microbatches or grad_accum, 1.0, device)
        engine = PipelinedStep(model, optimizer, scaler, normalizer, autocast, device, layout, groups, pipe,
                               reduce_after, cfg, grad_accum, expert_groups, reduce=cfg.parallel.shard == "none")
    if cfg.parallel.shard == "none":
        return engine
    return ShardedStep(engine, groups, (t.micro_batch_size, cfg.data.seq_len))
