"""Pipeline stages across workers, Horovod data parallelism across the copies of each stage.

The world is `stages x dp` workers: rank = stage * dp + dp_rank (x tp with split layers:
hvdtrain.parallel.parallel_dims). The ranks with the same dp_rank (and tensor slice) form one
pipeline (torch.distributed.pipelining sends activations and gradients along it); the ranks with
the same stage (and slice) hold copies of that stage and reduce their gradients with Horovod,
within the stage's process set. Nothing here is a runtime of our own: the schedules
are torch's, the collectives are torch.distributed's (along a pipeline) and Horovod's (across
copies). Used by a worker, in this order:

    hvd.init(process_sets="dynamic")                  # process sets are added after init
    layout = layout_for(hvd.rank(), hvd.size(), stages)   # hvdtrain.parallel.parallel_dims
    groups = open_groups(layout, "gloo")              # "nccl" on GPUs (parallel_dims)
    torch.manual_seed(seed); blueprint = model_blueprint(...)  # parameters on the meta device
    stage = split_model(blueprint.model, layout, stage_bounds(n_layer, stages))
    blueprint.materialise(stage)                      # only the stage's weights are made
    pipe = build_schedule(stage, layout, groups, "1f1b", microbatches, loss_scale, device)
    optimizer = hvd.DistributedOptimizer(opt, named_parameters=stage.named_parameters(),
                                         process_set=groups.process_set,
                                         backward_passes_per_step=microbatches)
    per optimizer step:
        loss_sum = run(pipe, input_ids, labels)       # forward, loss and backward of all micro batches
        optimizer.synchronize()                       # copies of this stage agree (Horovod)
        allreduce_tied_grads(stage, groups)           # embedding and head copies agree
        ... normalise gradients by the step's target tokens ...
        clip_grad_norm_(stage, max_norm, groups)      # one norm over all stages
        with optimizer.skip_synchronize(): optimizer.step()
    groups.close()

Parameter names stay those of the Hugging Face model (`transformer.h.3.attn.c_attn.weight`),
so each stage can write its part of a checkpoint and any layout can read it back.
"""
import copy
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class

from hvdtrain.models import family_of
from hvdtrain.models.common import IGNORE_INDEX, linear_cross_entropy_sum, masked_positions, switch
from hvdtrain.models.ties import tied_names
from hvdtrain.parallel import distributed
from hvdtrain.parallel.parallel_dims import Groups, Layout
from hvdtrain.parallel.tensor_parallel import is_split, local
# The torch-free arithmetic (split, schedule checks, ideal bubble) lives in pipeline_plan, for
# `hvdtrain plan`; its names are part of this module's API too.
from hvdtrain.parallel.pipeline_plan import (INTERLEAVED, SCHEDULES, _even_bounds, check_schedule,  # noqa: F401
                                     ideal_bubble, stage_bounds)

try:  # as in distributed.py; the split and the checks work without Horovod
    import horovod.torch as hvd
except ImportError:  # pragma: no cover
    hvd = None


# ---------------------------------------------------------------- one rank's part of the model

