"""Every recipe in recipes/ loads (its `base` chain, keys and values), and the pipelined ones
are what their comments say (no workers: fast)."""
import subprocess
import sys
from pathlib import Path

import pytest

from hvdtrain.config import load_config, resolve_batch
from hvdtrain.tools.plan import GIB, plan

RECIPES = sorted((Path(__file__).resolve().parent.parent / "recipes").glob("*.yaml"))


def test_there_are_recipes():
    assert {"gpt-tiny.yaml", "gpt-tiny-pipeline.yaml", "gpt-13b-pipeline.yaml"} <= {r.name for r in RECIPES}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_recipe_loads(recipe):
    cfg = load_config(str(recipe))
    assert cfg.out_dir.startswith("runs/")


def stage_rows(p: dict) -> list[dict]:
    """The plan's layouts without tensor parallelism (t = 1): the pipeline stage counts."""
    return [r for r in p["pipeline"]["rows"] if r["tensor_parallel"] == 1]


def test_tiny_pipeline_recipe():
    cfg = load_config(str(RECIPES[0].parent / "gpt-tiny-pipeline.yaml"))
    assert (cfg.model.n_layer, cfg.parallel.pipeline_stages, cfg.data.source) == (4, 2, "builtin")
    # 2 workers: one pipeline, 4 micro batches of 8 = the global batch of gpt-tiny.yaml
    assert resolve_batch(cfg, 2) == (4, 32)
    assert resolve_batch(cfg, 4) == (2, 32)  # 2 stages x 2 copies


def test_13b_pipeline_recipe_fits_80_gb_in_16_sharded_stages_on_64_gpus():
    """What the recipe's comments promise, from `hvdtrain plan recipes/gpt-13b-pipeline.yaml
    --gpus 64`: 16 stages x 4 sharded copies without activation checkpointing, the fastest."""
    cfg = load_config(str(RECIPES[0].parent / "gpt-13b-pipeline.yaml"))
    p = plan(cfg, gpus=64, gpu="H100")
    assert 12.8e9 < p["model"]["params"] < 12.9e9
    assert not p["memory"]["fits"]  # not on one GPU
    chosen = p["pipeline"]["chosen"]
    assert chosen["fits"] and chosen["largest"] < 47 * GIB and not chosen["checkpointing"]
    assert (chosen["stages"], chosen["copies"], chosen["microbatches"], chosen["runs"]) == (16, 4, 256, 1)
    assert chosen["bubble"] == pytest.approx(15 / 271)
    assert chosen["step_s"] == min(r["step_s"] for r in stage_rows(p) if "error" not in r and r["fits"])
    h200 = plan(cfg, gpus=64, gpu="H200", pp=2)["pipeline"]["chosen"]
    assert h200["fits"] and h200["largest"] < 57.1 * GIB


def test_70b_pipeline_recipe_fits_64_gpus_of_80_gb_only_sharded():
    """The mark of issue 23: a 70B-class GPT (80 x 8192) on 64 x 80 GB in at most 16 stages;
    unsharded it needs 32 stages."""
    cfg = load_config(str(RECIPES[0].parent / "gpt-70b-pipeline.yaml"))
    p = plan(cfg, gpus=64, gpu="H100")
    assert 64e9 < p["model"]["params"] < 65e9
    chosen = p["pipeline"]["chosen"]
    assert chosen["stages"] == 16 and chosen["fits"] and chosen["largest"] < 64 * GIB
    unsharded = load_config(str(RECIPES[0].parent / "gpt-70b-pipeline.yaml"), ["parallel.shard=none"])
    rows = {r["stages"]: r for r in stage_rows(plan(unsharded, gpus=64, gpu="H100"))}
    assert not any(r.get("fits") for p, r in rows.items() if p <= 16) and rows[32]["fits"]


def test_llama_1b_recipe_is_llama_3_2_1b_and_fits_80_gb_without_stages():
    """What recipes/llama-1b.yaml's comments promise (`hvdtrain plan ... --gpus 8`)."""
    cfg = load_config(str(RECIPES[0].parent / "llama-1b.yaml"))
    p = plan(cfg, gpus=8, gpu="H100")
    assert p["model"]["params"] == 1_235_814_400  # Llama 3.2 1B's published count
    assert p["memory"]["fits"] and p["memory"]["total"] < 53 * GIB


