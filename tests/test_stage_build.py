"""Pipeline ranks build and load only their own stage (hvdtrain.models.model_build): the model's
parameters start on the meta device, a rank makes only its stage's real, and that costs it
about its share of the host memory; its initial weights are the unsplit model's, whatever the
layout; model.pretrained is read per stage from (sharded) safetensors files."""
import json
import re
import sys

import pytest
import safetensors
import torch
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

from helpers import WORKERS, horovodrun, load_params, run_cmd, write_config
from hvdtrain.parallel import parallel_dims, pipeline
from hvdtrain.config import ModelConfig
from hvdtrain.errors import UserError
from hvdtrain.models.common import Vocab, build_model, model_blueprint
from hvdtrain.parallel.sharded_weights import materialise_slices

VOCAB = Vocab(size=100, pad_id=0)
SEQ = 16


def tiny(arch: str, n_layer: int = 4, **kw) -> ModelConfig:
    return ModelConfig(arch=arch, n_layer=n_layer, n_head=2, d_model=32, dropout=0.0, **kw)


def build_stage(cfg: ModelConfig, layout: parallel_dims.Layout, bounds: list[int], seed: int = 3):
    """One rank's stage, built as train.build_model_and_optimizer builds it."""
    torch.manual_seed(seed)
    blueprint = model_blueprint(cfg, VOCAB, SEQ)
    return blueprint.materialise(pipeline.split_model(blueprint.model, layout, bounds))


def assert_equal_tensors(reference: dict, part: dict):
    assert set(part) <= set(reference), set(part) - set(reference)
    for name, value in part.items():  # the same computation on every layout: bit for bit
        assert torch.equal(value, reference[name]), name


# ---------------------------------------------------------------- in one process

LAYOUTS = [  # (stages, stages per rank, layer boundaries or None)
    (2, 1, None), (4, 1, None), (2, 2, None), (2, 1, [0, 1, 4]), (3, 1, [0, 0, 3, 4])]


@pytest.mark.parametrize("arch", ["gpt2", "bert", "llama", "modernbert"])
@pytest.mark.parametrize("stages,per_rank,boundaries", LAYOUTS)
def test_every_layout_starts_from_the_unsplit_model_s_weights_and_buffers(arch, stages, per_rank, boundaries):
    torch.manual_seed(3)
    whole = build_model(tiny(arch), VOCAB, SEQ)
    reference = {**whole.state_dict(), **dict(whole.named_buffers())}
    bounds = pipeline.stage_bounds(4, stages, per_rank, boundaries)
    held = set()
    for s in range(stages):
        stage = build_stage(tiny(arch), parallel_dims.Layout(stages, 1, s, 0, per_rank), bounds)
        assert not any(t.is_meta for t in [*stage.parameters(), *stage.buffers()])
        # The tied halves the pipeline keeps equal are the stage's real parameters.
        assert len(stage.tied) == (s in (0, stages - 1)) and all(p in set(stage.parameters())
                                                                 for p in stage.tied.values())
        assert_equal_tensors(reference, {**stage.state_dict(), **dict(stage.named_buffers())})
        held |= set(stage.state_dict())
    assert held == set(whole.state_dict())


@pytest.mark.parametrize("arch", ["gpt2", "bert", "llama", "modernbert"])
@pytest.mark.parametrize("stage", [None, 0, 1])
@pytest.mark.parametrize("level,dtype", [("full", torch.float32), ("gradients", torch.bfloat16)])
def test_sharded_copies_build_their_slices_of_the_unsplit_model_s_weights(arch, stage, level, dtype):
    """parallel.shard (sharded_weights.materialise_slices, a unit at a time): two copies' fp32
    master slices, put together, are the unsplit model's weights bit for bit (the same draws),
    with or without stages; the weights hold nothing with "full", else the same values in the
    compute dtype."""
    torch.manual_seed(3)
    reference = dict(build_model(tiny(arch), VOCAB, SEQ).named_parameters(remove_duplicate=False))
    copies = []
    for rank in range(2):
        torch.manual_seed(3)
        blueprint = model_blueprint(tiny(arch), VOCAB, SEQ)
        part = blueprint.model
        if stage is not None:
            part = pipeline.split_model(part, parallel_dims.Layout(2, 1, stage, 0), [0, 2, 4])
        masters = materialise_slices(blueprint, part, rank, 2, dtype, torch.device("cpu"), level)
        copies.append(({n: masters[id(p)] for n, p in part.named_parameters(remove_duplicate=False)}, part))
    (first, part), (second, _) = copies
    assert first
    assert_equal_tensors(reference, {n: torch.cat([first[n], second[n]]).view(reference[n].shape) for n in first})
    if level == "full":
        assert all(p.untyped_storage().nbytes() == 0 for p in part.parameters())
    else:
        assert_equal_tensors({n: p.to(dtype) for n, p in reference.items()}, dict(part.named_parameters()))


