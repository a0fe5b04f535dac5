"""Continued pretraining from Hugging Face folders as they are published (model.pretrained):

* a folder saved in 16 bits (most published Llama-family checkpoints: bfloat16; Llama 2:
  float16) trains from fp32 masters, as the same weights saved in fp32 do, in every family
  and layout, and the run's export says float32;
* a data vocabulary larger than the folder's embedding is refused before anything is written,
  or met by model.resize_embeddings;
* a first run on a local copy of each family's published folder layout (16-bit shards, tied
  and untied heads, generation_config.json, tokenizer files; data.tokenizer the folder) trains,
  and its export keeps what the folder said."""
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import transformers
from transformers import AutoConfig, AutoTokenizer

from helpers import TINY, WORKERS, assert_same_losses, horovodrun, run_cmd, step_losses, write_config
from hvdtrain.config import ModelConfig, config_from_dict, deep_merge
from hvdtrain.data.bundle import synthetic_vocab
from hvdtrain.data.tokenizer import _pretrained, train_tokenizer
from hvdtrain.errors import UserError
from hvdtrain.models import family as model_family
from hvdtrain.models.common import Vocab, build_model, model_blueprint
from hvdtrain.parallel import parallel_dims, pipeline

# Each family's tiny shape (TINY's, with the knobs of tests/test_llama.py and test_modernbert.py)
FAMILIES = {"gpt2": {"arch": "gpt2"}, "bert": {"arch": "bert"}, "llama": {"arch": "llama", "n_kv_head": 1},
            "modernbert": {"arch": "modernbert", "local_attention": 8}}
DTYPES = ("float32", "float16", "bfloat16")
STEPS = 4
RESIZED = ("gpt2", "bert")  # a tied output matrix without and with its own bias


def in_both_16_bit_formats(t: torch.Tensor) -> torch.Tensor:
    """`t` rounded to values that float16 and bfloat16 both hold exactly: bfloat16's 8
    significant bits, and 0 below float16's smallest normal number (2**-14), so that the
    float32, float16 and bfloat16 folders hold the same weights."""
    t = t.to(torch.bfloat16).float()
    return torch.where(t.abs() < 2 ** -14, 0.0, t)


def saved_in_each_dtype(root: Path, model_keys: dict) -> dict[str, Path]:
    """One tiny model of the family, saved by transformers in a float32, a float16 and a
    bfloat16 folder (config.json's dtype says which) holding the same weights."""
    cfg = config_from_dict(deep_merge(TINY, {"model": model_keys}))
    torch.manual_seed(11)
    model = build_model(cfg.model, synthetic_vocab(cfg), cfg.data.seq_len)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(in_both_16_bit_formats(p))
    folders = {}
    for dtype in DTYPES:
        folders[dtype] = root / dtype
        model.to(getattr(torch, dtype)).save_pretrained(folders[dtype], safe_serialization=True)
        assert json.loads((folders[dtype] / "config.json").read_text())["dtype"] == dtype
    return folders


@dataclass
class Run:
    """A run of tests/workers/train_runs.py: its folder, exit code and stderr (a traceback:
    exit None)."""
    out: Path
    exit: int | None = None
    stderr: str = ""

    def assert_trained(self):
        assert self.exit == 0, f"exit {self.exit}: {self.stderr[-3000:]}"
        losses = step_losses(self.out)
        assert sorted(losses) == list(range(1, STEPS + 1)) and all(math.isfinite(v) for v in losses.values())

    def export(self) -> tuple[str, dict]:
        """(config.json's dtype, the weights) of the run's Hugging Face export."""
        with safe_open(str(self.out / "hf" / "model.safetensors"), framework="pt") as f:
            weights = {name: f.get_tensor(name) for name in f.keys()}
        return json.loads((self.out / "hf" / "config.json").read_text())["dtype"], weights


