"""Pipeline stages with Horovod data parallelism (hvdtrain/parallel/pipeline.py).

The worker tests train a tiny GPT-2 and BERT for a few AdamW steps on fixed synthetic batches
(tests/workers/pipeline_step.py) split into 2 pipeline stages, and compare with the unsplit
model trained the plain way on the same global batches: per-step losses, gradient norms before
clipping and an evaluation loss within 1e-5 relative, final parameters within 1e-5. Each
horovodrun launch runs several cases and is shared by the tests that read it."""
import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from helpers import RTOL, WORKERS, horovodrun, run_cmd
from hvdtrain.parallel import parallel_dims, pipeline
from hvdtrain.config import ModelConfig
from hvdtrain.errors import UserError
from hvdtrain.models.common import Vocab, build_model, head_inputs, token_loss_sum

WORKER = WORKERS / "pipeline_step.py"
# p=2 x dp=1 cases: ARCH-SCHEDULE-REDUCE (see the worker)
TWO_STAGES = ["gpt2-gpipe-hooks", "gpt2-1f1b-hooks", "bert-gpipe-hooks", "bert-1f1b-hooks",
              "gpt2-interleaved1f1b-hooks", "bert-interleaved1f1b-after"]
# p=2 x dp=2 cases, against dp=2 without pipeline
TWO_BY_TWO = ["gpt2-1f1b-hooks", "gpt2-gpipe-after"]
# (embedding on the first stage, its tied copy on the last)
TIED = {"gpt2": ("transformer.wte.weight", "lm_head.weight"),
        "bert": ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"),
        "llama": ("model.embed_tokens.weight", "lm_head.weight"),
        "modernbert": ("model.embeddings.tok_embeddings.weight", "decoder.weight")}
PROJECTION = {arch: output.removesuffix(".weight") for arch, (_, output) in TIED.items()}  # the output embeddings


def launch(np: int, out_dir, stages: int, cases: list[str]):
    args = [WORKER, out_dir, "--stages", stages, *cases]
    proc = horovodrun(np, args) if np > 1 else run_cmd([sys.executable, *args])
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return out_dir


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory):
    return launch(1, tmp_path_factory.mktemp("one_worker"), 1, ["gpt2", "bert"])


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory):
    return launch(2, tmp_path_factory.mktemp("two_stages"), 2, TWO_STAGES)


@pytest.fixture(scope="module")
def two_copies(tmp_path_factory):
    return launch(2, tmp_path_factory.mktemp("two_copies"), 1, ["gpt2"])


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory):
    return launch(4, tmp_path_factory.mktemp("two_by_two"), 2, TWO_BY_TWO)


def read_case(case_dir) -> tuple[dict, dict]:
    """(rank 0's result, the whole model's parameters merged from every rank's file).
    Copies of a stage on different ranks must be bitwise equal."""
    params = {}
    for path in sorted(case_dir.glob("params_rank*.safetensors")):
        for name, value in load_file(str(path)).items():
            assert name not in params or torch.equal(params[name], value), f"copies differ: {name} in {path.name}"
            params[name] = value
    return json.loads((case_dir / "result.json").read_text()), params


def assert_same_training(pipelined: tuple[dict, dict], reference: tuple[dict, dict]):
    (result, params), (ref_result, ref_params) = pipelined, reference
    for key in ("losses", "norms"):
        assert result[key] == pytest.approx(ref_result[key], rel=RTOL), key
    assert result["eval_loss"] == pytest.approx(ref_result["eval_loss"], rel=RTOL)
    assert max(ref_result["norms"]) > 0.5, "clipping (max norm 0.5) should have been active"
    assert params.keys() == ref_params.keys()  # every parameter under its original name
    for name in params:
        assert torch.allclose(params[name], ref_params[name], rtol=0, atol=1e-5), name


@pytest.mark.workers
@pytest.mark.parametrize("case", TWO_STAGES)
def test_two_stages_train_like_one_worker(case, two_stages, one_worker):
    arch, _, reduce = case.split("-")
    pipelined = read_case(two_stages / case)
    assert_same_training(pipelined, read_case(one_worker / arch))
    assert pipelined[0]["reduced_in_backward"] == (reduce == "hooks")


@pytest.mark.workers
@pytest.mark.parametrize("case", TWO_BY_TWO)
def test_two_stages_by_two_copies_train_like_two_copies(case, two_by_two, two_copies):
    pipelined = read_case(two_by_two / case)
    assert_same_training(pipelined, read_case(two_copies / "gpt2"))
    assert pipelined[0]["reduced_in_backward"] == case.endswith("hooks")