class StageModule(nn.Module):
    """This rank's part of a Hugging Face model, under the model's own parameter names.

    The module tree is the original one with the layer list replaced by a ModuleDict keyed by
    the layer's index (`transformer.h.3...` stays `transformer.h.3...`) and the modules the
    rank does not own removed. Use it for the optimizer, checkpoints and `.to(device)`.
    `chunks` holds the forward of each pipeline stage the rank runs (layout.stage_ids): the
    first stage maps input_ids to hidden states, the others hidden states to hidden states;
    the last stage returns the final hidden states, and `head_inputs` takes them (and the
    labels) to what the output projection (`output_projection`) sees, for the chunked loss.

    `tied` maps names to the parameters that are one tied parameter in the whole model
    (embedding and output matrix) but whose other half lives on another rank: the first stage
    holds the original, the last stage a copy that starts equal; allreduce_tied_grads keeps
    them equal. Ties within one rank stay shared parameters.

    What to keep and the steps around the layers are the family's (its modeling.PARTS)."""

    def __init__(self, model: nn.Module, layout: Layout, bounds: list[int]):
        super().__init__()
        if len(bounds) != layout.num_stages + 1:
            raise ValueError(f"{len(bounds)} layer bounds for {layout.num_stages} pipeline stages")
        self.parts = parts = family_of(model).modeling().PARTS
        ties = tied_names(model)
        projection = model.get_output_embeddings()
        self.output_projection_name = next(n for n, m in model.named_modules() if m is projection)
        owned = [i for s in layout.stage_ids for i in range(bounds[s], bounds[s + 1])]
        parent, name = self._parent(model, parts.layers)
        layers = getattr(parent, name)
        setattr(parent, name, nn.ModuleDict({str(i): layers[i] for i in owned}))
        for path in (() if layout.is_first else parts.first_only) + (() if layout.is_last else parts.last_only):
            parent, name = self._parent(model, path)
            setattr(parent, name, None)
        for name, child in model.named_children():  # the same top-level names as the model
            setattr(self, name, child)
        self.config = model.config
        self.base_model_prefix = model.base_model_prefix  # how pretrained files may name the body
        self.layout = layout

        kept = dict(self.named_parameters(remove_duplicate=False))
        self.tied_names = []
        for names in ties:  # one entry per tie, in the model's order, so both ends pair them up
            here = [n for n in names if n in kept]
            if here and len(here) < len(names):
                self.tied_names.append(here[0])

        last = layout.num_stages - 1
        self.chunks = [_Chunk(partial(self._run_stage, range(bounds[s], bounds[s + 1]), s == 0, s == last))
                       for s in layout.stage_ids]  # a plain list: not registered twice

    @staticmethod
    def _parent(model: nn.Module, path: str) -> tuple[nn.Module, str]:
        parent, _, name = path.rpartition(".")
        return (model.get_submodule(parent) if parent else model), name

    @property
    def tied(self) -> dict[str, nn.Parameter]:
        """Looked up by name: the parameters may be replaced after the split (made real from
        the meta device, hvdtrain.models.model_build)."""
        return {name: self.get_parameter(name) for name in self.tied_names}

    @property
    def layers(self) -> nn.ModuleDict:
        """This rank's transformer layers, keyed by their index in the whole model."""
        return self.get_submodule(self.parts.layers)

    def _run_stage(self, layer_ids: range, first: bool, last: bool, x: torch.Tensor, carried=None):
        """The stage's output: its hidden states, or (a family with a stage_carry: a mixture)
        (hidden states, what it carries on to the next stage, from `carried`)."""
        h = self.embed(x) if first else x
        inputs = self.parts.layer_inputs(self, h)  # each layer's keyword arguments (rotary embeddings, masks)

        def run_layers():
            out = h
            for i in layer_ids:
                layer = self.layers[str(i)]
                out = layer(out, **inputs(layer))
                if isinstance(out, tuple):  # transformers 4.x blocks return tuples
                    out = out[0]
            return out

        if self.parts.stage_carry is None:
            out = run_layers()
            return self.final_norm(out) if last else out
        out, carried = self.parts.stage_carry(self, layer_ids, carried, run_layers)
        return (self.final_norm(out) if last else out), carried

    def run_layers(self, layer_ids: range, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states through some of this stage's layers (hvdtrain.parallel.layer_costs times
        them one at a time)."""
        out = self._run_stage(layer_ids, False, False, hidden)
        return out[0] if isinstance(out, tuple) else out

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.parts.embed(self, input_ids)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.parts.final_norm(self, hidden)

    def head_inputs(self, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The last stage: (features, labels) of the output projection, as models.head_inputs:
        every position of a causal LM; a masked LM's labelled ones, through its head's transform."""
        if self.parts.masked_head is None:
            return hidden.flatten(0, 1), labels.flatten()
        hidden, labels = masked_positions(hidden, {"labels": labels})
        return self.get_submodule(self.parts.masked_head)(hidden), labels

    @property
    def output_projection(self) -> nn.Module:
        """The last stage's vocabulary projection (the model's output embeddings)."""
        return self.get_submodule(self.output_projection_name)


