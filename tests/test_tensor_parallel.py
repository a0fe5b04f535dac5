"""Tensor parallelism (parallel.tensor_parallel = t): each layer's attention and MLP matrices split
over t ranks with torch.distributed.tensor.parallel, through real horovodrun workers (Gloo, fp32,
dropout 0, clipping active). t=2 trains as one worker does (Llama with grouped-query attention,
BERT); t=2 x 2 copies (4 workers) too, and t=2 x 2 pipeline stages, also with activation
checkpointing, an interleaved schedule, compiled blocks and bf16 (make test-deep); each rank
holds its slices of the one-worker model, also with its slices sharded over the copies
(parallel.shard optimizer, gradients, full); a checkpoint written at t=2 resumes at t=1 and one
written at t=1 at t=2; the export is the whole model; fp16 skips a step on every rank of a group when one slice finds inf. (Bad input: test_errors.)"""
import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import (WORKERS, assert_same_losses, assert_same_params, horovodrun, load_params, read_metrics,
                     step_losses, train_fully_sharded_with_a_resume, train_sharded_across_layouts,
                     train_workers)
from test_pipeline import unsplit_fp16_skips

pytestmark = pytest.mark.workers

LLAMA = {"model": {"arch": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 32, "d_ff": 64},
         "train": {"global_batch_size": 8, "max_steps": 8, "grad_clip": 0.5}, "checkpoint": {"every": 2}}
GPT2 = {"train": {"global_batch_size": 8, "max_steps": 8, "grad_clip": 0.5}}  # tests' TINY: 2 heads
BERT = {"model": {"arch": "bert", "n_layer": 2, "n_head": 2, "d_model": 32},
        "train": {"global_batch_size": 8, "max_steps": 8, "grad_clip": 0.5}}
MODERNBERT = {"model": {"arch": "modernbert", "n_layer": 3, "n_head": 2, "d_model": 32, "local_attention": 8},
              "train": {"global_batch_size": 8, "max_steps": 8, "grad_clip": 0.5}}


def exported(run) -> dict:
    return load_file(str(run / "hf" / "model.safetensors"))


def assert_trains_as_one_worker(one, split):
    """The same per-step losses and gradient norms (clipped), and the same exported weights
    within 5e-5: AdamW (lr 1e-2) divides each gradient by its own running root mean square, so
    where a gradient is near zero the split and the whole sums' rounding moves the weight by a
    visible fraction of a step (1.3e-5 seen in one element of Llama's gate_proj on an AMD EPYC,
    under 1e-5 on the CPUs before it; 2.4e-5 for a 4-layer GPT-2 at t=2 x p=2).
    GPT-2's attention bias within 1e-4: its key part gets no gradient in exact arithmetic
    (softmax ignores what it adds to every score of a query), so AdamW's steps there are the
    two computations' rounding alone (1.6e-5 seen)."""
    assert_same_losses(step_losses(one), step_losses(split), min_steps=8)
    for a, b in zip(read_metrics(one)[0], read_metrics(split)[0]):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4) and a["grad_norm"] > 0.5  # clipped
    whole, joined = exported(one), exported(split)
    assert whole.keys() == joined.keys()
    for name in whole:
        atol = 1e-4 if name.endswith("attn.c_attn.bias") else 5e-5
        torch.testing.assert_close(joined[name], whole[name], rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("family", [GPT2, LLAMA, BERT, pytest.param(MODERNBERT, marks=pytest.mark.deep)],
                         ids=["gpt2", "llama", "bert", "modernbert"])
def test_two_slices_train_as_one_worker(tmp_path, tiny_config, family):
    """np=1 against np=2 with t=2: per-step losses, gradient norms (clipped) and the exported
    weights agree (GPT-2's: transformers loads the export and gives the one worker's logits);
    each rank holds its half of every split weight: column-wise the rows, row-wise the columns."""
    config = tiny_config(family)
    one, split = tmp_path / "np1", tmp_path / "t2"
    train_workers(1, config, f"out_dir={one}")
    train_workers(2, config, f"out_dir={split}", "parallel.tensor_parallel=2")
    assert_trains_as_one_worker(one, split)
    if family is GPT2:  # c_attn saved as transformers keeps it: query, key, value side by side, [in, out]
        from transformers import AutoModelForCausalLM
        ids = torch.arange(16).reshape(1, 16)
        with torch.no_grad():
            logits = [AutoModelForCausalLM.from_pretrained(run / "hf").eval()(ids).logits for run in (one, split)]
        torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-4)
    if family is LLAMA:
        whole = load_params(one, 0)
        for rank in (0, 1):
            mine = load_params(split, rank)
            up, down = "model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.down_proj.weight"
            torch.testing.assert_close(mine[up], whole[up][32 * rank:32 * (rank + 1)], rtol=0, atol=5e-5)
            torch.testing.assert_close(mine[down], whole[down][:, 32 * rank:32 * (rank + 1)], rtol=0, atol=5e-5)


