"""Expert parallelism (parallel.expert_parallel = e): each layer's experts split over the e ranks
of an expert group, the tokens exchanged with Horovod's alltoall, through real horovodrun workers
(Gloo, fp32, dropout 0). e=2 trains as one worker does, router loss, clipping and routing
statistics included, with each rank holding its own experts only, also with the weights fully
sharded (parallel.shard full) over the copies holding them; a checkpoint written at e=2 resumes
at e=1 and one written at e=1 at e=2; the export is the whole model. (Bad input: test_errors.)"""
import json
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from helpers import (REPO, WORKERS, assert_same_losses, assert_same_params, horovodrun, load_params, read_metrics,
                     step_losses, train_fully_sharded_with_a_resume, train_sharded_across_layouts,
                     train_workers)
from hvdtrain.checkpointing import checkpoint
from hvdtrain.parallel.expert_parallel import ExpertGroups, local_rows

pytestmark = pytest.mark.workers

# 4 experts, top-2, a large router loss (its gradient reaches the routers through the exchange)
# and clipping active (the norm counts every expert once)
MOE = {"model": {"arch": "mixtral", "n_kv_head": 1, "experts": 4, "experts_per_token": 2, "d_ff": 32,
                 "router_aux_loss_coef": 0.5},
       "train": {"global_batch_size": 8, "max_steps": 8, "grad_clip": 0.5}, "checkpoint": {"every": 2}}
EXPERTS = "model.layers.1.mlp.experts.gate_up_proj"


def exported(run) -> dict:
    return load_file(str(run / "hf" / "model.safetensors"))


@pytest.mark.parametrize("capacity_factor", [pytest.param(None, marks=pytest.mark.deep), 1.0])  # dropless: 4 workers
def test_two_expert_groups_train_as_one_worker(tmp_path, tiny_config, capacity_factor):
    """np=1 against np=2 with e=2, dropless and with a capacity factor (the dropped pairs stay
    where they are): per-step losses, the logged router loss, expert tokens, dropped pairs and
    gradient norm, and the exported weights agree; each rank holds its two experts' rows of
    the one-worker model."""
    config = tiny_config({**MOE, "model": {**MOE["model"], "capacity_factor": capacity_factor}})
    one, split = tmp_path / "np1", tmp_path / "e2"
    train_workers(1, config, f"out_dir={one}")
    train_workers(2, config, f"out_dir={split}", "parallel.expert_parallel=2")
    assert_same_losses(step_losses(one), step_losses(split), min_steps=8)
    records = [read_metrics(run)[0] for run in (one, split)]
    for a, b in zip(*records):
        assert a["aux_loss"] == pytest.approx(b["aux_loss"], rel=1e-5) and a["aux_loss"] > 0.4
        assert a["expert_tokens"] == b["expert_tokens"] and a.get("expert_dropped") == b.get("expert_dropped")
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4) and a["grad_norm"] > 0.5  # clipped
    dropped = [sum(r.get("expert_dropped", [])) for r in records[0]]
    assert (sum(dropped) > 0) if capacity_factor else not any("expert_dropped" in r for r in records[0])
    whole = load_params(one, 0)
    for rank in (0, 1):
        mine = load_params(split, rank)
        assert mine[EXPERTS].shape[0] == 2
        torch.testing.assert_close(mine[EXPERTS], whole[EXPERTS][2 * rank:2 * rank + 2], rtol=0, atol=1e-5)
    assert_same_params(exported(one), exported(split), atol=1e-5)


def test_four_workers_in_two_expert_groups_train_as_one_worker(tmp_path, tiny_config):
    """4 workers, e=2: ranks 0 and 2 (1 and 3) hold the same experts and reduce their gradients
    in a process set of their own, each allreduce started in the step's second (last) backward;
    with horovod.gradient_predivide_factor 2 as well, the losses and exported weights are one
    worker's (micro batches of 1 for both: the router loss is a micro batch's)."""
    config = tiny_config({**MOE, "train": {**MOE["train"], "micro_batch_size": 1}})
    one, split = tmp_path / "np1", tmp_path / "e2np4"
    train_workers(1, config, f"out_dir={one}")
    train_workers(4, config, f"out_dir={split}", "parallel.expert_parallel=2", "horovod.gradient_predivide_factor=2",
                  timeout=600)
    assert_same_losses(step_losses(one), step_losses(split), min_steps=8)
    assert_same_params(load_params(split, 1), load_params(split, 3))
    assert_same_params(exported(one), exported(split), atol=1e-5)