def train_each(np: int, config: Path, runs: dict, results: Path, **kw) -> dict:
    """{key: overrides} -> {key: Run}, the runs made one after the other in one process per
    worker (tests/workers/train_runs.py, which writes `results`): one worker without a
    launcher, as `hvdtrain train` runs, or `np` under horovodrun. Each override list ends with
    its out_dir=."""
    args = [WORKERS / "train_runs.py", results, config]
    for overrides in runs.values():
        args += [*overrides, "--"]
    proc = run_cmd([sys.executable, *args[:-1]], **kw) if np == 1 else horovodrun(np, args[:-1], **kw)
    assert proc.returncode == 0 and results.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    done = json.loads(results.read_text())
    return {key: Run(Path(overrides[-1].removeprefix("out_dir=")), result["exit"], result["stderr"])
            for (key, overrides), result in zip(runs.items(), done)}


def from_each_dtype(folders: dict[str, Path], keys: dict, out: Path, *overrides,
                    dtypes: tuple = DTYPES) -> dict[str, list]:
    """folder dtype -> the overrides of a run continued from that folder."""
    return {dtype: [*(f"model.{k}={v}" for k, v in keys.items()), f"model.pretrained={folders[dtype]}", *overrides,
                    f"out_dir={out / f'from_{dtype}'}"] for dtype in dtypes}


def assert_same_as_from_fp32(runs: dict[str, Run]):
    """The runs from the 16-bit folders equal the run from the float32 one: step losses and
    final weights within 1e-5; each export is float32."""
    for run in runs.values():
        run.assert_trained()
    reference = step_losses(runs["float32"].out)
    dtype, weights = runs["float32"].export()
    assert dtype == "float32"
    for saved in set(runs) - {"float32"}:
        assert_same_losses(reference, step_losses(runs[saved].out), min_steps=STEPS)
        dtype, theirs = runs[saved].export()
        assert dtype == "float32", f"the run from the {saved} folder exported {dtype}"
        assert weights.keys() == theirs.keys()
        for name, value in weights.items():
            assert theirs[name].dtype == torch.float32, (saved, name, theirs[name].dtype)
            assert torch.allclose(value, theirs[name], rtol=0, atol=1e-5), (saved, name)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """family -> dtype -> a folder of the family's tiny model saved in that dtype."""
    root = tmp_path_factory.mktemp("folders")
    return {family: saved_in_each_dtype(root / family, keys) for family, keys in FAMILIES.items()}


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    return write_config(tmp_path_factory.mktemp("config") / "config.yaml", {"train": {"max_steps": STEPS}})


@pytest.fixture(scope="module")
def one_worker_runs(tmp_path_factory, folders, config) -> dict[tuple, Run]:
    """The one-worker runs of this module, all in one process (the imports are most of a tiny
    run's time): ("from", family, folder dtype) continued from that folder; ("published",
    family) from a copy of its published layout on text; ("resized", family) from its float16
    folder of 128 rows on data of 256 tokens; ("refused",) the same without resizing."""
    root = tmp_path_factory.mktemp("one_worker")
    runs = {}
    for family, keys in FAMILIES.items():
        runs.update({("from", family, dtype): overrides
                     for dtype, overrides in from_each_dtype(folders[family], keys, root / family).items()})
    for family in FAMILIES:
        folder = published_folder(root / family / "published", family)
        runs["published", family] = [f"model.arch={family}", f"model.pretrained={folder}", f"data.tokenizer={folder}",
                                     *TEXT, f"data.cache_dir={root / 'cache'}", f"out_dir={root / family / 'run'}"]
    more_tokens = ["data.vocab_size=256", "model.arch=gpt2", f"model.pretrained={folders['gpt2']['float16']}"]
    runs["refused",] = [*more_tokens, f"out_dir={root / 'refused'}"]
    for family in RESIZED:
        runs["resized", family] = ["data.vocab_size=256", f"model.arch={family}",
                                   f"model.pretrained={folders[family]['float16']}", "model.resize_embeddings=true",
                                   f"out_dir={root / family / 'resized'}"]
    return train_each(1, config, runs, root / "results.json", timeout=600)


@pytest.mark.workers
@pytest.mark.parametrize("family", FAMILIES)
def test_a_16_bit_folder_trains_from_fp32_masters_as_its_fp32_copy(one_worker_runs, family):
    assert_same_as_from_fp32({dtype: one_worker_runs["from", family, dtype] for dtype in DTYPES})


