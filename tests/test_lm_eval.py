"""hvdtrain's exports scored by EleutherAI's lm-evaluation-harness (docs/research.md): GPT-2 and
Llama runs' hf/ folders and a checkpoint exported mid-run load in its `hf` model type and score a
local multiple-choice task (loglikelihood) and a perplexity task (loglikelihood_rolling), with
the command the docs give, offline."""
import json

import pytest

from helpers import BIN, hvdtrain, run_cmd

pytest.importorskip("lm_eval", reason="make test-deep installs lm_eval (the eval extra: pip install -e .[test,eval])")

QUESTIONS = [
    {"question": "The Python language is", "choices": [" a programming language", " a river"], "answer": 0},
    {"question": "A for loop", "choices": [" repeats a block", " is a colour"], "answer": 0},
    {"question": "Functions are defined with", "choices": [" the def keyword", " a hammer"], "answer": 0},
]
TEXTS = [{"text": "Python is a high-level programming language. Its design emphasizes code readability."},
         {"text": "Lists, dictionaries and sets are built into the language."}]
MULTIPLE_CHOICE = """\
task: hvdtrain_choice
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
PERPLEXITY = """\
task: hvdtrain_perplexity
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data}}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
"""


def write_tasks(folder):
    folder.mkdir()
    for name, rows, template in (("choice", QUESTIONS, MULTIPLE_CHOICE), ("perplexity", TEXTS, PERPLEXITY)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        (folder / f"{name}.yaml").write_text(template.format(data=folder / f"{name}.jsonl"))


def train_run(tiny_config, out, arch: str):
    config = tiny_config({"model": {"arch": arch}, "data": {"source": "builtin", "tokenizer": "train", "vocab_size": 512,
                                                           "seq_len": 32, "validation_fraction": 0.1},
                          "train": {"max_steps": 4}, "checkpoint": {"every": 2, "keep": 2}}, name=f"{arch}.yaml")
    proc = hvdtrain("train", config, f"out_dir={out}")
    assert proc.returncode == 0, proc.stderr[-2000:]


def score(model_dir, tasks, results):
    """The docs' command: lm_eval's hf model type on an exported folder, the tasks of a folder."""
    proc = run_cmd([BIN / "lm_eval", "--model", "hf", "--model_args", f"pretrained={model_dir},dtype=float32",
                    "--tasks", "hvdtrain_choice,hvdtrain_perplexity", "--include_path", tasks, "--device", "cpu",
                    "--batch_size", "4", "--output_path", results], timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    scores = json.loads(next(results.rglob("results_*.json")).read_text())["results"]
    return scores["hvdtrain_choice"], scores["hvdtrain_perplexity"]


@pytest.mark.workers
@pytest.mark.deep
def test_lm_eval_scores_exported_gpt2_and_llama_folders_and_a_mid_run_checkpoint(tmp_path, tiny_config):
    tasks = tmp_path / "tasks"
    write_tasks(tasks)
    gpt, llama = tmp_path / "gpt", tmp_path / "llama"
    train_run(tiny_config, gpt, "gpt2")
    train_run(tiny_config, llama, "llama")
    mid = tmp_path / "step2"
    proc = hvdtrain("export", gpt / "checkpoints" / "step_00000002", mid)
    assert proc.returncode == 0, proc.stderr
    for name, folder in (("gpt", gpt / "hf"), ("llama", llama / "hf"), ("mid", mid)):
        choice, perplexity = score(folder, tasks, tmp_path / f"results-{name}")
        assert 0 <= choice["acc,none"] <= 1, choice
        assert 1 < perplexity["word_perplexity,none"] < float("inf") and perplexity["bits_per_byte,none"] > 0