def test_llama_8b_recipe_is_llama_3_8b_and_fits_80_gb_in_4_stages_on_32_gpus():
    """What recipes/llama-8b-pipeline.yaml's comments promise (`hvdtrain plan ... --gpus 32 --pp 4`)."""
    cfg = load_config(str(RECIPES[0].parent / "llama-8b-pipeline.yaml"))
    p = plan(cfg, gpus=32, gpu="H100", pp=4)
    assert p["model"]["params"] == 8_030_261_248  # Llama 3 8B's published count (untied)
    assert not p["memory"]["fits"]
    chosen = p["pipeline"]["chosen"]
    assert chosen["fits"] and chosen["largest"] < 56 * GIB
    assert (chosen["copies"], chosen["microbatches"], chosen["runs"]) == (8, 32, 1)
    assert chosen["tied_s"] == 0.0  # untied: no embedding gradient to sum between the ends
    h200 = plan(cfg, gpus=32, gpu="H200", pp=2)["pipeline"]["chosen"]
    assert h200["fits"] and h200["largest"] < 88 * GIB


def test_modernbert_base_recipe_is_modernbert_base_and_fits_40_gb():
    """What recipes/modernbert-base.yaml's comments promise (`hvdtrain plan ... --gpus 8`)."""
    cfg = load_config(str(RECIPES[0].parent / "modernbert-base.yaml"))
    p = plan(cfg, gpus=8, gpu="H100")
    assert p["model"]["params"] == 149_655_232  # ModernBERT-base's published count
    assert p["memory"]["fits"] and p["memory"]["total"] < 31 * GIB


def test_llama_8b_recipe_fits_one_node_of_8_gpus_of_80_gb_with_its_state_sharded():
    """Issue 35's first mark: Llama 3 8B at context 8192 on one node of 8 x 80 GB without stages
    (recipes/llama-8b.yaml, `hvdtrain plan ... --gpus 8`): what its comments say of each level."""
    cfg = load_config(str(RECIPES[0].parent / "llama-8b.yaml"))
    assert cfg.parallel.pipeline_stages == 1 and cfg.parallel.shard == "full"
    assert plan(cfg, gpus=8, gpu="H100")["model"]["params"] == 8_030_261_248
    totals = {}
    for level in ("full", "gradients", "optimizer", "none"):
        memory = plan(load_config(str(RECIPES[0].parent / "llama-8b.yaml"), [f"parallel.shard={level}"]),
                      gpus=8, gpu="H100")["memory"]
        totals[level] = (memory["fits"], round(memory["total"] / GIB))
    assert totals == {"full": (True, 29), "gradients": (True, 40), "optimizer": (True, 66), "none": (False, 144)}


def test_gpt3_175b_recipe_fits_256_gpus_of_80_gb_in_16_stages_sharded():
    """Issue 35's second mark: GPT-3 175B (96 x 12288, global batch 1536) on 256 x 80 GB
    (recipes/gpt3-175b.yaml): 16 stages x 16 copies with their gradients sharded, the fastest
    layout that fits; with the optimizer level only 32 stages or more fit, unsharded none up to
    32; fully sharded every depth fits, but gathering the units for each of the 96 micro
    batches makes it over five times slower."""
    cfg = load_config(str(RECIPES[0].parent / "gpt3-175b.yaml"))
    p = plan(cfg, gpus=256, gpu="H100")
    assert 174e9 < p["model"]["params"] < 175e9
    chosen = p["pipeline"]["chosen"]
    assert (chosen["stages"], chosen["copies"], chosen["microbatches"]) == (16, 16, 96)
    assert chosen["fits"] and chosen["largest"] < 49 * GIB
    assert chosen["step_s"] == min(r["step_s"] for r in stage_rows(p) if "error" not in r and r["fits"])
    full = plan(load_config(str(RECIPES[0].parent / "gpt3-175b.yaml"), ["parallel.shard=full"]), gpus=256, gpu="H100")
    assert all(r["fits"] for r in stage_rows(full))
    assert full["pipeline"]["chosen"]["step_s"] > 5 * chosen["step_s"]
    for level, smallest_fitting in (("optimizer", 32), ("none", None)):
        other = load_config(str(RECIPES[0].parent / "gpt3-175b.yaml"), [f"parallel.shard={level}"])
        fitting = [r["stages"] for r in stage_rows(plan(other, gpus=256, gpu="H100")) if r.get("fits")]
        assert (min(fitting) if fitting else None) == smallest_fitting, (level, fitting)


def test_the_fit_table_in_the_docs_is_the_plans():
    """docs/memory.md's table of Llama 3 8B / 70B and GPT-3 175B per sharding level is what
    scripts/fit_table.py computes from the plan today: a change to the plan's terms shows here
    until the table is made again."""
    root = RECIPES[0].parent.parent
    made = subprocess.run([sys.executable, "scripts/fit_table.py"], cwd=root, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert made.count("\n") == 25  # a header, a rule, 3 models x 2 GPUs x 4 levels
    assert made in (root / "docs" / "memory.md").read_text()