LAYOUTS = {"sharded": ["parallel.shard_optimizer=true"], "two_stages": ["parallel.pipeline_stages=2"]}


DEFAULT_LAYOUT_CASE = ("llama", "sharded", "fp32")  # make test's; the rest of the grid is deep


def layout_case(family: str, layout: str, precision: str = "fp32"):
    return pytest.param(family, layout, precision, id=f"{family}-{layout}-{precision}",
                        marks=[] if (family, layout, precision) == DEFAULT_LAYOUT_CASE else pytest.mark.deep)


@pytest.mark.parametrize("family,layout,precision", [
    *(layout_case(family, layout) for family in FAMILIES for layout in LAYOUTS),
    *(layout_case(family, "sharded", precision) for family in FAMILIES for precision in ("bf16", "fp16"))])
@pytest.mark.workers
def test_a_16_bit_folder_trains_from_fp32_masters_in_each_layout(tmp_path, folders, config, family, layout,
                                                                  precision):
    """Two workers (horovodrun), the optimizer sharded between them (its fp32 masters, of
    16-bit weights with train.precision=bf16) or two pipeline stages each loading its own
    tensors: the runs from the 16-bit folders equal the run from the float32 one. Mixed
    precision keeps fp32 masters too. make test's case: the bfloat16 folder (Horovod has no
    bfloat16 ops: its broadcast failed) against the float32 one."""
    default = (family, layout, precision) == DEFAULT_LAYOUT_CASE
    runs = from_each_dtype(folders[family], FAMILIES[family], tmp_path, *LAYOUTS[layout],
                           f"train.precision={precision}", "train.global_batch_size=8",
                           dtypes=("float32", "bfloat16") if default else DTYPES)
    assert_same_as_from_fp32(train_each(2, config, runs, tmp_path / "results.json"))


# ---------------------------------------------------------------- more tokens than embedding rows

def test_fewer_embedding_rows_than_a_tokenizer_s_tokens_names_both_and_the_model_s_tokenizer(folders):
    folder = folders["llama"]["float32"]
    with pytest.raises(UserError) as refused:
        build_model(ModelConfig(arch="llama", pretrained=str(folder)), Vocab(size=130, pad_id=0, origin="data.tokenizer"),
                    seq_len=16)
    assert str(refused.value) == (f"model.pretrained '{folder}' has 128 embedding rows, fewer than the 130 tokens "
                                  f"data.tokenizer gives; set model.resize_embeddings=true to add rows for them, or "
                                  f"data.tokenizer={folder}, the model's own tokenizer")


@pytest.mark.workers
def test_fewer_embedding_rows_than_the_data_s_tokens_is_refused_before_anything_is_written(one_worker_runs, folders):
    refused = one_worker_runs["refused",]
    assert refused.exit == 2, refused.stderr[-3000:]
    assert refused.stderr.strip().splitlines() == [
        f"hvdtrain: error: model.pretrained '{folders['gpt2']['float16']}' has 128 embedding rows, fewer than the "
        f"256 tokens data.vocab_size gives; set model.resize_embeddings=true to add rows for them, or "
        f"data.vocab_size=128"]
    assert not refused.out.exists()


@pytest.mark.parametrize("family", FAMILIES)
def test_resized_embeddings_keep_the_saved_rows_and_start_the_new_ones_at_their_mean(folders, family):
    """model.resize_embeddings: 128 saved rows (bfloat16) for 200 tokens -> 256 fp32 rows, the
    first 128 the saved ones, each added row their mean (the output matrix and its bias too,
    or tied to the embedding); two stages hold the same tensors as the whole model."""
    folder = folders[family]["bfloat16"]
    cfg = ModelConfig(**FAMILIES[family], pretrained=str(folder), resize_embeddings=True)
    saved = AutoConfig.from_pretrained(folder)
    auto = getattr(transformers, model_family(family).auto_class)
    reference = auto.from_pretrained(folder, dtype=torch.float32)
    vocab = Vocab(size=200, pad_id=0)
    torch.manual_seed(0)
    whole = build_model(cfg, vocab, seq_len=16)
    assert whole.config.vocab_size == 256 and saved.vocab_size == 128
    pairs = [(whole.get_input_embeddings().weight, reference.get_input_embeddings().weight)]
    head, saved_head = whole.get_output_embeddings(), reference.get_output_embeddings()
    assert (head.weight is whole.get_input_embeddings().weight) == saved.tie_word_embeddings
    pairs += [(head.weight, saved_head.weight)] + ([(head.bias, saved_head.bias)] if head.bias is not None else [])
    for grown, old in pairs:
        assert grown.dtype == torch.float32 and grown.shape[0] == 256 and old.shape[0] == 128
        assert torch.equal(grown[:128], old)
        assert torch.equal(grown[128:], old.mean(dim=0).expand_as(grown[128:]))
    state = whole.state_dict()
    for s in range(2):
        torch.manual_seed(0)
        blueprint = model_blueprint(cfg, vocab, seq_len=16)
        stage = blueprint.materialise(pipeline.split_model(blueprint.model, parallel_dims.Layout(2, 1, s, 0), [0, 1, 2]))
        for name, value in stage.state_dict().items():
            assert torch.equal(value, state[name]), (s, name)


