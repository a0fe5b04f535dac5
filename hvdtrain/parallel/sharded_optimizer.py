"""A sharded optimizer over Horovod: ZeRO stage 1 (Rajbhandari et al. 2019), Megatron-Core's
distributed optimizer, with `parallel.shard: optimizer`; stages 2 and 3 with `gradients` and
`full` (below the ZeRO-1 notes).

Unsharded, every data-parallel copy allreduces the gradients and then steps the whole
optimizer state: fp32 weights 4 B + gradients 4 B + two fp32 moments 8 B per parameter on
every copy. Sharded over the d copies that reduce a model's (or a pipeline stage's)
gradients, each copy owns 1/d of every parameter, the flat range `shard_range` gives it
(Horovod's own split of a reduce-scatter):

    backward                  gradients accumulate in the parameters' .grad, as today
    reduce-scatter            each copy receives the reduced gradient of its slices only
                              (hvd.reducescatter, the same op, process set and pre/postscale
                              factors as the allreduce), and the full gradients are freed
    normalise, clip, guard    the token-count factor (distributed.TokenNormalizer) on the slices;
                              the global norm: squares of the slices summed over the copies
                              and along the pipeline (a tied weight counted once); fp16's
                              found-inf flag the maximum over the copies (and along the
                              pipeline, over a tensor-parallel group), so all skip together
    step                      AdamW or LAMB (hvdtrain.optim.optimizers) on the slices of fp32 master
                              weights with their 1/d of the moments; weight decay on the slices
                              of matrices only; LAMB's trust ratio from the norms of the whole
                              parameters (one allreduce of per-parameter squares)
    allgather                 the updated slices, so every copy holds the whole weights again

A reduce-scatter and an allgather move (d-1)/d of the data each, as the two halves of one
ring allreduce do (NCCL's ring algorithms): the bytes on the wire per step are those of
today's allreduce.

Memory per parameter: fp32 weights (the master slices are views into them) 4 + gradients 4 +
moments 8/d = 8 + 8/d. With train.precision=bf16 the model's weights themselves are bf16 (the
computation's weights, 2 B), the gradients are accumulated in fp32 (4 B: each micro batch's
bf16 .grad is added into them and freed, as Megatron's main_grad), and the fp32 master slices
(4/d) and moments (8/d) are this copy's own: 6 + 12/d. The reduced gradient slices (4/d) take
the place of the full gradients: Horovod's reduce-scatter allocates its output (Megatron
reduces in place into its gradient buffer; Horovod cannot), and each parameter's full gradient
is freed as soon as its reduce-scatter is done (`_collect_done`, polled from the gradient hooks
while backward goes on), so the two live side by side only for the reductions in flight: at
most one fusion buffer's worth during backward, one bucket (BUCKET_BYTES) after it. Transient
too: one bucket of gathered weights at a time, once the slices are freed. Horovod's own
working buffers come on top (its fusion buffer; on Gloo a copy of each tensor it reduces
alone and the halving-doubling algorithm's buffers, see docs/memory.md).
The reduce-scatter carries fp32 (the sum is the masters'); the allgather carries the weights'
own dtype (`on_the_wire`): bf16 weights cross as their 16 bits, viewed as int16 since Horovod's
collectives take no bf16 (their rounding is the cast into the weights, done before the gather
instead of after it: the same values), so a bf16 step moves 1.5x the bytes of an fp32
reduce-scatter, three quarters of today's fp32 allreduce.

What overlaps with backward: in the last micro batch of a step each parameter's reduce-scatter
is enqueued from its post-accumulate-grad hook as soon as its gradient is complete, and
Horovod's background thread runs (and fuses) them while backward goes on, as
hvd.DistributedOptimizer does with its allreduces. With `reduce_during=False` (pipeline stages
reducing after the schedule's run: NCCL must not run Horovod's collectives beside the
pipeline's send/recv) they are grouped reduce-scatters after backward, one bucket at a time. What does not
overlap: the wait for the last gradients (the embeddings', complete when backward ends), the
norm and found-inf reductions, the step, and the allgather, which runs after the step and
before the next forward (Megatron overlaps it with the next forward, waiting for each layer's
weights in a forward pre-hook; not done here).

`parallel.shard: gradients` (ZeRO-2): the reduce-scatter is started from the hook of every
backward pass, not only the last; each pass's full gradient (bf16: its fp32 copy) is released
to Horovod at once and freed when its reduction is done, and the reduced slices accumulate in
the masters' `.grad` over the step: 4 + 12/d bytes per parameter, bf16 2 + 16/d, plus the
reductions in flight, at most one fusion buffer's worth (`in_flight_limit`): a backward that
outruns them waits for the oldest. A pipeline that reduces after its runs reduces after each run
(`reduce_run`, called by the step engine). `full` (ZeRO-3) reduces the same way; its masters are
copies, the weights' only home, gathered unit by unit by hvdtrain.parallel.sharded_weights, so
`step` allgathers nothing.

Split layers and experts: with tensor parallelism (`tensor_group`) a split weight is sharded as
its local tensor (the DTensor's, this rank's slice of it) over the copies holding the same
slices, and its squares summed over the group too; a checkpoint gathers each rank's local
tensors over its copies (`gathered`) for tensor_parallel.whole_state. With expert parallelism
(`elsewhere`) each expert weight is sharded over the ranks holding the same experts (its
`Copies`: their process set, the extra 1/e of an averaged gradient, its rows' offset in the
whole tensor), the dense weights over all; grouped collectives take one process set each.

Checkpoints (hvdtrain.checkpointing.checkpoint.write_slices): every copy writes its slices of the fp32
weights and of the optimizer state under the parameters' names; any layout, sharded or not,
reads them back (checkpoint.read_ranges reads only the range a slice needs).
"""
from collections import deque
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from hvdtrain.checkpointing import checkpoint
from hvdtrain.parallel.distributed import share_found_inf
from hvdtrain.parallel import pipeline
from hvdtrain.parallel.tensor_parallel import is_split, like, local
from hvdtrain.optim.optimizers import optimizer_for