@pytest.mark.deep
def test_two_slices_by_two_copies_train_as_one_worker(tmp_path, tiny_config):
    """4 workers, t=2 x 2 data-parallel copies: ranks 0 and 2 (1 and 3) hold the same slices and
    reduce their gradients in a process set of their own; the losses and export are one worker's."""
    config = tiny_config(LLAMA)
    one, split = tmp_path / "np1", tmp_path / "t2np4"
    train_workers(1, config, f"out_dir={one}")
    train_workers(4, config, f"out_dir={split}", "parallel.tensor_parallel=2", timeout=600)
    assert_trains_as_one_worker(one, split)
    assert_same_params(load_params(split, 0), load_params(split, 2))
    assert_same_params(load_params(split, 1), load_params(split, 3))


@pytest.mark.parametrize("family", [GPT2, pytest.param(LLAMA, marks=pytest.mark.deep)], ids=["gpt2", "llama"])
def test_two_slices_by_two_stages_train_as_one_worker_across_layouts(tmp_path, tiny_config, family):
    """4 workers, t=2 x p=2: each pipeline stage's layers split over a tensor-parallel group of
    neighbours (ranks 0 and 1 hold stage 0, 2 and 3 stage 1; GPT-2 ties its embedding between
    the first and the last stage). To step 4 at t=2 x p=2, its checkpoint (a part per stage,
    each gathered whole over its group) read at t=1 by 2 data-parallel workers to step 6, that
    one's at t=2 x p=2 to 8: the one worker's losses, gradient norms (clipped) and export."""
    config = tiny_config({**family, "checkpoint": {"every": 2}})
    one, moved = tmp_path / "np1", tmp_path / "moved"
    train_workers(1, config, f"out_dir={one}")
    cube = ("parallel.tensor_parallel=2", "parallel.pipeline_stages=2")
    train_workers(4, config, f"out_dir={moved}", *cube, "train.stop_at_step=4", timeout=600)
    assert (moved / "checkpoints" / "step_00000004" / "model-00002-of-00002.safetensors").exists()
    train_workers(2, config, f"out_dir={moved}", "train.stop_at_step=6")
    train_workers(4, config, f"out_dir={moved}", *cube, timeout=600)
    assert_trains_as_one_worker(one, moved)


@pytest.mark.deep
@pytest.mark.parametrize("features,layers", [(("model.activation_checkpointing=true",), 2),
                                             (("parallel.schedule=interleaved1f1b", "parallel.stages_per_rank=2"), 4),
                                             (("model.compile=true",), 2)],
                         ids=["activation-checkpointing", "interleaved", "compiled"])