@pytest.mark.workers
def test_the_reduction_after_the_pipeline_applies_compression_and_predivide(two_by_two):
    """Two copies of each stage send [1/3, 1e-3] and [2/3, 2e-3] (then 40000 each): the average is
    [0.5, 1.5e-3]. fp16 compression rounds it (and overflows the sum of 80000, unless predivided
    by 2); a predivide factor gives the same average."""
    result, _ = read_case(two_by_two / "gpt2-gpipe-after")
    reduced = result["after_reduction"]
    assert reduced["none"] == pytest.approx([0.5, 1.5e-3], rel=1e-6)
    assert reduced["fp16"] != reduced["none"] and reduced["fp16"] == pytest.approx([0.5, 1.5e-3], rel=1e-3)
    assert reduced["predivided"] == pytest.approx(reduced["none"], rel=1e-6)
    assert reduced["fp16_big"] == [float("inf")] and reduced["fp16_big_predivided"] == [40000.0]


def unsplit_fp16_skips(steps: int = 4, inf_step: int = 2) -> list:
    """What the one GradScaler of the unsplit model does in the steps of the worker's fp16_skips."""
    from workers.pipeline_step import FP16_SCALER
    p = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", **FP16_SCALER)
    states, in_a_row = [], 0
    for step in range(steps):
        weights = torch.ones(3)
        if step == inf_step:
            weights[0] = float("inf")
        scaler.scale((p * weights).sum()).backward()
        before = p.detach().clone()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        in_a_row = in_a_row + 1 if step == inf_step else 0
        states.append({**scaler.state_dict(), "stepped": not torch.equal(before, p.detach()), "in_a_row": in_a_row})
        optimizer.zero_grad()
    return states


@pytest.mark.workers
@pytest.mark.parametrize("case", TWO_BY_TWO)
def test_fp16_inf_on_the_last_stage_skips_every_stage_as_the_unsplit_scaler_does(case, two_by_two):
    """Rank 0 (first stage) found no inf itself: it skips the step, counts it and backs off its
    scale, and its growth count restarts, so the scale grows back when the unsplit one does."""
    result, _ = read_case(two_by_two / case)
    expected = unsplit_fp16_skips()
    assert [s["stepped"] for s in expected] == [True, True, False, True]
    assert expected[2]["_growth_tracker"] == 0 and expected[2]["scale"] == 512.0  # backed off, count restarted
    assert result["scaler"] == expected


@pytest.mark.workers
@pytest.mark.parametrize("case", TWO_STAGES)
def test_tied_copies_stay_bitwise_equal(case, two_stages):
    embedding, copy = TIED[case.split("-")[0]]
    _, params = read_case(two_stages / case)
    assert torch.equal(params[embedding], params[copy])


# ---------------------------------------------------------------- without workers

def tiny(arch: str, n_layer: int = 4):
    torch.manual_seed(0)
    return build_model(ModelConfig(arch=arch, n_layer=n_layer, n_head=2, d_model=32, dropout=0.0),
                       Vocab(size=100, pad_id=0), 16)


@pytest.mark.parametrize("arch", ["gpt2", "bert", "llama", "modernbert"])
@pytest.mark.parametrize("stages,per_rank", [(2, 1), (2, 2), (4, 1)])
def test_stages_chained_compute_the_whole_model(arch, stages, per_rank):
    """Running every rank's chunks in stage order gives the unsplit model's head inputs and loss (to fp32
    rounding: the stages call the blocks themselves, without the whole model's mask handling,
    which may pick other attention kernels; Llama's and ModernBERT's stages each compute the
    rotary embeddings, ModernBERT's also the local attention masks), and the stages' state dicts together are the whole
    model's, under the same names."""
    whole = tiny(arch)
    bounds = pipeline.stage_bounds(4, stages, per_rank)
    parts = [pipeline.split_model(tiny(arch), parallel_dims.Layout(stages, 1, s, 0, per_rank), bounds)
             for s in range(stages)]
    chunks = sorted((s, chunk) for part in parts for s, chunk in zip(part.layout.stage_ids, part.chunks))
    ids = torch.randint(5, 100, (2, 16))
    labels = torch.where(torch.rand(ids.shape) < 0.3, ids, -100)
    labels[0, 0] = ids[0, 0]
    hidden = ids
    for _, chunk in chunks:
        hidden = chunk(hidden)
    features, picked = parts[-1].head_inputs(hidden, labels)
    expected, expected_labels = head_inputs(whole, {"input_ids": ids, "labels": labels})
    torch.testing.assert_close(features, expected, rtol=1e-5, atol=1e-6)  # fp32; O(1) values
    assert torch.equal(picked, expected_labels)  # the same positions picked
    assert parts[-1].output_projection is parts[-1].get_submodule(PROJECTION[arch])
    loss = pipeline.TokenLoss(parts[-1], 1.0)(hidden, labels)  # in chunks, as the whole model's
    torch.testing.assert_close(loss, token_loss_sum(whole, {"input_ids": ids, "labels": labels}), rtol=1e-5, atol=0)

    names = [name for part in parts for name in part.state_dict()]
    assert sorted(names) == sorted(whole.state_dict())
    tied = [sorted(pipeline.tied_parameters(part)) for part in parts]
    assert tied[0] == [TIED[arch][0]] and tied[-1] == [TIED[arch][1]] and all(t == [] for t in tied[1:-1])