@pytest.mark.workers
@pytest.mark.parametrize("family", RESIZED)
def test_a_resized_model_trains_and_its_export_loads_in_transformers(one_worker_runs, family):
    run = one_worker_runs["resized", family]
    run.assert_trained()
    auto = getattr(transformers, model_family(family).auto_class)
    model = auto.from_pretrained(run.out / "hf")
    assert model.config.vocab_size == 256 and model.get_input_embeddings().weight.shape[0] == 256
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


# ---------------------------------------------------------------- published folder layouts

TEXTS = [["the quick brown fox jumps over the lazy dog", "a loop runs the statement again and again",
          "Python is a programming language that lets you work quickly"] * 20]
# A few documents of the builtin text, a quarter of them held out: prepared in half a second
TEXT = ["data.source=builtin", "data.max_documents=8", "data.validation_fraction=0.25", "data.seq_len=32",
        "data.num_proc=1", "train.lr=1e-3", "train.precision=bf16"]
# The causal families' own generation settings, which config.json does not hold
GENERATION = {"do_sample": True, "temperature": 0.6, "top_p": 0.9}


def published_folder(folder: Path, family: str) -> Path:
    """A local copy of the family's folder as published (written by save_pretrained): 16-bit
    weights in several safetensors shards with their index, the tokenizer's files, and for
    the causal families a generation_config.json of their own. GPT-2: float16, tied, rows =
    the tokenizer's tokens (its 50257 are no multiple of 64); Llama 3: bfloat16, untied head,
    grouped-query attention, llama3 rope scaling, reserved special tokens; BERT: float16, its
    decoder tied with a bias; ModernBERT: bfloat16, more rows than tokens (50368 for 50280)."""
    from transformers import (BertConfig, GenerationConfig, GPT2Config, LlamaConfig, ModernBertConfig)

    tokenizer = train_tokenizer(TEXTS, family, vocab_size=300)
    if family == "llama":
        tokenizer.add_special_tokens({"additional_special_tokens": [f"<|reserved_special_token_{i}|>"
                                                                    for i in range(6)]})
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(5)
    if family == "gpt2":
        config, dtype = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=64, **ids), \
            torch.float16
    elif family == "llama":
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                             tie_word_embeddings=False, **ids,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                              "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                              "original_max_position_embeddings": 64})
        dtype = torch.bfloat16
    elif family == "bert":
        config, dtype = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                                   pad_token_id=tokenizer.pad_token_id), torch.float16
    else:
        config = ModernBertConfig(vocab_size=len(tokenizer) + 40, hidden_size=32, num_hidden_layers=3,
                                  num_attention_heads=2, intermediate_size=48, max_position_embeddings=128,
                                  local_attention=16, pad_token_id=tokenizer.pad_token_id,
                                  cls_token_id=tokenizer.cls_token_id, sep_token_id=tokenizer.sep_token_id,
                                  bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id)
        dtype = torch.bfloat16
    auto = getattr(transformers, model_family(family).auto_class)
    model = auto.from_config(config, dtype=dtype)
    if model_family(family).causal:
        model.generation_config = GenerationConfig(**ids, **GENERATION)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="30KB")
    tokenizer.save_pretrained(folder)
    assert len(list(folder.glob("model-*.safetensors"))) > 1 and (folder / "model.safetensors.index.json").is_file()
    return folder