def test_two_expert_groups_by_two_stages_train_as_one_worker_across_layouts(tmp_path, tiny_config):
    """4 workers, e=2 x p=2: the two copies of each stage are one expert group (ranks 0 and 1
    hold stage 0, 2 and 3 stage 1), exchanging tokens within it in the schedule's forwards and
    backwards, the dense gradients reduced over the stage's copies, the experts' over none (each
    expert is held once). To step 4 at e=2 x p=2 (a checkpoint part per stage and expert rank),
    read by 2 plain data-parallel workers to step 6, that one's at e=2 x p=2 to 8: one worker's
    losses, router loss, gradient norms (clipped) and export (micro batches of 1 for both: the
    router loss is a micro batch's)."""
    config = tiny_config({**MOE, "train": {**MOE["train"], "micro_batch_size": 1}})
    one, moved = tmp_path / "np1", tmp_path / "moved"
    train_workers(1, config, f"out_dir={one}")
    grid = ("parallel.expert_parallel=2", "parallel.pipeline_stages=2")
    train_workers(4, config, f"out_dir={moved}", *grid, "train.stop_at_step=4", timeout=600)
    assert {p.name for p in checkpoint.newest_intact_checkpoint(moved).iterdir()} >= {
        f"model-0000{part}-of-00004.safetensors" for part in range(1, 5)}
    train_workers(2, config, f"out_dir={moved}", "train.stop_at_step=6")
    train_workers(4, config, f"out_dir={moved}", *grid, timeout=600)
    assert_same_losses(step_losses(one), step_losses(moved), min_steps=8)
    for a, b in zip(read_metrics(one)[0], read_metrics(moved)[0]):
        assert a["aux_loss"] == pytest.approx(b["aux_loss"], rel=1e-5) and a["expert_tokens"] == b["expert_tokens"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4) and a["grad_norm"] > 0.5  # clipped
    assert_same_params(exported(one), exported(moved), atol=1e-5)


@pytest.mark.deep
def test_two_expert_groups_by_two_interleaved_stages_sharded_across_layouts(tmp_path, tiny_config):
    """4 layers, 4 workers, e=2 x p=2 with the interleaved schedule (two stages per worker, each
    exchanging its layers' tokens) and ZeRO-1 to step 4, 2 plain workers to 6, the same layout
    with ZeRO-2 to 8 (sharded checkpoints written and read at other layouts): one worker's run."""
    config = tiny_config({"model": {**MOE["model"], "n_layer": 4}, "train": {**MOE["train"], "micro_batch_size": 1},
                          "checkpoint": MOE["checkpoint"]})
    one, moved = tmp_path / "np1", tmp_path / "moved"
    train_workers(1, config, f"out_dir={one}")
    train_sharded_across_layouts(config, moved, "parallel.expert_parallel=2", "parallel.pipeline_stages=2",
                                 "parallel.schedule=interleaved1f1b", "parallel.stages_per_rank=2")
    # the four layers' other order of sums drifts Adam's steps (lr 1e-2) by up to 3.4e-5 in 8
    # steps (measured); a missed reduction moves weights by about the lr (a wrong scale: the norms)
    assert_trains_as_one_worker(one, moved, atol=5e-5)


@pytest.mark.deep
def test_eight_workers_shard_each_stage_s_experts_over_the_copies_holding_them(tmp_path, tiny_config):
    """8 workers, e=2 x p=2: each stage's 4 copies are two expert groups, its dense weights
    sharded over the 4 and each expert weight over the 2 copies holding it (full, reduced
    after each run of the schedule); to step 4, then resumed by 4 workers at e=2 x p=2 with
    ZeRO-2 to 8 (each reading its slices of the other layout's): one worker's run."""
    config = tiny_config({**MOE, "train": {**MOE["train"], "micro_batch_size": 1}})
    one, moved = tmp_path / "np1", tmp_path / "moved"
    train_workers(1, config, f"out_dir={one}")
    grid = ("parallel.expert_parallel=2", "parallel.pipeline_stages=2")
    train_workers(8, config, f"out_dir={moved}", *grid, "parallel.shard=full", "parallel.reduce_gradients=after",
                  "train.stop_at_step=4", timeout=900)
    resolved = yaml.safe_load((moved / "config.yaml").read_text())["resolved"]
    assert resolved["optimizer"] == ("sharded (full) over 4 copies (the experts' weights over the 2 holding them) "
                                     "(reduce-scatter, allgather)")
    train_workers(4, config, f"out_dir={moved}", *grid, "parallel.shard=gradients", timeout=900)
    assert_trains_as_one_worker(one, moved)