def test_the_buffers_are_the_modules_own_not_empty_memory():
    """BERT's position ids (non-persistent) are what its constructor computes."""
    stage = build_stage(tiny("bert"), parallel_dims.Layout(2, 1, 0, 0), [0, 2, 4])
    positions = stage.bert.embeddings.position_ids
    assert torch.equal(positions, torch.arange(positions.shape[-1]).expand(1, -1))
    assert not stage.bert.embeddings.token_type_ids.any()


def assert_distributions(ours: dict, theirs: dict):
    """Each of `ours` has the distribution of its namesake in `theirs` (another draw): mean, std
    and largest magnitude within sampling error, and the same rows all zero (padding rows)."""
    assert set(ours) == set(theirs)
    for name, p in ours.items():
        q, n = theirs[name], p.numel()
        spread = q.std().item()
        assert p.mean().item() == pytest.approx(q.mean().item(), abs=6 * spread / n ** 0.5 + 1e-6), name
        assert p.std().item() == pytest.approx(spread, rel=6 / (2 * n) ** 0.5, abs=1e-6), name
        assert 2 / 3 <= (p.abs().max().item() + 1e-6) / (q.abs().max().item() + 1e-6) <= 3 / 2, name
        if p.dim() == 2:
            assert torch.equal((p == 0).all(1), (q == 0).all(1)), f"{name}: zero rows {(q == 0).all(1).nonzero()}"


@pytest.mark.parametrize("arch,knobs", [("gpt2", {}), ("bert", {}), ("llama", {}), ("llama", {"tie_embeddings": False}),
                                        ("modernbert", {})])
def test_every_family_starts_from_the_distributions_transformers_gives(arch, knobs):
    """hvdtrain's per-module initialisation against transformers' own (the model class built
    from the same config): every parameter, GPT-2's scaled residual projections, ModernBERT's
    truncated normals and the padding rows included, on the whole model and on stages built
    alone (layouts start from the whole model's weights: the test above). A tied parameter is
    its source's (the token embedding's), as transformers ties after initialising: ModernBERT's
    embedding had its decoder's smaller std, BERT's and Llama's padding rows were not zero."""
    vocab = Vocab(size=1000, pad_id=1)  # 1024 rows
    cfg = ModelConfig(arch=arch, n_layer=4, n_head=4, d_model=256, dropout=0.0, **knobs)
    torch.manual_seed(0)
    ours = build_model(cfg, vocab, SEQ)
    # transformers' initialisation, in one pass; a tied parameter under each of its names
    theirs = dict(type(ours)(ours.config).named_parameters(remove_duplicate=False))
    assert_distributions(dict(ours.named_parameters(remove_duplicate=False)), theirs)
    assert (ours.get_output_embeddings().weight is ours.get_input_embeddings().weight) == ours.config.tie_word_embeddings
    stages = {}
    for s in range(2):
        torch.manual_seed(0)
        blueprint = model_blueprint(cfg, vocab, SEQ)
        stages |= dict(blueprint.materialise(pipeline.split_model(blueprint.model, parallel_dims.Layout(2, 1, s, 0),
                                                                  [0, 2, 4])).named_parameters(remove_duplicate=False))
    assert_distributions(stages, theirs)
    torch.manual_seed(1)
    assert not torch.equal(build_model(cfg, vocab, SEQ).get_input_embeddings().weight,
                           ours.get_input_embeddings().weight)  # the seed decides the values


def save_sharded(folder, arch: str, body_only: bool = False):
    """A tiny model saved by transformers in several safetensors files with their index;
    `body_only`: its GPT2Model alone, whose names lack "transformer." (as the hub's gpt2)."""
    torch.manual_seed(5)
    cfg = tiny(arch)
    model = build_model(cfg, VOCAB, SEQ)
    # Other weights than hvdtrain's initialisation gives, so that a load that failed shows.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    (model.transformer if body_only else model).save_pretrained(folder, safe_serialization=True,
                                                                max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("*.safetensors"))) > 2
    return folder


class ReadNames:
    """safetensors.safe_open, recording the names each rank reads with get_tensor."""

    def __init__(self, monkeypatch):
        self.names = []
        real = safetensors.safe_open
        log = self.names

        class Recording:
            def __init__(self, *args, **kw):
                self.file = real(*args, **kw)

            def __enter__(self):
                self.file.__enter__()
                return self

            def __exit__(self, *exc):
                return self.file.__exit__(*exc)

            def keys(self):
                return self.file.keys()

            def get_tensor(self, name):
                log.append(name)
                return self.file.get_tensor(name)

        monkeypatch.setattr(safetensors, "safe_open", Recording)