@pytest.mark.workers
@pytest.mark.parametrize("family", FAMILIES)
def test_a_published_folder_layout_continues_pretraining_and_exports_what_it_said(one_worker_runs, family):
    """data.tokenizer the folder, bf16 autocast: the run starts from the folder's weights (the
    export moved them by less than its 4 steps of lr 1e-3) and exports float32 weights with the
    folder's vocabulary, head, rope scaling, tokenizer and generation settings."""
    run = one_worker_runs["published", family]
    run.assert_trained()
    folder, hf = run.out.parent / "published", run.out / "hf"
    auto = getattr(transformers, model_family(family).auto_class)
    saved, ours = auto.from_pretrained(folder, dtype=torch.float32), auto.from_pretrained(hf)
    for key in ("vocab_size", "tie_word_embeddings", "rope_parameters"):
        assert getattr(ours.config, key, None) == getattr(saved.config, key, None), key
    assert json.loads((hf / "config.json").read_text())["dtype"] == "float32"
    theirs = saved.state_dict()
    for name, value in ours.state_dict().items():
        assert value.dtype == torch.float32 and (value - theirs[name]).abs().max() < 4e-3, name
    assert any((value != theirs[name]).any() for name, value in ours.state_dict().items())
    assert len(AutoTokenizer.from_pretrained(hf)) == len(AutoTokenizer.from_pretrained(folder))
    if model_family(family).causal:
        generation = json.loads((hf / "generation_config.json").read_text())
        assert {key: generation.get(key) for key in GENERATION} == GENERATION


def test_a_folder_without_tokenizer_files_is_refused_not_read_as_an_empty_tokenizer(folders):
    """transformers makes an empty tokenizer of the config's model type from a folder of
    weights alone: every text would become no tokens at all."""
    folder = folders["gpt2"]["float32"]
    with pytest.raises(UserError, match=f"config key 'data.tokenizer': '{folder}' has no tokenizer files") as refused:
        _pretrained(str(folder))
    assert len(str(refused.value).splitlines()) == 1


def exports_within(a: Run, b: Run, atol: float):
    """Two runs' exports hold the same tensors to `atol`."""
    (_, ours), (_, theirs) = a.export(), b.export()
    assert ours.keys() == theirs.keys()
    for name, value in ours.items():
        assert torch.allclose(value, theirs[name], rtol=0, atol=atol), (name, (value - theirs[name]).abs().max())


@pytest.mark.deep
@pytest.mark.workers
def test_a_published_folder_and_resized_embeddings_in_two_stages_equal_one_worker(tmp_path, folders, config):
    """Stage-local loading of the published Llama layout (untied, bfloat16 shards) and of
    resized embeddings (tied: the first and last stage each add the same rows): the same
    losses and weights as one worker, to rounding (tests/helpers.py two_stages_equal_one_worker)."""
    folder = published_folder(tmp_path / "published", "llama")
    runs = {"published": ["model.arch=llama", f"model.pretrained={folder}", f"data.tokenizer={folder}", *TEXT,
                          f"data.cache_dir={tmp_path / 'cache'}", "train.global_batch_size=8"],
            "resized": ["data.vocab_size=256", "model.arch=gpt2", f"model.pretrained={folders['gpt2']['bfloat16']}",
                        "model.resize_embeddings=true", "train.global_batch_size=8"]}
    one = train_each(1, config, {k: [*v, f"out_dir={tmp_path / k / 'one'}"] for k, v in runs.items()},
                     tmp_path / "one.json")
    two = train_each(2, config, {k: [*v, "parallel.pipeline_stages=2", f"out_dir={tmp_path / k / 'two'}"]
                                 for k, v in runs.items()}, tmp_path / "two.json")
    for key in runs:
        one[key].assert_trained()
        two[key].assert_trained()
        assert_same_losses(step_losses(one[key].out), step_losses(two[key].out), min_steps=STEPS)
        exports_within(one[key], two[key], atol=1e-4)