def test_a_checkpoint_resumes_at_another_expert_parallel_size(tmp_path, tiny_config):
    """2 workers: stop at step 4 with e=2, go on to 6 with e=1, then to 8 with e=2 again: the
    same losses and weights as a straight e=1 run (each rank of the first group wrote its experts' rows)."""
    config = tiny_config(MOE)
    straight, moved = tmp_path / "straight", tmp_path / "moved"
    train_workers(2, config, f"out_dir={straight}")
    train_workers(2, config, f"out_dir={moved}", "parallel.expert_parallel=2", "train.stop_at_step=4")
    assert {p.name for p in checkpoint.newest_intact_checkpoint(moved).iterdir()} >= {
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    train_workers(2, config, f"out_dir={moved}", "train.stop_at_step=6")
    train_workers(2, config, f"out_dir={moved}", "parallel.expert_parallel=2")
    assert_same_losses(step_losses(straight), step_losses(moved), min_steps=8)
    assert_same_params(exported(straight), exported(moved), atol=1e-5)


@pytest.mark.deep
def test_continued_pretraining_of_an_exported_mixture_with_its_experts_split(tmp_path, tiny_config):
    """A one-worker run's export as model.pretrained: 2 workers at e=2 (each reading its experts'
    rows of the folder as it builds them, one layer at a time) train as 2 workers at e=1."""
    config = tiny_config(MOE)
    first = tmp_path / "first"
    train_workers(1, config, f"out_dir={first}", "train.max_steps=4")
    pretrained = f"model.pretrained={first / 'hf'}"
    whole, split = tmp_path / "whole", tmp_path / "split"
    train_workers(2, config, f"out_dir={whole}", pretrained)
    train_workers(2, config, f"out_dir={split}", pretrained, "parallel.expert_parallel=2")
    assert_same_losses(step_losses(whole), step_losses(split), min_steps=8)
    assert_same_params(exported(whole), exported(split), atol=1e-5)


@pytest.mark.parametrize("dtype, sent, tolerance", [("float32", "torch.float32", 1e-5),
                                                    ("bfloat16", "torch.int16", 2e-2),
                                                    pytest.param("float16", "torch.float16", 2e-3, marks=pytest.mark.deep)])
def test_a_rank_that_receives_no_tokens_takes_part_in_the_backward_exchange(dtype, sent, tolerance):
    """Split experts equal the whole module on each rank's tokens (output, the input's gradient,
    the experts' gradients summed over the group) when every token chooses rank 0's experts:
    rank 1 receives nothing and still joins the group's backward alltoalls (else: a hang), and
    its experts still get a gradient, zeros (else their hooks, which start their reductions
    with the ranks holding the same experts, would not run: a hang when sharded). Rank 0 runs
    one Horovod collective more before it: every alltoall, backward's too, is named after its
    layer (unnamed, Horovod's names would differ between the ranks: a hang).
    Under 16-bit autocast the hidden states travel in 16 bits (bf16 as its int16 bits), and the
    output and input gradient are the same numbers; the experts' gradients sum their tokens in
    another order (one matmul over both ranks' tokens)."""
    proc = horovodrun(2, [WORKERS / "expert_exchange.py", dtype], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = sorted((json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines() if "RESULT " in line),
                     key=lambda r: r["rank"])
    assert [r["received_nothing"] for r in results] == [False, True]
    for r in results:
        assert max(r["output"], r["input_grad"]) < 1e-5 and r["experts_grad"] < tolerance, r
        assert r["without_grad"] == [], r
        assert r["sent"] == sorted([sent, "torch.int64"])
        assert r["names"] == [f"experts.0.{what}" for what in ("experts", "results", "results.backward", "tokens",
                                                               "tokens.backward")], r


def test_a_rank_reads_only_its_experts_rows_of_a_checkpoint(tmp_path):
    """load_weights and load_optimizer with expert_parallel.local_rows: rank 1 of e=2 takes rows
    2-3 of a 4-expert weight and of its optimizer state, from a checkpoint whose part holding
    rows 0-1 is gone (reading the whole tensor would refuse: a part missing)."""
    whole = torch.arange(24.0).view(4, 6)
    folder = tmp_path / "step_00000004"
    folder.mkdir()
    for index in (0, 1):
        rows = (whole[2 * index:2 * index + 2].flatten(), 12 * index, (4, 6))
        state = {"experts::exp_avg": (rows[0] * 10, *rows[1:]), "experts::step": torch.tensor(4.0)}
        checkpoint.write_slices(folder, index, 2, {"experts": rows, "dense": torch.ones(3)} if index else
                                {"experts": rows}, state)
    for name in ("model-00001-of-00002.safetensors", "optimizer-00001-of-00002.safetensors"):
        (folder / name).unlink()
    model = torch.nn.Module()
    model.experts, model.dense = torch.nn.Parameter(torch.zeros(2, 6)), torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.AdamW(model.parameters())
    groups = ExpertGroups(size=2, rank=1, group_set=None, same_experts_set=None)
    rows = local_rows(model, {"experts"}, groups)
    checkpoint.load_weights(model, folder, {}, rows)
    checkpoint.load_optimizer(optimizer, model, folder, {}, rows)
    assert torch.equal(model.experts.data, whole[2:]) and torch.equal(model.dense.data, torch.ones(3))
    state = optimizer.state[model.experts]
    assert torch.equal(state["exp_avg"], whole[2:] * 10) and state["step"].item() == 4.0


def test_the_timeline_share_sums_each_operation_from_its_submission_to_its_end(tmp_path):
    """scripts/timeline_share.py on a timeline in Horovod's format (left open, as Horovod leaves
    it): two alltoalls of 3 + 2 and 1 + 1 µs (negotiation + operation) in a window of 10 µs; an
    allreduce in between is not counted."""
    events = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "alltoall.noname.1"}},
              {"name": "process_name", "ph": "M", "pid": 2, "args": {"name": "allreduce.grads"}},
              {"name": "process_name", "ph": "M", "pid": 3, "args": {"name": "alltoall.noname.2"}}]
    for pid, (start, negotiated, end) in {1: (0, 3, 5), 2: (5, 6, 8), 3: (8, 9, 10)}.items():
        events += [{"ph": "B", "name": "NEGOTIATE", "ts": start, "pid": pid}, {"ph": "E", "ts": negotiated, "pid": pid},
                   {"ph": "B", "name": "OP", "ts": negotiated, "pid": pid},
                   {"ph": "B", "name": "INNER", "ts": negotiated, "pid": pid}, {"ph": "E", "ts": end, "pid": pid},
                   {"ph": "E", "ts": end, "pid": pid}]
    timeline = tmp_path / "timeline.json"
    timeline.write_text("[\n" + ",\n".join(json.dumps(e) for e in events) + ",")
    proc = subprocess.run([sys.executable, REPO / "scripts" / "timeline_share.py", timeline], capture_output=True,
                          text=True, check=True)
    assert json.loads(proc.stdout) == {"op": "alltoall", "operations": 2, "busy_s": 7e-6, "window_s": 10e-6,
                                       "share": 0.7}