class _Chunk(nn.Module):
    """One pipeline stage's forward, as the nn.Module PipelineStage wants. It registers no
    parameters: they belong to the StageModule."""

    def __init__(self, forward_fn):
        super().__init__()
        self.forward_fn = forward_fn

    def forward(self, *inputs):
        return self.forward_fn(*inputs)


def split_model(model: nn.Module, layout: Layout, bounds: list[int]) -> StageModule:
    """This rank's StageModule of a model of one of hvdtrain's families (see stage_bounds).

    The model is taken apart in place (no copy). Split the blueprint of
    hvdtrain.models.model_build (parameters on the meta device), then materialise the stage: a
    rank then never holds the layers of another, and every stage starts from the unsplit
    model's weights."""
    return StageModule(model, layout, bounds)


def tied_parameters(stage: StageModule) -> dict[str, nn.Parameter]:
    """Tied parameters whose other copy lives on another stage (see StageModule)."""
    return stage.tied


# ---------------------------------------------------------------- schedule

class TokenLoss:
    """The schedule's loss of one micro batch: `scale` x the sum of its token cross-entropies
    (labels == -100 ignored), plus in training a family's auxiliary loss from what the stages
    carried (ModelParts.carried_loss), whose statistics it keeps in `statistics` (one vector
    per micro batch, until the next run). The schedule does not average over micro batches
    (scale_grads=False): the caller picks the scale and normalises gradients itself (see
    distributed.TokenNormalizer). `scale` may be changed between steps."""

    def __init__(self, stage: StageModule, scale: float):
        self.stage, self.scale = stage, scale
        self.training, self.statistics = True, []

    def __call__(self, output, labels: torch.Tensor) -> torch.Tensor:
        hidden, carried = output if isinstance(output, tuple) else (output, None)
        tokens = hidden.shape[0] * hidden.shape[1]
        # in chunks of positions, as the whole model's loss (models.common.token_loss_sum): a
        # micro batch's whole logits are never held, in training or in evaluation
        features, labels = self.stage.head_inputs(hidden, labels)
        head = self.stage.output_projection
        loss = linear_cross_entropy_sum(features, head.weight, head.bias, labels)
        if carried is not None and self.training:
            auxiliary, statistics = self.stage.parts.carried_loss(self.stage.config, carried, tokens,
                                                                  (labels != IGNORE_INDEX).sum())
            loss = loss + auxiliary
            self.statistics.append(statistics)
        return loss * self.scale