def test_two_slices_by_two_stages_keep_the_step_s_features(tmp_path, tiny_config, features, layers):
    """4 workers, t=2 x p=2 with activation checkpointing (each split layer run again in
    backward), an interleaved schedule (two stages per rank of a 4-layer model, each split) or
    compiled blocks (torch.compile of each split layer): one worker's losses, gradient norms
    (clipped) and export, none of which these change (the 4-layer model's interleaved run
    differs by 2e-5 from a plain t=2 x p=2 run, which differs from one worker by 2.4e-5)."""
    config = tiny_config({**GPT2, "model": {"n_layer": layers}})
    one, cube = tmp_path / "np1", tmp_path / "cube"
    train_workers(1, config, f"out_dir={one}")
    train_workers(4, config, f"out_dir={cube}", "parallel.tensor_parallel=2", "parallel.pipeline_stages=2",
                  *features, timeout=900)
    assert_trains_as_one_worker(one, cube)


@pytest.mark.deep
def test_bf16_two_slices_by_two_stages_follow_one_worker(tmp_path, tiny_config):
    """4 workers, t=2 x p=2 in bf16 (autocast; fp32 weights, gradients and optimizer state):
    one worker's bf16 losses and gradient norms within bf16's rounding of the activations (seen:
    4e-4 and 8e-3 relative)."""
    config = tiny_config({**GPT2, "train": {**GPT2["train"], "precision": "bf16"}})
    one, cube = tmp_path / "np1", tmp_path / "cube"
    train_workers(1, config, f"out_dir={one}")
    train_workers(4, config, f"out_dir={cube}", "parallel.tensor_parallel=2", "parallel.pipeline_stages=2",
                  timeout=600)
    for a, b in zip(read_metrics(one)[0], read_metrics(cube)[0], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=3e-3)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=3e-2) and a["grad_norm"] > 0.5  # clipped
    assert len(read_metrics(cube)[0]) == 8


@pytest.mark.deep  # make test: t=2 x p=2 -> t=1 -> t=2 x p=2 in the test across layouts above
def test_a_checkpoint_resumes_at_another_tensor_parallel_size(tmp_path, tiny_config):
    """2 workers: stop at step 4 with t=2, go on to 6 with t=1, then to 8 with t=2 again: the
    same losses and weights as a straight t=1 run on 2 workers (Llama: its key/value heads split)."""
    config = tiny_config(LLAMA)
    straight, moved = tmp_path / "straight", tmp_path / "moved"
    train_workers(2, config, f"out_dir={straight}")
    train_workers(2, config, f"out_dir={moved}", "parallel.tensor_parallel=2", "train.stop_at_step=4")
    train_workers(2, config, f"out_dir={moved}", "train.stop_at_step=6")
    train_workers(2, config, f"out_dir={moved}", "parallel.tensor_parallel=2")
    assert_same_losses(step_losses(straight), step_losses(moved), min_steps=8)
    assert_same_params(exported(straight), exported(moved), atol=5e-5)  # see assert_trains_as_one_worker


def test_sharded_optimizer_over_the_copies_of_each_slice(tmp_path, tiny_config):
    """t=2 x 2 copies (4 workers) with parallel.shard: each rank's slices sharded over the two
    copies holding them (ZeRO-1 to step 4, its checkpoint gathered whole; 2 workers unsplit to 6;
    ZeRO-2 to 8, each rank reading its slice of its slices): the one worker's losses, gradient
    norms (clipped) and weights."""
    config = tiny_config(LLAMA)
    one, moved = tmp_path / "np1", tmp_path / "moved"
    train_workers(1, config, f"out_dir={one}")
    train_sharded_across_layouts(config, moved, "parallel.tensor_parallel=2")
    assert_trains_as_one_worker(one, moved)


@pytest.mark.deep
def test_fully_sharded_weights_over_the_copies_of_each_slice(tmp_path, tiny_config):
    """t=2 x 2 copies (4 workers) with parallel.shard=full: each rank's slices of the weights
    themselves sharded over the two copies holding them, gathered unit by unit as forward and
    backward reach it (to step 4, its checkpoint gathered whole, then resumed at the same layout
    to 8): the one worker's losses, gradient norms (clipped) and weights."""
    config = tiny_config(LLAMA)
    one, split = tmp_path / "np1", tmp_path / "split"
    train_workers(1, config, f"out_dir={one}")
    train_fully_sharded_with_a_resume(config, split, "parallel.tensor_parallel=2")
    assert_trains_as_one_worker(one, split)


