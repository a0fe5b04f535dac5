"""The tiny recipes end to end with real workers: training lowers the validation loss, the
exported folder loads with transformers alone, generation and fill-mask run; local corpora,
the tokenization cache, and a hub dataset while offline."""
import json
import sys

import pytest
import torch

from helpers import REPO, hvdtrain, read_metrics, run_cmd

pytestmark = pytest.mark.workers

LOADS_WITHOUT_HVDTRAIN = """
import sys
sys.modules["hvdtrain"] = None  # any import of hvdtrain now fails
from transformers import AutoModelFor{kind}, AutoTokenizer
model = AutoModelFor{kind}.from_pretrained(sys.argv[1])
tok = AutoTokenizer.from_pretrained(sys.argv[1])
print(type(model).__name__, len(tok))
"""

# transformers' own text-generation pipeline on the folder, without hvdtrain
PIPELINE_GENERATES = """
import sys
sys.modules["hvdtrain"] = None
from transformers import pipeline
out = pipeline("text-generation", model=sys.argv[1])("The Python language", max_new_tokens=10, do_sample=False)
print(out[0]["generated_text"])
"""

# transformers' own fill-mask pipeline on the folder, without hvdtrain: its guesses as JSON
# (a byte-level tokenizer may guess a line break)
PIPELINE_FILLS_MASK = """
import json, sys
sys.modules["hvdtrain"] = None
from transformers import pipeline
fill = pipeline("fill-mask", model=sys.argv[1])
print(json.dumps([g["sequence"] for g in fill(f"the {fill.tokenizer.mask_token} statement is used in a loop.", top_k=3)]))
"""


@pytest.mark.parametrize("recipe,kind,model_class,steps", [("gpt-tiny", "CausalLM", "GPT2LMHeadModel", 40),
                                                           pytest.param("bert-tiny", "MaskedLM", "BertForMaskedLM", 40,
                                                                        marks=pytest.mark.deep),
                                                           pytest.param("llama-tiny", "CausalLM", "LlamaForCausalLM", 40,
                                                                        marks=pytest.mark.deep),
                                                           pytest.param("modernbert-tiny", "MaskedLM",
                                                                        "ModernBertForMaskedLM", 40,
                                                                        marks=pytest.mark.deep)])