def test_one_stage_keeps_the_tie():
    stage = pipeline.split_model(tiny("gpt2"), parallel_dims.Layout(1, 1, 0, 0), [0, 4])
    assert pipeline.tied_parameters(stage) == {}
    assert stage.lm_head.weight is stage.transformer.wte.weight


def test_layout_ranks():
    layout = parallel_dims.layout_for(rank=5, world_size=8, stages=2)
    assert (layout.stage, layout.dp_rank, layout.dp, layout.rank) == (1, 1, 4, 5)
    assert layout.stage_ranks(1) == [4, 5, 6, 7] and layout.pipeline_ranks(1) == [1, 5]
    assert parallel_dims.Layout(2, 1, 1, 0, stages_per_rank=3).stage_ids == [1, 3, 5]
    with pytest.raises(UserError, match="parallel.pipeline_stages=3 does not divide the 8 workers"):
        parallel_dims.layout_for(0, 8, 3)


def test_layout_ranks_with_split_layers_neighbours_in_a_tensor_parallel_group():
    """pp x dp x tp, tp innermost: rank = (stage * dp + dp_rank) * tp + tp_rank."""
    layout = parallel_dims.layout_for(rank=5, world_size=8, stages=2, tp=2)
    assert (layout.stage, layout.dp_rank, layout.tp_rank, layout.dp, layout.rank) == (1, 0, 1, 2, 5)
    assert layout.grid.group("tp", 5) == [4, 5]
    # the copies and the pipeline hold this rank's slices (tp_rank 1)
    assert layout.stage_ranks(1) == [5, 7] and layout.pipeline_ranks(1) == [3, 7]
    with pytest.raises(UserError, match="'parallel.tensor_parallel': 3 does not divide the 4 workers of each"):
        parallel_dims.layout_for(0, 8, 2, tp=3)


def test_layout_ranks_with_expert_groups_among_the_copies_of_each_stage():
    """pp x dp x ep: a stage's copies, dp_rank = dp * ep + ep_rank, are groups of e neighbours
    (the alltoalls'); the ranks along "dp" hold the same experts; both dimensions together are
    the copies of the stage's dense weights, in rank order."""
    layout = parallel_dims.layout_for(rank=5, world_size=8, stages=2, ep=2)
    assert (layout.stage, layout.dp_rank, layout.dp, layout.rank) == (1, 1, 4, 5)
    assert layout.grid.group("ep", 5) == [4, 5] and layout.grid.group("dp", 5) == [5, 7]
    assert layout.stage_ranks(1) == [4, 5, 6, 7] and layout.pipeline_ranks(3) == [3, 7]
    assert layout.grid.groups(("dp", "ep")) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(UserError, match="'parallel.expert_parallel': 3 does not divide the 4 data-parallel copies"):
        parallel_dims.layout_for(0, 8, 2, ep=3)