class InFlightStage(PipelineStage):
    """torch's PipelineStage that holds receive buffers for the micro batches in flight only.

    torch (2.13, pipelining/stage.py) allocates its receive buffers when a schedule first runs
    (`_prepare_forward_infra`, `_prepare_backward_infra`, again after each switch between
    training and evaluation): for each of the run's m micro batches one buffer for the activation
    the stage receives (every stage but the first) and one for the gradient of its output (every
    stage but the last), and keeps all 2·m for the stage's life, although its schedule never has
    more than a few micro batches between their forward and backward (1F1B: p - stage). For
    GPT-3 175B in 32 stages with 192 micro batches per run that is 36 GiB of a rank's memory.

    Here a buffer is made when its receive is posted (get_fwd_recv_ops, get_bwd_recv_ops) and
    the stage lets go of it once the forward (backward) of its micro batch has used it. A
    received activation then lives exactly as long as torch's fwd_cache keeps it as the input of
    the micro batch's backward, so forward buffers follow the schedule's in-flight count; a
    received gradient lives until its backward is done (one at a time). At set-up torch makes
    one buffer at a time, let go at once. In evaluation, where no backward takes a micro batch
    back, torch's fwd_cache would keep every micro batch's input and output until the next run:
    they are let go once the output is sent. On the last stage the losses of a run hold their
    graphs, and with them every received activation, until the run ends: each one's memory is
    released once its backward is done (measured: the last stage's peak rose by one micro
    batch's activation per micro batch before). The tensors, their shapes, dtypes and the
    autograd calls are torch's own, so the numbers are unchanged (tests/test_pipeline_training.py).

    A subclass (no copy of torch's code) because PipelineStage has no option for it. Upstream,
    `_PipelineStageBase` could make each `_RecvInfo` buffer in `_get_recv_ops` and drop it after
    `forward_one_chunk` / `backward_one_chunk` itself. Plain tensors only (no DTensor inputs,
    which hvdtrain does not send)."""

    def _prepare_forward_infra(self, num_microbatches, *args, **kwargs):
        # torch makes the receive infos of one micro batch (one buffer, not m); each micro batch
        # gets its own copy of them, without a buffer until its receive is posted.
        meta = super()._prepare_forward_infra(1, *args, **kwargs)
        one = self.args_recv_info[0]
        for chunk in range(num_microbatches):
            self.args_recv_info[chunk] = tuple(copy.copy(info) for info in one)
            self._let_go(self.args_recv_info[chunk])
        return meta

    def _create_grad_recv_info(self, act_send_info):
        infos = super()._create_grad_recv_info(act_send_info)
        self._let_go(infos)  # one micro batch's at a time: torch calls this once per micro batch
        return infos

    def get_fwd_recv_ops(self, fwd_chunk_id):
        self._make(self.args_recv_info[fwd_chunk_id])
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        output = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        self._let_go(self.args_recv_info[fwd_chunk_id])  # fwd_cache keeps it for the backward
        return output

    def get_fwd_send_ops(self, fwd_chunk_id):
        ops = super().get_fwd_send_ops(fwd_chunk_id)  # the ops hold the output until it is sent
        if not self.has_backward:  # evaluation: no backward will pop the micro batch
            self.fwd_cache.pop(fwd_chunk_id)
        return ops

    def get_bwd_recv_ops(self, bwd_chunk_id):
        if self.has_backward and not self.is_last:
            self._make(self.grad_recv_info[bwd_chunk_id])
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        last = self.has_backward and self.is_last and not self.is_first  # evaluation: no backward runs
        received = self.fwd_cache[bwd_chunk_id][1] if last else ()
        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)
        if self.has_backward and not self.is_last:
            self._let_go(self.grad_recv_info[bwd_chunk_id])
        # The last stage's schedule keeps each micro batch's loss until the run ends (torch's
        # _internal_losses), and a loss's graph keeps the activation it received (the leaf's
        # AccumulateGrad node holds it): m activations by the end of a run. After a full
        # backward (SCHEDULES have no other) its gradient has been taken (torch set .grad to
        # None) and nothing reads it again: its memory goes back now.
        for tensor in received if full_backward else ():
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.untyped_storage().resize_(0)

    def _make(self, infos):
        """A buffer for each received tensor of one micro batch, laid out as torch's own."""
        for info in infos:
            if not info.is_root_arg and info.buffer is None and info.tensor_meta is not None:
                meta = info.tensor_meta
                info.buffer = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=self.device)

    @staticmethod
    def _let_go(infos):
        for info in infos:
            if not info.is_root_arg:
                info.buffer = None


@dataclass
class Pipeline:
    """What run() needs: torch's schedule over this rank's PipelineStages, the layout, the loss."""
    schedule: object
    layout: Layout
    loss: TokenLoss
    n_microbatches: int


def build_schedule(stage: StageModule, layout: Layout, groups: Groups, name: str, n_microbatches: int,
                   loss_scale: float, device: torch.device) -> Pipeline:
    """PipelineStages for this rank's chunks and torch's schedule `name` (see SCHEDULES) over them.

    Shapes are inferred from the first batch (one extra forward and backward of its first micro
    batch, without touching gradients or the RNG), so every later batch in the same mode (training
    or evaluation) must have the same shape."""
    check_schedule(name, layout.stages, layout.stages_per_rank, n_microbatches)
    loss = TokenLoss(stage, loss_scale)
    stage_class = InFlightStage if switch("HVDTRAIN_STAGE") == "in-flight" else PipelineStage
    stages = [stage_class(chunk, s, layout.num_stages, device, group=groups.pipeline)
              for s, chunk in zip(layout.stage_ids, stage.chunks)]
    stage_arg = stages if name.lower() in INTERLEAVED else stages[0]  # multi- or single-stage class
    schedule = get_schedule_class(name)(stage_arg, n_microbatches=n_microbatches, loss_fn=loss, scale_grads=False)
    return Pipeline(schedule, layout, loss, n_microbatches)