try:  # as in distributed.py
    import horovod.torch as hvd
except ImportError:  # pragma: no cover
    hvd = None

# Bytes of gradients one grouped reduce-scatter after backward takes, and of weights one grouped
# allgather brings back, at most: bounds the transient copies (as Horovod's 128 MiB fusion buffer
# default does for its allreduces).
BUCKET_BYTES = 128 * 2 ** 20
STATE_FIELDS = ("step", "exp_avg", "exp_avg_sq")  # what AdamW and LAMB keep per parameter


def shard_range(numel: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of a flattened tensor of `numel` values that copy `rank` of `size` owns:
    Horovod's reduce-scatter split, numel // size each and one more for the first numel % size."""
    base, extra = divmod(numel, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def on_the_wire(s: "_Slice") -> torch.Tensor:
    """A master slice as Horovod's allgather carries it: in its weights' dtype, so 16-bit weights
    move half the bytes of their fp32 masters; bf16 as its bits in int16 (Horovod's collectives
    take no bf16: the gather only moves them). An fp32 master goes as it is."""
    if s.param.dtype == torch.float32:
        return s.master.detach()
    wire = s.master.detach().to(s.param.dtype)
    return wire.view(torch.int16) if s.param.dtype == torch.bfloat16 else wire


def off_the_wire(whole: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What on_the_wire sent, gathered, as weights of `dtype` again."""
    return whole.view(torch.bfloat16) if dtype == torch.bfloat16 else whole


@dataclass
class Copies:
    """The copies that hold the same tensor as this rank, among which it is sharded: all the
    optimizer's, or (expert parallelism) those holding the same experts."""
    process_set: object         # their Horovod process set
    rank: int                   # this rank among them
    size: int
    postscale: float = 1.0      # on the reduced gradient (experts': averaged over e ranks more)
    offset: int = 0             # where this rank's tensor starts in the flattened whole one (checkpoints)
    whole_shape: tuple | None = None  # the whole tensor's shape; None: this rank's tensor's


@dataclass
class _Slice:
    """This copy's part of one parameter."""
    name: str
    param: torch.nn.Parameter
    copies: Copies
    start: int
    end: int
    master: torch.Tensor           # fp32 [end - start]: the weights' own values, or a copy of them
    main_grad: torch.Tensor | None = None  # 16-bit weights: the fp32 sum of the step's gradients
    passes: int = 0                # backward passes of this step that reached the parameter
    reduced: bool = False          # a reduced slice taken (added into master.grad), this step

    @property
    def saved_range(self) -> tuple[int, int]:
        """[start, end) of this slice in the flattened whole tensor a checkpoint holds."""
        return self.copies.offset + self.start, self.copies.offset + self.end

    @property
    def saved_shape(self) -> tuple:
        return self.copies.whole_shape or self.param.shape


class ShardedOptimizer:
    """An optimizer for the training loop whose state is 1/d on each of the d copies.

    The step engine (hvdtrain.training.step_engine.ShardedStep) calls, per step: `reduce_gradients()`
    (waits for the reduce-scatters), `grads()` for the token normalisation, `allreduce_tied(groups)`
    with pipeline stages, `clip_grad_norm_`, `agree_found_inf` (fp16), then `step` (through a
    GradScaler or the NonFiniteGuard: the inner step, then the allgather) and `zero_grad`.
    `param_groups` are those of the inner optimizer (the loop sets the rate there;
    a GradScaler unscales the reduced slices there); `step` is what a GradScaler or the
    NonFiniteGuard calls. Checkpoints: `write_part` and `load`."""
    # As Lamb: set for one step by a GradScaler or the NonFiniteGuard, handed to the inner optimizer.
    found_inf = None
    grad_scale = None

    def __init__(self, model: torch.nn.Module, train_cfg, peak_lr: float, device: torch.device, horovod_cfg,
                 backward_passes: int, rank: int, size: int, process_set=None, reduce_during: bool = True,
                 compute_dtype: torch.dtype = torch.float32, not_counted=(), level: str = "optimizer",
                 masters: dict[int, torch.Tensor] | None = None, tensor_group: dist.ProcessGroup | None = None,
                 elsewhere: dict[int, Copies] | None = None):
        """`rank` of `size`: this copy among those that reduce the model's gradients, the Horovod
        `process_set` (default: all workers). `backward_passes`: micro batches per step.
        `compute_dtype`: the weights' dtype (bfloat16: the weights are cast, fp32 masters kept).
        `not_counted`: parameters left out of the global norm (a pipeline's tied copy).
        `level`: parallel.shard, "optimizer", "gradients" or "full" (whose weights this class
        does not gather: hvdtrain.parallel.sharded_weights does, from the masters).
        `masters`: this copy's fp32 slices by id(parameter), where the build made only those
        (sharded_weights.materialise_slices); the others are taken from the weights.
        `tensor_group`: with tensor parallelism (hvdtrain.parallel.tensor_parallel) the ranks that
        hold the other slices of the split layers; a split parameter (a DTensor) is sharded here as
        its local tensor, the one this rank holds, over the copies holding the same slices.
        `elsewhere`: the parameters sharded over other copies than the optimizer's, by
        id(parameter) (expert parallelism: the experts' weights, expert_parallel.expert_copies)."""
        self.model, self.rank, self.size, self.level = model, rank, size, level
        self.tensor_group = tensor_group
        # ZeRO-2 and 3: every micro batch's gradients are reduce-scattered, not only the last's
        self.every_pass = level in ("gradients", "full")
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        self.backward_passes, self.reduce_during, self.compute_dtype = backward_passes, reduce_during, compute_dtype
        self.op = {"average": hvd.Average, "sum": hvd.Sum}[horovod_cfg.op]
        self.predivide = horovod_cfg.gradient_predivide_factor if self.op == hvd.Average else 1.0
        everyone, elsewhere = Copies(self.process_set, rank, size), elsewhere or {}
        self.slices = []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            copies = elsewhere.get(id(p), everyone)
            start, end = shard_range(local(p).numel(), copies.rank, copies.size)
            if masters and id(p) in masters:
                master = masters[id(p)]
            else:  # fp32 weights kept whole: the master slice is a view into them; else its own copy
                own = local(p.detach()).view(-1)[start:end]
                master = own if compute_dtype == torch.float32 and level != "full" else own.float().clone()
            self.slices.append(_Slice(name, p, copies, start, end, master))
        if compute_dtype != torch.float32:  # after the masters took the fp32 values
            for s in self.slices:
                if is_split(s.param):  # a DTensor's .data keeps its dtype: swap in a cast copy (the same object)
                    torch.utils.swap_tensors(s.param, torch.nn.Parameter(s.param.detach().to(compute_dtype)))
                else:
                    s.param.data = s.param.data.to(compute_dtype)
        self.not_counted = {id(p) for p in not_counted}
        self.inner = optimizer_for([s.master for s in self.slices], [s.param.dim() >= 2 for s in self.slices],
                                   train_cfg, peak_lr, device, lamb_norms=self._sum_over_copies)
        self._step_supports_amp_scaling = getattr(self.inner, "_step_supports_amp_scaling", False)
        self.by_param = {id(s.param): s for s in self.slices}
        self.in_flight = deque()  # (slice, handle, bytes) of the reduce-scatters started during backward, oldest first
        self.in_flight_bytes = 0  # of the full gradients they hold
        # ZeRO-2/3: at most one fusion buffer's worth of full gradients in flight (the plan's count)
        mib = horovod_cfg.fusion_threshold_mb
        self.in_flight_limit = int(mib * 2 ** 20) if mib else BUCKET_BYTES
        for s in self.slices:
            s.param.register_post_accumulate_grad_hook(partial(self._on_gradient, s))

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    # ------------------------------------------------------------ gradients

    def _on_gradient(self, s: _Slice, param: torch.nn.Parameter):
        """After each backward pass has added to the parameter's gradient."""
        s.passes += 1
        if self.every_pass and self.reduce_during:  # ZeRO-2/3: this pass's gradient, reduced now
            grad = local(param.grad).float().reshape(-1)
            param.grad = None  # the next pass starts a new one; Horovod holds this one until done
            self._start_reduce(s, grad)
            return
        if self.compute_dtype != torch.float32:  # 16-bit weights: sum the gradients in fp32
            grad = local(param.grad)
            s.main_grad = grad.float() if s.main_grad is None else s.main_grad.add_(grad)
            param.grad = None
        if self.reduce_during and s.passes == self.backward_passes:  # complete: reduce it now, during backward
            self._start_reduce(s, self._full_grad(s))

    def _start_reduce(self, s: _Slice, grad: torch.Tensor):
        # Horovod: reduce-scatter, in the background while backward goes on
        handle = hvd.reducescatter_async(grad, name=f"shard.{s.name}.{s.passes}", **self._reduce_args(s.copies))
        self.in_flight.append((s, handle, grad.numel() * grad.element_size()))
        self.in_flight_bytes += self.in_flight[-1][2]
        self._collect_done()

    def _collect_done(self, wait: bool = False):
        """Take the reduced slices of the reduce-scatters that are done (all of them with `wait`),
        oldest first, freeing their full gradients: the slices then take the full gradients' place.
        With ZeRO-2/3, where no full gradient outlives its reduction otherwise, a backward that
        outruns the reductions waits here for the oldest until no more than `in_flight_limit`
        bytes of full gradients remain (as FSDP's rate limit does for its gathers)."""
        while self.in_flight and (wait or hvd.poll(self.in_flight[0][1])
                                  or (self.every_pass and self.in_flight_bytes > self.in_flight_limit)):
            s, handle, nbytes = self.in_flight.popleft()
            self.in_flight_bytes -= nbytes
            self._take(s, hvd.synchronize(handle))

    def _take(self, s: _Slice, reduced: torch.Tensor):
        """The reduced slice added into the step's (ZeRO-2/3: the slices of each micro batch
        accumulate there), its full gradient freed."""
        s.master.grad = reduced if s.master.grad is None else s.master.grad.add_(reduced)
        s.reduced, s.main_grad, s.param.grad = True, None, None

    def _full_grad(self, s: _Slice) -> torch.Tensor:
        grad = s.main_grad if self.compute_dtype != torch.float32 else s.param.grad
        if grad is None:  # a parameter this step did not reach: every copy must send the same tensors
            grad = torch.zeros(local(s.param).shape, dtype=torch.float32, device=s.param.device)
        return local(grad).reshape(-1)

    def _has_full_grad(self, s: _Slice) -> bool:
        return (s.main_grad if self.compute_dtype != torch.float32 else s.param.grad) is not None

    @property
    def reduces_each_run(self) -> bool:
        """ZeRO-2/3 with a pipeline that reduces after its runs: the engine calls reduce_run()
        after each run of the schedule, so no full gradient outlives a run."""
        return self.every_pass and not self.reduce_during

    def reduce_run(self):
        """The full gradients summed so far (a pipeline run's), reduce-scattered into the slices."""
        self._reduce_buckets([s for s in self.slices if self._has_full_grad(s)])

    def reduce_gradients(self):
        """Every slice's reduced gradient in its `.grad` (waits for the reduce-scatters started
        during backward; starts those that were not), and the full gradients freed."""
        self._collect_done(wait=True)
        # Full gradients not yet reduced, and parameters this step did not reach (zeros)
        self._reduce_buckets([s for s in self.slices if self._has_full_grad(s) or not s.reduced])
        for s in self.slices:
            s.reduced, s.passes = False, 0

    def _reduce_buckets(self, slices: list[_Slice]):
        """Grouped reduce-scatters of at most BUCKET_BYTES each, one at a time."""
        for bucket in self._buckets(slices):
            # Horovod: grouped reduce-scatter of gradients not yet reduced
            handle = hvd.grouped_reducescatter_async([self._full_grad(s) for s in bucket],
                                                     name=f"shard.grads.{bucket[-1].name}",
                                                     **self._reduce_args(bucket[0].copies))
            for s, reduced in zip(bucket, hvd.synchronize(handle)):
                self._take(s, reduced)

    def _reduce_args(self, copies: Copies) -> dict:
        """The reduce-scatter's op, process set and scale factors (as hvd.DistributedOptimizer's:
        horovod.op, gradient_predivide_factor) for a tensor sharded over `copies`."""
        return dict(op=self.op, process_set=copies.process_set, prescale_factor=1.0 / self.predivide,
                    postscale_factor=self.predivide * copies.postscale)

    @staticmethod
    def _buckets(slices: list[_Slice]):
        """`slices` in consecutive groups of at most BUCKET_BYTES of fp32 (one slice alone if
        larger), each sharded over the same copies (one process set per grouped collective)."""
        bucket, size = [], 0
        for s in slices:
            if bucket and (size + 4 * local(s.param).numel() > BUCKET_BYTES
                           or s.copies.process_set is not bucket[0].copies.process_set):
                yield bucket
                bucket, size = [], 0
            bucket.append(s)
            size += 4 * local(s.param).numel()
        if bucket:
            yield bucket

    def grads(self) -> list[torch.Tensor]:
        """This copy's reduced gradient slices."""
        return [s.master.grad for s in self.slices]

    def allreduce_tied(self, groups):
        """Pipeline stages: sum the slices of the tied copies between the first and the last
        stage (the same slices: copy j of the first stage and copy j of the last are the ends of
        pipeline j), as pipeline.allreduce_tied_grads does with whole gradients."""
        if groups.tied is None:
            return
        for p in pipeline.tied_parameters(self.model).values():
            # torch.distributed: allreduce (sum), first + last stage
            dist.all_reduce(self.by_param[id(p)].master.grad, group=groups.tied)

    def _sum_over_copies(self, values: torch.Tensor) -> torch.Tensor:
        """Sum over the copies (LAMB's squared norms of the whole parameters)."""
        return hvd.allreduce(values, name="shard.sum", op=hvd.Sum, process_set=self.process_set)  # Horovod: allreduce (sum)

    def clip_grad_norm_(self, max_norm: float, groups=None) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ of the whole model's reduced gradient: the squared norm
        of this copy's slices, summed over the copies and, with pipeline stages, along the
        pipeline (`groups`); with tensor parallelism the split parameters' over the tensor group
        too, the whole ones (equal on its ranks) counted once. Every slice scaled by the same
        coefficient. Returns the norm."""
        counted = [s for s in self.slices if id(s.param) not in self.not_counted]

        def squares_of(split: bool) -> torch.Tensor:  # (an empty list's norm is a host zero)
            grads = [s.master.grad for s in counted if is_split(s.param) == split]
            return (torch.nn.utils.get_total_norm(grads) ** 2).to(self.slices[0].master.device)

        # squares of the whole parameters' slices and of the split ones', summed over the copies
        squares = self._sum_over_copies(torch.stack([squares_of(False), squares_of(True)]))
        if self.tensor_group is not None:
            split = squares[1:].clone()
            dist.all_reduce(split, group=self.tensor_group)  # torch.distributed: allreduce (sum) over the tensor group
            squares = torch.cat([squares[:1], split])
        if groups is not None:
            dist.all_reduce(squares, group=groups.pipeline)  # torch.distributed: allreduce (sum), along the pipeline
        total = squares.sum().sqrt()
        torch.nn.utils.clip_grads_with_norm_([s.master for s in self.slices], max_norm, total)
        return total

    def agree_found_inf(self, scaler: torch.amp.GradScaler, groups=None):
        """fp16: after scaler.unscale_(self), each copy found inf in its own slices only; make
        every copy's (and every stage's, every slice's) scaler see the maximum, so that all skip
        together."""
        flags = list(scaler._found_inf_per_device(self).values())
        # Horovod: allreduce (max) over the copies
        found = hvd.allreduce(torch.stack(flags).amax().reshape(1), name="shard.found_inf", op=hvd.Max,
                              process_set=self.process_set)
        for flag in flags:
            flag.copy_(found.reshape(flag.shape))
        if groups is not None:  # torch.distributed: allreduce (max) along the pipeline
            share_found_inf(scaler, self, groups.pipeline)
        if self.tensor_group is not None:  # torch.distributed: allreduce (max) over the tensor group
            share_found_inf(scaler, self, self.tensor_group)

    # ------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self):
        """The inner optimizer's step on this copy's slices, then the allgather of the weights."""
        self.inner.found_inf, self.inner.grad_scale = self.found_inf, self.grad_scale
        self.inner.step()
        self.inner.found_inf = self.inner.grad_scale = None
        self.zero_grad()  # the reduced slices are spent: their memory is free for the gathered weights
        if self.level == "full":  # gathered unit by unit when the next forward needs them (sharded_weights)
            return
        for bucket in self._buckets(self.slices):
            # Horovod: grouped allgather of the updated slices, in the weights' dtype
            gathered = hvd.grouped_allgather([on_the_wire(s) for s in bucket], name=f"shard.weights.{bucket[-1].name}",
                                             process_set=bucket[0].copies.process_set)
            for s, whole in zip(bucket, gathered):
                local(s.param.detach()).view(-1).copy_(off_the_wire(whole, s.param.dtype))

    def zero_grad(self):
        for s in self.slices:
            s.master.grad = None

    # ------------------------------------------------------------ checkpoints

    def write_part(self, tmp, index: int, count: int) -> dict[str, dict]:
        """This copy's slices of the fp32 weights and of the optimizer state, under the
        parameters' names (checkpoint.write_slices); the first copy adds the model's buffers."""
        weights = {s.name: (s.master, s.saved_range[0], s.saved_shape) for s in self.slices if s.end > s.start}
        if self.rank == 0:
            names = {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
            weights.update({k: v for k, v in self.model.state_dict().items() if k not in names})
        state = {}
        for s in self.slices:
            if s.end == s.start:  # a parameter smaller than the copies: this one holds none of it
                continue
            for key, value in self.inner.state.get(s.master, {}).items():
                state[f"{s.name}::{key}"] = value if value.dim() == 0 else (value, s.saved_range[0], s.saved_shape)
        return checkpoint.write_slices(tmp, index, count, weights, state)

    def gathered(self) -> tuple[dict, dict]:
        """Tensor parallelism's checkpoints (hvdtrain.parallel.tensor_parallel.whole_state):
        (weights, optimizer state) by name, the fp32 master weights and the state of this rank's
        local tensors, allgathered over the copies (every copy calls this), DTensors where split;
        the model's buffers beside the weights. Each copy then holds its local tensors' whole
        state for the moment, as the group's first copy gathers them whole to write them."""
        weights, state = {}, {}
        for s in self.slices:
            fields = self.inner.state.get(s.master, {})
            moments = [k for k in STATE_FIELDS if k in fields and fields[k].dim()]
            # Horovod: grouped allgather over the copies of the weights' and the moments' slices
            whole = hvd.grouped_allgather([s.master.detach()] + [fields[k] for k in moments],
                                          name=f"shard.gather.{s.name}", process_set=s.copies.process_set)
            shaped = [like(s.param, w.view(local(s.param).shape)) for w in whole]
            weights[s.name] = shaped[0]
            state.update({f"{s.name}::{k}": v for k, v in zip(moments, shaped[1:])})
            state.update({f"{s.name}::{k}": fields[k] for k in STATE_FIELDS if k in fields and not fields[k].dim()})
        names = {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
        weights.update({k: v for k, v in self.model.state_dict().items() if k not in names})
        return weights, state

    @torch.no_grad()
    def load(self, path, aliases: dict[str, list[str]], place=None):
        """This copy's master slices and optimizer state from a checkpoint of any layout, sharded
        or not (the model's weights are loaded by checkpoint.load_weights, except with "full",
        whose weights the masters are); reads only the slices' ranges. `aliases`: the tied names
        (checkpoint.tie_aliases). With tensor parallelism `place` (tensor_parallel.placed): the
        whole tensors are read, and of each the slice of this rank's local tensor kept."""
        def names(s):
            return [s.name, *aliases.get(s.name, [])]

        def read(s):  # the range of the saved tensor that holds this slice
            return s.saved_range if place is None else (0, s.param.numel())

        def mine(s, values):  # this slice of what was read
            if place is None or values is None or not values.dim():
                return values
            return local(place(s.name, values)).reshape(-1)[s.start:s.end]

        ranges = {n: read(s) for s in self.slices for n in names(s)}
        weights = checkpoint.read_ranges(path, "model", ranges)
        state_ranges = {f"{n}::{k}": read(s) for s in self.slices for n in names(s) for k in STATE_FIELDS}
        saved = checkpoint.read_ranges(path, "optimizer", state_ranges)
        order = {id(t): i for i, t in enumerate(t for g in self.inner.param_groups for t in g["params"])}
        state = {}
        for s in self.slices:
            if s.end == s.start:
                continue
            s.master.copy_(mine(s, next(weights[n] for n in names(s) if weights[n] is not None)))
            source = next((n for n in names(s) if saved[f"{n}::exp_avg"] is not None), None)
            if source is not None:  # none when the checkpoint's run has not stepped yet
                state[order[id(s.master)]] = {k: mine(s, saved[f"{source}::{k}"]) for k in STATE_FIELDS}
        self.inner.load_state_dict({"state": state, "param_groups": self.inner.state_dict()["param_groups"]})