def test_the_grid_s_groups_are_the_ranks_along_one_dimension():
    """The grid behind every group: with pp x dp the pipelines and the copies of each stage; a
    third, innermost dimension (tensor parallelism) makes neighbours its groups and the same
    arithmetic gives the others, each group once, in one order for all ranks."""
    grid = parallel_dims.ParallelDims((("pp", 2), ("dp", 4)))
    assert grid.world_size == 8 and grid.coords(5) == {"pp": 1, "dp": 1} and grid.rank_at(pp=1, dp=1) == 5
    assert grid.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.groups("dp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    cube = parallel_dims.ParallelDims((("pp", 2), ("dp", 2), ("tp", 2)))
    assert cube.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert cube.group("dp", 5) == [5, 7] and cube.group("pp", 5) == [1, 5]
    for dim in ("pp", "dp", "tp"):
        assert sorted(r for g in cube.groups(dim) for r in g) == list(range(8))


@pytest.mark.parametrize("n_layer,stages,per_rank,bounds", [
    (4, 1, 1, [0, 4]),
    (4, 2, 1, [0, 2, 4]),           # embedding + 2 layers | 2 layers + head
    (5, 2, 1, [0, 3, 5]),           # 7 units: the first stage takes the extra one
    (6, 4, 1, [0, 1, 3, 5, 6]),     # 8 units: 2 per stage
    (4, 4, 1, [0, 1, 3, 4, 4]),     # 6 units: the head alone on the last stage
    (4, 2, 2, [0, 1, 3, 4, 4]),     # interleaved: 4 pipeline stages on 2 ranks
    (24, 4, 1, [0, 6, 13, 19, 24]),
])
def test_even_split_counts_embedding_and_head_as_layers(n_layer, stages, per_rank, bounds):
    assert pipeline.stage_bounds(n_layer, stages, per_rank) == bounds


@pytest.mark.parametrize("stages,microbatches,per_rank,expected", [
    (2, 4, 1, 1 / 5),    # (p-1)/(m+p-1)
    (4, 8, 1, 3 / 11),
    (2, 4, 2, 1 / 9),    # interleaved: (p-1)/(v·m+p-1)
    (4, 8, 2, 3 / 19),
    (4, 8, 4, 3 / 35),
])
def test_ideal_bubble(stages, microbatches, per_rank, expected):
    bubble = pipeline.ideal_bubble(stages, microbatches, per_rank)
    assert bubble == pytest.approx(expected)
    # Megatron-LM's bubble time fraction, idle over working time: (1/v)·(p-1)/m
    assert bubble / (1 - bubble) == pytest.approx((stages - 1) / (per_rank * microbatches))


def test_explicit_boundaries():
    assert pipeline.stage_bounds(6, 3, boundaries=[0, 1, 4, 6]) == [0, 1, 4, 6]
    assert pipeline.stage_bounds(4, 2, boundaries=[0, 0, 4]) == [0, 0, 4]  # embedding alone


@pytest.mark.parametrize("n_layer,stages,per_rank,boundaries,message", [
    (2, 3, 1, None, r"parallel.pipeline_stages=3 x parallel.stages_per_rank=1 = 3 pipeline stages is more than "
                    r"the model's 2 layers \(model.n_layer\)"),
    (3, 2, 2, None, r"parallel.pipeline_stages=2 x parallel.stages_per_rank=2 = 4 pipeline stages"),
    (6, 3, 1, [0, 2, 6], r"parallel.layer_boundaries=\[0, 2, 6\] must be 4 rising layer indices from 0 to 6"),
    (6, 2, 1, [1, 3, 6], r"must be 3 rising"),
    (6, 2, 1, [0, 3, 5], r"must be 3 rising"),
    (6, 3, 1, [0, 4, 3, 6], r"must be 4 rising"),
    (6, 3, 1, [0, 3, 3, 6], r"parallel.layer_boundaries=\[0, 3, 3, 6\] gives stage 1 no layer"),
])
def test_bad_split_is_a_user_error(n_layer, stages, per_rank, boundaries, message):
    with pytest.raises(UserError, match=message):
        pipeline.stage_bounds(n_layer, stages, per_rank, boundaries)


@pytest.mark.parametrize("name,stages,per_rank,microbatches,message", [
    ("zbv", 2, 1, 4, "parallel.schedule 'zbv' is not one of gpipe, 1f1b, interleaved1f1b"),
    ("interleaved1f1b", 2, 1, 4, "needs parallel.pipeline_stages >= 2 and parallel.stages_per_rank >= 2"),
    ("1f1b", 2, 2, 4, "runs one stage per rank; set parallel.stages_per_rank=1"),
    ("gpipe", 4, 1, 2, "parallel.microbatches=2 must be at least parallel.pipeline_stages=4"),
    ("interleaved1f1b", 2, 2, 5, "parallel.microbatches=5 must be a multiple of 2"),
])
def test_bad_schedule_is_a_user_error(name, stages, per_rank, microbatches, message):
    with pytest.raises(UserError, match=message):
        pipeline.check_schedule(name, stages, per_rank, microbatches)
    pipeline.check_schedule("1F1B", 2, 1, 2)  # torch's names, any case