@pytest.mark.parametrize("arch,body_only", [("gpt2", False), ("gpt2", True), ("bert", False)])
def test_a_sharded_pretrained_folder_loads_per_stage_reading_only_the_stage_s_tensors(tmp_path, arch, body_only,
                                                                                         monkeypatch):
    folder = save_sharded(tmp_path / "model", arch, body_only)
    auto = AutoModelForCausalLM if arch == "gpt2" else AutoModelForMaskedLM
    reference = auto.from_pretrained(folder, use_safetensors=True).state_dict()
    saved = set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"])
    cfg = tiny(arch, pretrained=str(folder))
    read = ReadNames(monkeypatch)
    for s in range(2):
        read.names.clear()
        stage = build_stage(cfg, parallel_dims.Layout(2, 1, s, 0), [0, 2, 4])
        assert_equal_tensors(reference, stage.state_dict())
        layers = {m.group(1) for n in read.names if (m := re.search(r"(?:^|\.)(?:h|layer)\.(\d+)\.", n))}
        assert layers == ({"0", "1"} if s == 0 else {"2", "3"}), read.names  # never another stage's layers
        assert len(set(read.names)) < len(saved)
    whole = build_model(cfg, VOCAB, SEQ)  # the unsplit model through the same reader
    assert_equal_tensors(reference, whole.state_dict())
    assert whole.get_output_embeddings().weight is whole.get_input_embeddings().weight


def test_a_pretrained_folder_without_a_stage_s_tensor_is_one_line(tmp_path):
    folder = save_sharded(tmp_path / "model", "gpt2")
    index = folder / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    del content["weight_map"]["transformer.h.3.mlp.c_fc.weight"]
    index.write_text(json.dumps(content))
    with pytest.raises(UserError, match=r"model.pretrained '.*' has no tensor 'transformer.h.3.mlp.c_fc.weight'"):
        build_stage(tiny("gpt2", pretrained=str(folder)), parallel_dims.Layout(2, 1, 1, 0), [0, 2, 4])


# ---------------------------------------------------------------- real workers (horovodrun, Gloo)

def build_workers(np: int, config, out, *overrides, memory_only: bool = False) -> list[dict]:
    """Each rank's build_rank{R}.json (tests/workers/build_stage.py)."""
    proc = horovodrun(np, [WORKERS / "build_stage.py", *(["--memory-only"] if memory_only else []), config,
                           f"out_dir={out}", *overrides])
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return [json.loads((out / f"build_rank{r}.json").read_text()) for r in range(np)]


@pytest.mark.workers
def test_a_rank_of_two_stages_builds_with_half_the_host_memory(tmp_path):
    """8 layers x 1024 (404 MB of fp32 weights, the embedding of 128 rows is small): the peak
    resident set of a rank rises by what it holds while it builds, not by the whole model."""
    config = write_config(tmp_path / "config.yaml", {"model": {"n_layer": 8, "n_head": 8, "d_model": 1024},
                                                     "train": {"grad_accum": 4}})
    [one] = build_workers(1, config, tmp_path / "p1", memory_only=True)
    two = build_workers(2, config, tmp_path / "p2", "parallel.pipeline_stages=2", memory_only=True)
    assert one["weights"] > 400e6 and one["peak_rise"] > 0.9 * one["weights"]  # the weights dominate
    overhead = 0.1 * one["peak_rise"]  # allocator and interpreter: not the weights
    for rank in two:
        assert rank["weights"] < 0.51 * one["weights"]
        assert rank["peak_rise"] < 0.5 * one["peak_rise"] + overhead, (one, two)


@pytest.mark.workers
def test_a_rank_of_two_expert_groups_builds_with_its_experts_and_one_layer_s_whole(tmp_path):
    """Mixtral, 8 layers of 8 experts of 512 x 1024 (403 MB of fp32 expert weights, the rest
    small), e=2: a rank makes one layer's experts whole at a time and keeps its half of them, so
    its peak rises by what it keeps plus one layer's experts, not by the whole model."""
    config = write_config(tmp_path / "config.yaml", {
        "model": {"arch": "mixtral", "n_layer": 8, "n_head": 8, "n_kv_head": 8, "d_model": 512, "d_ff": 1024,
                  "experts": 8, "experts_per_token": 2}, "train": {"grad_accum": 4}})
    [one] = build_workers(1, config, tmp_path / "e1", memory_only=True)
    two = build_workers(2, config, tmp_path / "e2", "parallel.expert_parallel=2", memory_only=True)
    layer_experts = 8 * 3 * 1024 * 512 * 4
    assert one["weights"] > 8 * layer_experts and one["peak_rise"] > 0.9 * one["weights"]  # the weights dominate
    overhead = 0.1 * one["peak_rise"]  # allocator and interpreter: not the weights
    for rank in two:
        assert abs(rank["weights"] - (one["weights"] - 4 * layer_experts)) < 0.01 * one["weights"], (one, two)
        assert rank["peak_rise"] < rank["weights"] + layer_experts + overhead, (one, two)