@pytest.mark.deep
def test_sharded_optimizer_over_the_copies_of_each_stage_slice(tmp_path, tiny_config):
    """8 workers, t=2 x p=2 x 2 copies with parallel.shard: each rank's slices of its stage
    sharded over the two copies holding them (ZeRO-1 to step 4, each stage's checkpoint part
    gathered whole over its copies and its group; 2 workers unsplit to 6; ZeRO-2 to 8, each rank
    reading its slice of its slices): the one worker's losses, gradient norms (clipped) and
    weights."""
    config = tiny_config({**GPT2, "train": {**GPT2["train"], "global_batch_size": 16}})  # 2 micro batches a copy
    one, moved = tmp_path / "np1", tmp_path / "moved"
    train_workers(1, config, f"out_dir={one}")
    train_sharded_across_layouts(config, moved, "parallel.tensor_parallel=2", "parallel.pipeline_stages=2",
                                 workers=8)
    assert_trains_as_one_worker(one, moved)


def test_fp16_a_slice_s_inf_skips_the_step_on_every_rank_of_the_group(tmp_path):
    """fp16 through the step engine (TensorParallelStep) with the fused AdamW of a GPU: the grad
    scaler unscales the split gradients as their local tensors (tensor_parallel.LocalGradScaler);
    when only rank 1's slice holds inf, rank 0 skips the step too, and both scalers back off
    and count as the whole model's one scaler does (tests/workers/tensor_fp16_skips.py)."""
    proc = horovodrun(2, [WORKERS / "tensor_fp16_skips.py", tmp_path])
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = unsplit_fp16_skips()
    assert [s["stepped"] for s in expected] == [True, True, False, True]
    for rank in (0, 1):
        states = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert states == expected


@pytest.mark.deep
def test_fp16_sharded_an_inf_in_one_rank_s_slices_skips_the_step_on_both(tmp_path, tiny_config):
    """t=2 on 2 workers with parallel.shard=gradients (each rank's slices sharded over a copy of
    one): rank 0's own slice gets an inf in step 3 (tests/workers/sharded_overflow.py); rank 1
    skips that step too only if the flag is shared over the tensor group, and the whole weights
    stay bitwise equal on both ranks only if it does."""
    config = tiny_config({**GPT2, "train": {**GPT2["train"], "precision": "fp16"}})
    out = tmp_path / "run"
    proc = horovodrun(2, [WORKERS / "sharded_overflow.py", config, f"out_dir={out}", "parallel.shard=gradients",
                          "parallel.tensor_parallel=2"], env={"HVDTRAIN_TEST_INF_STEP": "2"}, timeout=200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert [r["skipped_steps"] for r in read_metrics(out)[0]] == [0, 0, 1, 0, 0, 0, 0, 0]
    ranks = load_params(out, 0), load_params(out, 1)
    for name in ("transformer.wte.weight", "transformer.ln_f.weight", "transformer.h.0.ln_1.bias"):
        assert torch.equal(ranks[0][name], ranks[1][name]), name


@pytest.mark.deep
def test_fp16_two_slices_train_as_one_worker(tmp_path, tiny_config):
    """GPT-2 in fp16 (autocast, dynamic loss scale): t=2 follows one worker's losses and gradient
    norms within fp16's rounding (seen: 3e-5 and 1e-3 relative); no step overflows here (the
    skips are the tests above)."""
    config = tiny_config({**GPT2, "train": {**GPT2["train"], "precision": "fp16"}})
    one, split = tmp_path / "np1", tmp_path / "t2"
    train_workers(1, config, f"out_dir={one}")
    train_workers(2, config, f"out_dir={split}", "parallel.tensor_parallel=2")
    for a, b in zip(read_metrics(one)[0], read_metrics(split)[0], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-2) and a["grad_norm"] > 0.5  # clipped
    assert len(read_metrics(split)[0]) == 8
