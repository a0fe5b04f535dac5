"""Test worker for hvdtrain/parallel/pipeline.py: a few AdamW steps of a tiny GPT-2 or BERT on fixed
synthetic batches, with or without pipeline stages, under horovodrun (or alone as one worker).

    pipeline_step.py OUT_DIR --stages P CASE [CASE ...]

With --stages 1 a CASE is an arch (gpt2, bert) and the unsplit model trains the plain way,
Horovod data parallelism over all workers: the reference. With P > 1 a CASE is
ARCH-SCHEDULE-REDUCE, e.g. gpt2-1f1b-hooks: the model is split into P stages (2 per rank for
interleaved1f1b), gradients are reduced within each stage's process set by
hvd.DistributedOptimizer's hooks during the pipeline's backward (`hooks`) or by one grouped
allreduce after it (`after`). Both ways train on the same global batches, sum token losses,
normalise by the step's target tokens, clip to one global norm and step: the reference written
out here, the pipelined cases through the training loop's step engine (hvdtrain.training.step_engine).

Each case writes OUT_DIR/CASE/: result.json from rank 0 (per-step loss and gradient norm
before clipping, an evaluation loss at the end) and params_rank{R}.safetensors (the rank's
parameters and buffers under the Hugging Face names)."""
import argparse
import json
from pathlib import Path

import horovod.torch as hvd
import torch
from safetensors.torch import save_file

from hvdtrain.parallel import distributed, parallel_dims, pipeline
from hvdtrain.config import Config, ModelConfig, ParallelConfig
from hvdtrain.models.common import IGNORE_INDEX, Vocab, build_model, logits_and_labels
from hvdtrain.training.run_guards import NonFiniteGuard
from hvdtrain.training.step_engine import PipelinedStep, autocast_for
from hvdtrain.observe.step_timer import StepTimer

N_LAYER, SEQ, VOCAB, MASK_ID = 4, 16, 128, 4
GLOBAL_BATCH, MICROBATCHES, STEPS = 8, 4, 4
LR, MAX_NORM, SEED = 1e-3, 0.5, 7
# fp16 skips (fp16_skips): a growth interval the forced skip falls inside of
FP16_SCALER = {"init_scale": 1024.0, "growth_interval": 3}


def global_batch(arch: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's whole batch, the same on every rank: GPT predicts the next token, BERT ~15%
    masked tokens (at least one per sample)."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(MASK_ID + 1, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    if arch == "gpt2":
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[:, :-1] = ids[:, 1:]
        return ids, labels
    masked = torch.rand(ids.shape, generator=g) < 0.15
    masked[:, step % SEQ] = True
    return torch.where(masked, MASK_ID, ids), torch.where(masked, ids, IGNORE_INDEX)


def my_slice(t: torch.Tensor, layout: parallel_dims.Layout) -> torch.Tensor:
    rows = GLOBAL_BATCH // layout.dp
    return t[layout.dp_rank * rows:(layout.dp_rank + 1) * rows]


def new_model(arch: str):
    torch.manual_seed(SEED)
    cfg = ModelConfig(arch=arch, n_layer=N_LAYER, n_head=2, d_model=32, dropout=0.0)
    return build_model(cfg, Vocab(size=VOCAB, pad_id=0), SEQ)


def loss_sum(model, ids, labels, scale: float, backward: bool) -> torch.Tensor:
    """The reference: micro batch by micro batch, as the pipeline splits them."""
    total = torch.zeros((), dtype=torch.float64)
    for mb_ids, mb_labels in zip(ids.chunk(MICROBATCHES), labels.chunk(MICROBATCHES)):
        logits, targets = logits_and_labels(model, {"input_ids": mb_ids, "labels": mb_labels})
        loss = torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX,
                                                 reduction="sum")
        if backward:
            (loss * scale).backward()
        total += loss.detach().double()
    return total