@pytest.mark.parametrize("grid, copies, experts", [
    (("parallel.expert_parallel=2",), 4, "over the 2 holding them"),
    (("parallel.expert_parallel=2", "parallel.pipeline_stages=2", "parallel.reduce_gradients=after"), 2,
     "whole on the one holding them")])
def test_fully_sharded_weights_over_the_copies_of_each_expert(tmp_path, tiny_config, grid, copies, experts):
    """4 workers with parallel.shard=full, e=2 x 2 copies, or e=2 x p=2: the dense weights
    themselves sharded over the copies (of each stage: its expert group), each expert weight
    over the ranks holding it (with stages: one), every block gathered (two allgathers: one
    per process set) as forward and backward reach it; with stages the gradients
    reduce-scattered after each run of the schedule (GPUs' default; the deep test below: from
    backward's hooks), the norm summed over the copies and along the pipeline. To step 4, then
    resumed at the same layout to 8: the one worker's losses, router loss, clipped norms and
    weights (micro batches of 1 for all: the router loss is a micro batch's)."""
    config = tiny_config({**MOE, "train": {**MOE["train"], "micro_batch_size": 1}})
    one, split = tmp_path / "np1", tmp_path / "split"
    train_workers(1, config, f"out_dir={one}")
    train_fully_sharded_with_a_resume(config, split, *grid)
    assert_trains_as_one_worker(one, split)
    resolved = yaml.safe_load((split / "config.yaml").read_text())["resolved"]
    assert resolved["optimizer"] == (f"sharded (full) over {copies} copies (the experts' weights {experts}) "
                                     "(reduce-scatter, allgather)")


@pytest.mark.deep
def test_sharded_optimizer_over_the_copies_of_each_expert(tmp_path, tiny_config):
    """4 workers, e=2 x 2 copies, with parallel.shard: the dense weights sharded over all four,
    each expert weight over the two ranks holding it (ZeRO-1 to step 4, each rank writing its
    slices; 2 workers, e=1 unsharded to 6; ZeRO-2 to 8, each reading its slices): the one
    worker's losses, router loss, clipped norms and weights (micro batches of 1 for all: the
    router loss is a micro batch's)."""
    config = tiny_config({**MOE, "train": {**MOE["train"], "micro_batch_size": 1}})
    one, moved = tmp_path / "np1", tmp_path / "moved"
    train_workers(1, config, f"out_dir={one}")
    train_sharded_across_layouts(config, moved, "parallel.expert_parallel=2")
    assert_trains_as_one_worker(one, moved)


def assert_trains_as_one_worker(one, split, atol=1e-5):
    """The same per-step losses, router loss and gradient norms (clipped), and exported weights (to `atol`)."""
    assert_same_losses(step_losses(one), step_losses(split), min_steps=8)
    for a, b in zip(read_metrics(one)[0], read_metrics(split)[0]):
        assert a["aux_loss"] == pytest.approx(b["aux_loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4) and a["grad_norm"] > 0.5  # clipped
    assert_same_params(exported(one), exported(split), atol=atol)