def test_tiny_recipe_trains_exports_and_runs(tmp_path, recipe, kind, model_class, steps):
    out = tmp_path / "run"
    proc = hvdtrain("launch", "-np", "2", REPO / "recipes" / f"{recipe}.yaml", f"out_dir={out}",
                    f"train.max_steps={steps}", "train.warmup_steps=10", "checkpoint.every=20", "eval.every=20",
                    "log.progress=false", f"data.cache_dir={tmp_path / 'cache'}", timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    evals = {e["step"]: e["eval_loss"] for e in read_metrics(out)[1]}
    assert sorted(evals) == [0, 20, steps]
    print(f"{recipe}: eval loss {evals[0]:.3f} -> {evals[steps]:.3f}")
    assert evals[steps] < evals[0] - 1.0, evals  # clearly lower: more than 1 nat

    exported = tmp_path / "exported"
    assert hvdtrain("export", out, exported).returncode == 0
    check = run_cmd([sys.executable, "-c", LOADS_WITHOUT_HVDTRAIN.format(kind=kind), exported])
    assert check.returncode == 0, check.stderr[-2000:]
    assert check.stdout.startswith(model_class)

    if kind == "CausalLM":
        proc = hvdtrain("generate", exported, "The Python language", "--max-new-tokens", "20")
        assert proc.returncode == 0 and proc.stdout.startswith("The Python language"), proc.stderr[-2000:]
        assert len(proc.stdout.split()) > 3
        generated = run_cmd([sys.executable, "-c", PIPELINE_GENERATES, exported])
        assert generated.returncode == 0 and generated.stdout.startswith("The Python language"), \
            generated.stderr[-2000:]
    else:
        proc = hvdtrain("fill-mask", exported, "the [MASK] statement is used in a loop.")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert len(proc.stdout.strip().splitlines()) == 5
        filled = run_cmd([sys.executable, "-c", PIPELINE_FILLS_MASK, exported])
        assert filled.returncode == 0, filled.stderr[-2000:]
        guesses = json.loads(filled.stdout.strip().splitlines()[-1])
        assert len(guesses) == 3 and all(g.endswith("statement is used in a loop.") for g in guesses), guesses


@pytest.mark.deep
def test_tiny_pipeline_recipe_trains_in_two_stages(tmp_path):
    """recipes/gpt-tiny-pipeline.yaml on 2 workers: one pipeline of 2 stages, end to end."""
    out = tmp_path / "run"
    proc = hvdtrain("launch", "-np", "2", REPO / "recipes" / "gpt-tiny-pipeline.yaml", f"out_dir={out}",
                    "train.max_steps=40", "train.warmup_steps=10", "checkpoint.every=20", "eval.every=20",
                    "log.progress=false", f"data.cache_dir={tmp_path / 'cache'}", timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "on stage 0 of 2 (1f1b, 4 micro batches per run, ideal bubble 20%" in proc.stdout
    train, evals = read_metrics(out)
    assert train[-1]["step"] == 40 and train[-1]["global_batch"] == 32
    assert all(r["time_pipeline"] > 0 and r["time_forward"] == 0 for r in train)
    evals = {e["step"]: e["eval_loss"] for e in evals}
    assert sorted(evals) == [0, 20, 40]
    print(f"gpt-tiny-pipeline: eval loss {evals[0]:.3f} -> {evals[40]:.3f}")
    assert evals[40] < evals[0] - 1.0, evals
    from hvdtrain.checkpointing.checkpoint import list_checkpoints
    newest = list_checkpoints(out)[-1]
    parts = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}  # one per stage
    assert parts <= {p.name for p in newest.iterdir()}
    # the run's Hugging Face folder is the whole model again
    check = run_cmd([sys.executable, "-c", LOADS_WITHOUT_HVDTRAIN.format(kind="CausalLM"), out / "hf"])
    assert check.returncode == 0 and check.stdout.startswith("GPT2LMHeadModel"), check.stderr[-2000:]


@pytest.mark.parametrize("recipe,suffix", [("gpt-tiny", ".txt"), pytest.param("gpt-tiny", ".jsonl", marks=pytest.mark.deep),
                                           pytest.param("llama-tiny", ".txt", marks=pytest.mark.deep)])
def test_local_corpus_and_tokenization_cache(tmp_path, recipe, suffix):
    from hvdtrain.data.text import builtin_corpus
    docs = builtin_corpus()[:40]
    corpus = tmp_path / f"corpus{suffix}"
    if suffix == ".txt":
        corpus.write_text("\n\n".join(docs))
    else:
        corpus.write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    column = "data.text_column=" + ("text" if suffix == ".txt" else "body")
    args = ["train", REPO / "recipes" / f"{recipe}.yaml", f"data.source={corpus}", column,
            "data.vocab_size=512", "data.seq_len=32", "train.max_steps=2", "train.micro_batch_size=2",
            "train.global_batch_size=null", "data.num_workers=0", "eval.batches=1", "log.progress=false",
            f"data.cache_dir={tmp_path / 'cache'}"]
    first = hvdtrain(*args, f"out_dir={tmp_path / 'a'}")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert "cache hit" not in first.stdout
    second = hvdtrain(*args, f"out_dir={tmp_path / 'b'}")
    assert second.returncode == 0
    assert "tokenizer: cache hit" in second.stdout
    assert second.stdout.count("tokens, cache hit") == 2  # train and validation blocks reused
    assert read_metrics(tmp_path / "b")[0][-1]["step"] == 2


def test_hub_dataset_while_offline_is_one_clear_line(tmp_path):
    out = tmp_path / "run"
    proc = hvdtrain("train", REPO / "recipes" / "gpt-tiny.yaml", "data.source=Salesforce/wikitext",
                    "data.hub_config=wikitext-103-raw-v1", f"out_dir={out}", f"data.cache_dir={tmp_path / 'c'}")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Salesforce/wikitext" in lines[0] and "data.source" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def test_continue_pretraining_from_an_exported_model(tmp_path):
    """Phase 2 of the BERT recipes: model.pretrained loads phase 1's hf/ folder, weights and
    tokenizer, and trains on at a longer sequence length."""
    common = [REPO / "recipes" / "bert-tiny.yaml", "data.vocab_size=512", "train.micro_batch_size=4",
              "train.global_batch_size=null", "eval.batches=1", "log.progress=false",
              f"data.cache_dir={tmp_path / 'cache'}"]
    phase1, phase2 = tmp_path / "phase1", tmp_path / "phase2"
    assert hvdtrain("train", *common, "data.seq_len=32", "model.max_position=64", "train.max_steps=3",
                    f"out_dir={phase1}").returncode == 0
    # A phase-1 model without room for the longer sequences is refused with a clear message.
    short = hvdtrain("train", *common, "data.seq_len=128", f"model.pretrained={phase1 / 'hf'}", f"out_dir={phase2}")
    assert short.returncode == 2 and "has 64 positions, fewer than data.seq_len=128" in short.stderr
    assert not phase2.exists()
    # lr ~0: phase 2 must end with exactly the weights it loaded (not a fresh initialisation)
    proc = hvdtrain("train", *common, "data.seq_len=64", "train.max_steps=2", "train.lr=1e-30",
                    "train.weight_decay=0", f"model.pretrained={phase1 / 'hf'}", f"out_dir={phase2}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    from safetensors.torch import load_file
    before, after = load_file(str(phase1 / "hf" / "model.safetensors")), load_file(str(phase2 / "hf" / "model.safetensors"))
    assert before.keys() == after.keys()
    for name in before:
        assert torch.allclose(before[name], after[name], atol=1e-6), name
    assert read_metrics(phase2)[0][-1]["step"] == 2