@pytest.mark.workers
def test_a_fully_sharded_copy_builds_with_its_share_of_the_host_memory(tmp_path):
    """parallel.shard=full at d=2, 16 layers x 1024 (808 MB of fp32 weights): a copy makes one
    unit real at a time and keeps its half of the fp32 masters, so its peak rises by about half
    of one worker's, plus one block; the weights themselves hold nothing."""
    config = write_config(tmp_path / "config.yaml", {"model": {"n_layer": 16, "n_head": 8, "d_model": 1024},
                                                     "train": {"grad_accum": 4}})
    [one] = build_workers(1, config, tmp_path / "p1", memory_only=True)
    two = build_workers(2, config, tmp_path / "p2", "parallel.shard=full", memory_only=True)
    assert one["weights"] > 800e6 and one["peak_rise"] > 0.9 * one["weights"]
    block, overhead = one["weights"] / 16, 0.1 * one["peak_rise"]
    for rank in two:
        assert rank["weights"] < 1e6 and abs(rank["masters"] - one["weights"] / 2) < 0.01 * one["weights"]
        assert rank["peak_rise"] < 0.5 * one["peak_rise"] + block + overhead, (one, two)


@pytest.mark.workers
@pytest.mark.parametrize("arch", ["gpt2", pytest.param("bert", marks=pytest.mark.deep)])
def test_two_stages_start_from_the_weights_of_one_worker(tmp_path, arch):
    config = write_config(tmp_path / "config.yaml", {"model": {"arch": arch, "n_layer": 4},
                                                     "train": {"grad_accum": 2}})
    build_workers(1, config, tmp_path / "p1")
    build_workers(2, config, tmp_path / "p2", "parallel.pipeline_stages=2")
    reference = load_params(tmp_path / "p1", 0)
    stages = [load_params(tmp_path / "p2", r) for r in range(2)]
    for stage in stages:
        assert_equal_tensors(reference, stage)
    assert set(stages[0]) | set(stages[1]) == set(reference)


@pytest.mark.deep
@pytest.mark.workers
def test_two_stages_load_a_sharded_pretrained_folder_as_transformers_does(tmp_path):
    folder = save_sharded(tmp_path / "model", "gpt2")
    config = write_config(tmp_path / "config.yaml", {"model": {"pretrained": str(folder)}, "train": {"grad_accum": 2},
                                                     "data": {"seq_len": SEQ}})
    build_workers(2, config, tmp_path / "p2", "parallel.pipeline_stages=2")
    reference = AutoModelForCausalLM.from_pretrained(folder, use_safetensors=True).state_dict()
    for r in range(2):
        assert_equal_tensors(reference, load_params(tmp_path / "p2", r))



@pytest.mark.deep
@pytest.mark.workers
def test_startup_peaks_measure_each_pipeline_position_in_a_fresh_process(tmp_path):
    """What `hvdtrain bench memory` reports: 8 layers x 512 (101 MB), each position built alone."""
    from hvdtrain.config import load_config
    from hvdtrain.tools.startup_memory import startup_peaks

    cfg = load_config(write_config(tmp_path / "config.yaml", {"model": {"n_layer": 8, "n_head": 8, "d_model": 512}}))
    [one] = startup_peaks(cfg, 1)
    two = startup_peaks(cfg, 2)
    assert one["weight_bytes"] > 100e6 and one["peak_bytes"] > 0.9 * one["weight_bytes"]
    assert [r["stage"] for r in two] == [0, 1]
    for row in two:
        assert row["weight_bytes"] < 0.51 * one["weight_bytes"]
        assert row["peak_bytes"] < 0.5 * one["peak_bytes"] + 0.1 * one["peak_bytes"], (one, two)


def test_startup_memory_refuses_bad_stage_counts_in_one_line(tmp_path):
    proc = run_cmd([sys.executable, "-m", "hvdtrain.tools.startup_memory", write_config(tmp_path / "c.yaml"),
                    "--stages", "1,two"])
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "hvdtrain: error: --stages '1,two': expected stage counts separated by commas, e.g. 1,2,4"], proc.stderr