def train_reference(arch: str, layout: parallel_dims.Layout) -> tuple[dict, torch.nn.Module]:
    model = new_model(arch)
    optimizer = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR),
                                         named_parameters=model.named_parameters(),
                                         backward_passes_per_step=MICROBATCHES)
    result = {"losses": [], "norms": []}
    for step in range(STEPS):
        ids, labels = global_batch(arch, step)
        targets = int((labels != IGNORE_INDEX).sum())
        local = loss_sum(model, my_slice(ids, layout), my_slice(labels, layout), 1.0 / targets, backward=True)
        optimizer.synchronize()
        for p in model.parameters():
            p.grad.mul_(layout.dp)  # Average divided by the copies; the scale already divided by the targets
        result["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        with optimizer.skip_synchronize():
            optimizer.step()
        optimizer.zero_grad()
        result["losses"].append(hvd.allreduce(local, op=hvd.Sum, name="loss").item() / targets)
    model.eval()
    ids, labels = global_batch(arch, 0)
    with torch.no_grad():
        local = loss_sum(model, my_slice(ids, layout), my_slice(labels, layout), 1.0, backward=False)
    result["eval_loss"] = hvd.allreduce(local, op=hvd.Sum, name="eval").item() / int((labels != IGNORE_INDEX).sum())
    return result, model


def train_pipelined(case: str, layout: parallel_dims.Layout, groups: parallel_dims.Groups) -> tuple[dict, torch.nn.Module]:
    """The training loop's own step engine (hvdtrain.training.step_engine.PipelinedStep), step by step."""
    arch, schedule, reduce = case.split("-")
    per_rank = 2 if schedule == "interleaved1f1b" else 1
    layout = parallel_dims.Layout(layout.stages, layout.dp, layout.stage, layout.dp_rank, per_rank)
    stage = pipeline.split_model(new_model(arch), layout, pipeline.stage_bounds(N_LAYER, layout.stages, per_rank))
    pipe = pipeline.build_schedule(stage, layout, groups, schedule, MICROBATCHES, 1.0, torch.device("cpu"))
    optimizer = torch.optim.AdamW(stage.parameters(), lr=LR)
    if reduce == "hooks":
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=stage.named_parameters(),
                                             process_set=groups.process_set,
                                             backward_passes_per_step=MICROBATCHES)
    pipeline.broadcast_stage(stage, layout, groups)
    cfg = Config(parallel=ParallelConfig(pipeline_stages=layout.stages, schedule=schedule))
    normalizer = distributed.TokenNormalizer("average", layout.dp, GLOBAL_BATCH // layout.dp * SEQ)
    engine = PipelinedStep(stage, optimizer, torch.amp.GradScaler("cpu", enabled=False), normalizer,
                           autocast_for(torch.device("cpu"), "fp32"), torch.device("cpu"), layout, groups, pipe,
                           reduce == "after", cfg)
    timer, guard = StepTimer(torch.device("cpu"), enabled=False), NonFiniteGuard(torch.device("cpu"), 10)
    totals = distributed.StepTotals(layout.stages)
    result = {"losses": [], "norms": [], "reduced_in_backward": reduce == "hooks"}
    for step in range(STEPS):
        ids, labels = global_batch(arch, step)
        ids, labels = my_slice(ids, layout), my_slice(labels, layout)
        totals.start(int((labels != IGNORE_INDEX).sum()))
        local = engine.forward_backward([{"input_ids": i, "labels": lab}
                                         for i, lab in zip(ids.chunk(MICROBATCHES), labels.chunk(MICROBATCHES))], timer)
        if reduce == "hooks":
            # Horovod's hooks must have started every allreduce while the schedule's backward ran
            started = [handle is not None for handle, _ in optimizer._handles.values()]
            result["reduced_in_backward"] &= len(started) == len(optimizer._requires_update) and all(started)
        engine.reduce_gradients()
        targets, _ = totals.wait()
        engine.normalize(targets)
        norm = engine.clip_gradients(MAX_NORM)
        result["norms"].append(norm.item())
        engine.optimizer_step(guard, norm)
        result["losses"].append(hvd.allreduce(local.double(), op=hvd.Sum, name="loss").item() / targets)
    result["scaler"] = fp16_skips(stage, layout, groups)
    result["after_reduction"] = after_reduction(layout, groups)
    ids, labels = global_batch(arch, 0)
    loader = [{"input_ids": i, "labels": lab} for i, lab in zip(my_slice(ids, layout).chunk(MICROBATCHES),
                                                           my_slice(labels, layout).chunk(MICROBATCHES))]
    result["eval_loss"] = engine.evaluate(loader)["eval_loss"]
    return result, stage


def fp16_skips(stage, layout: parallel_dims.Layout, groups: parallel_dims.Groups, steps: int = 4, inf_step: int = 2) -> list:
    """`steps` steps of a GradScaler (on copies of the stage's parameters, so the trained
    ones stay as they are) where only the last stage finds inf, in step `inf_step`, stepped as
    the training loop does: share_found_inf, then NonFiniteGuard.scaler_step. Per step: this
    rank's scaler state, whether its parameters changed, and the guard's streak."""
    params = [p.detach().clone().requires_grad_() for p in stage.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", **FP16_SCALER)
    guard = NonFiniteGuard(torch.device("cpu"), max_bad_steps=10)
    states = []
    for step in range(steps):
        weight = float("inf") if step == inf_step and layout.is_last else 1.0
        scaler.scale(sum(p.sum() for p in params[1:]) + (params[0] * weight).sum()).backward()
        before = [p.detach().clone() for p in params]
        scaler.unscale_(optimizer)
        distributed.share_found_inf(scaler, optimizer, groups.pipeline)
        guard.scaler_step(scaler, optimizer)
        states.append({**scaler.state_dict(), "stepped": any(not torch.equal(b, p) for b, p in zip(before, params)),
                       "in_a_row": guard.in_a_row.item()})
        optimizer.zero_grad()
    return states


def after_reduction(layout: parallel_dims.Layout, groups: parallel_dims.Groups) -> dict:
    """distributed.allreduce_grads among the copies of this stage of gradients that differ by copy,
    with horovod.compression and gradient_predivide_factor as the training loop passes them.
    `thirds` round in fp16; `big` (40000 a copy) overflows an fp16 sum of two copies."""
    def reduced(values, **options) -> list[float]:
        p = torch.nn.Parameter(torch.zeros(len(values)))
        p.grad = torch.tensor(values)
        distributed.allreduce_grads([p], groups.process_set, "pipeline.grads", hvd.Average, **options)
        return p.grad.tolist()

    thirds, big, fp16 = [(1 + layout.dp_rank) / 3, 1e-3 * (1 + layout.dp_rank)], [40000.0], hvd.Compression.fp16
    return {"none": reduced(thirds), "fp16": reduced(thirds, compression=fp16),
            "predivided": reduced(thirds, gradient_predivide_factor=4.0),
            "fp16_big": reduced(big, compression=fp16),
            "fp16_big_predivided": reduced(big, compression=fp16, gradient_predivide_factor=2.0)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("cases", nargs="+")
    args = parser.parse_args()

    hvd.init(process_sets="dynamic")
    layout = parallel_dims.layout_for(hvd.rank(), hvd.size(), args.stages)
    groups = parallel_dims.open_groups(layout, "gloo") if args.stages > 1 else None
    for case in args.cases:
        if groups is None:
            result, module = train_reference(case, layout)
        else:
            result, module = train_pipelined(case, layout, groups)
        out = args.out_dir / case
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().clone() for k, v in module.state_dict().items()}
        save_file(state, str(out / f"params_rank{hvd.rank()}.safetensors"))
        if hvd.rank() == 0:
            (out / "result.json").write_text(json.dumps(result))
    if groups is not None:
        groups.close()


if __name__ == "__main__":
    main()