def run(pipe: Pipeline, input_ids: torch.Tensor, labels: torch.Tensor, train: bool = True) -> torch.Tensor:
    """One pass of the schedule over a batch that it splits into its micro batches along dim 0.

    Every rank of a pipeline passes the same batch; the first stage reads input_ids, the last
    the labels. With train=True each micro batch's backward accumulates into .grad (Horovod's
    hooks fire during it); train=False runs forward and loss only (call stage.eval() first).
    Returns the sum of token losses of the batch on the last stage, 0 on the others."""
    layout = pipe.layout
    args = (input_ids,) if layout.is_first else ()
    losses = [] if layout.is_last else None
    pipe.loss.training, pipe.loss.statistics = train, []
    step = pipe.schedule.step if train else pipe.schedule.eval
    # torch.distributed: send/recv of activations (and gradients) along the pipeline
    step(*args, target=labels if layout.is_last else None, losses=losses, return_outputs=False)
    if not layout.is_last:
        return torch.zeros((), dtype=torch.float64, device=input_ids.device)
    return torch.stack([loss.detach() for loss in losses]).double().sum() / pipe.loss.scale


# ---------------------------------------------------------------- gradients after the backward

def broadcast_stage(stage: StageModule, layout: Layout, groups: Groups):
    """Copy the first copy's parameters and buffers to the other copies of this stage
    (hvd.broadcast_parameters works on the global set only)."""
    root = layout.stage_ranks(layout.stage)[0]  # a global rank, as Horovod wants
    # Horovod: broadcast within the stage's process set
    handles = [hvd.broadcast_async_(t, root, name=f"pipeline.broadcast.{name}", process_set=groups.process_set)
               for name, t in stage.state_dict().items()]
    for handle in handles:
        hvd.synchronize(handle)


def allreduce_tied_grads(stage: StageModule, groups: Groups):
    """Sum the gradients of tied copies between the first and last stage (Megatron's embedding
    group), after the data-parallel reduction, so both copies take the same optimizer step."""
    if groups.tied is None or not stage.tied:
        return
    for p in stage.tied.values():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=groups.tied)  # torch.distributed: allreduce (sum), first + last stage


def clip_grad_norm_(stage: StageModule, max_norm: float, groups: Groups, experts=None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over the whole model: the L2 norm of all stages' gradients
    (squares summed along the pipeline; the copies of a stage hold equal, reduced gradients; a
    tied weight counted once, on the first stage; with split layers, the squares of each rank's
    slices summed over its tensor-parallel group first; with split experts, `experts` = (this
    rank's expert weights, the sum over its expert group), theirs so), and every stage scaled
    by the same coefficient. Returns the total norm before clipping."""
    copies = set(stage.tied.values()) if stage.layout.is_last and not stage.layout.is_first else set()
    own_experts, sum_over_experts = experts or (set(), None)
    grads = [(p.grad, p in copies, p in own_experts) for p in stage.parameters() if p.grad is not None]

    def split(grad, expert: bool) -> bool:  # held by this rank only among the ranks of a group
        return expert or is_split(grad)

    def sum_over_split_group(squares):
        if groups.tensor is not None:
            # torch.distributed: allreduce (sum) over the tensor-parallel group
            dist.all_reduce(squares, group=groups.tensor.get_group())
        if sum_over_experts is not None:
            squares = sum_over_experts(squares)  # Horovod: allreduce (sum) over the expert group
        return squares

    def sum_along_pipeline(squares):
        dist.all_reduce(squares, group=groups.pipeline)  # torch.distributed: allreduce (sum) along the pipeline
        return squares
    return distributed.clip_split_grad_norm_(
        [local(g) for g, copy, expert in grads if not copy and not split(g, expert)],
        [local(g) for g, _, expert in grads if split(g, expert)],
        sum_over_split_group, max_norm, sum_along_pipeline, [g for g, copy, _ in grads if copy])
