"""A model folder someone hands you is data, never code: every load path (generate, fill-mask,
model.pretrained, export, a pretrained tokenizer) reads safetensors weights only and runs no
Python from the folder. The folders here carry a trap: a pytorch_model.bin whose unpickling
creates a marker file, or an auto_map in config.json naming a module that creates it when
imported. Loading must never create the marker, never ask (stdin is closed), and fail with one
line when it cannot load without them."""
import json
import pickle
import subprocess

import pytest
import torch
from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          MixtralConfig, MixtralForCausalLM, ModernBertConfig, ModernBertForMaskedLM)

from helpers import BIN, OFFLINE
from hvdtrain.config import ModelConfig
from hvdtrain.data.tokenizer import _pretrained, train_tokenizer
from hvdtrain.errors import UserError
from hvdtrain.checkpointing.export import checkpoint_config
from hvdtrain.models.common import Vocab, build_model

TEXTS = [["the quick brown fox jumps over the lazy dog", "a loop runs the statement again and again"] * 20]
CUSTOM_CODE = "import pathlib; pathlib.Path({marker!r}).touch()\n"


class MakesAMarker:
    """Unpickled, it opens (creates) the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def model_folder(folder, arch: str):
    """A tiny model with its tokenizer, as `hvdtrain export` writes it (model.safetensors)."""
    tokenizer = train_tokenizer(TEXTS, arch, vocab_size=100)
    torch.manual_seed(0)
    if arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2, n_positions=32))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, intermediate_size=32,
                                             max_position_embeddings=32))
    elif arch == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1,
                                                 num_attention_heads=2, num_key_value_heads=1, intermediate_size=16,
                                                 num_local_experts=4, num_experts_per_tok=2,
                                                 max_position_embeddings=32))
    elif arch == "modernbert":
        model = ModernBertForMaskedLM(ModernBertConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=2,
                                                       num_attention_heads=2, intermediate_size=24,
                                                       max_position_embeddings=32, local_attention=8,
                                                       pad_token_id=tokenizer.pad_token_id,
                                                       cls_token_id=tokenizer.cls_token_id,
                                                       sep_token_id=tokenizer.sep_token_id,
                                                       bos_token_id=tokenizer.cls_token_id,
                                                       eos_token_id=tokenizer.sep_token_id))
    else:
        model = BertForMaskedLM(BertConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1,
                                           num_attention_heads=2, intermediate_size=32, max_position_embeddings=32))
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def with_pickled_weights(folder, marker):
    """No model.safetensors, another .safetensors file, and a pytorch_model.bin that is a trap."""
    (folder / "model.safetensors").rename(folder / "other.safetensors")
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"weight": MakesAMarker(marker)}))
    return folder


def with_custom_code(folder, marker):
    """config.json (and the tokenizer's config) name a module of the folder through auto_map; the
    model type is one transformers does not know, so only that code could build it."""
    (folder / "modeling_trap.py").write_text(CUSTOM_CODE.format(marker=str(marker)))
    for name, entries in (("config.json", {"AutoConfig": "modeling_trap.TrapConfig",
                                           "AutoModelForCausalLM": "modeling_trap.TrapModel",
                                           "AutoModelForMaskedLM": "modeling_trap.TrapModel"}),
                          ("tokenizer_config.json", {"AutoTokenizer": ["modeling_trap.TrapTokenizer", None]})):
        config = json.loads((folder / name).read_text())
        config["auto_map"] = entries
        if name == "config.json":
            config["model_type"] = "trap"
        (folder / name).write_text(json.dumps(config))
    return folder


TRAPS = {"pickled weights": with_pickled_weights, "custom code": with_custom_code}
COMMANDS = {"gpt2": ["generate", "Once", "--max-new-tokens", "3"], "bert": ["fill-mask", "the [MASK] fox"],
            "llama": ["generate", "Once", "--max-new-tokens", "3"], "modernbert": ["fill-mask", "the [MASK] fox"],
            "mixtral": ["generate", "Once", "--max-new-tokens", "3"]}


def run_closed_stdin(args) -> subprocess.CompletedProcess:
    """hvdtrain with stdin closed, as a batch job runs it: a prompt would read end of file."""
    import os
    return subprocess.run([str(BIN / "hvdtrain"), *map(str, args)], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, env=dict(os.environ, **OFFLINE))


@pytest.mark.workers
@pytest.mark.parametrize("arch", ["gpt2", "bert", *(pytest.param(a, marks=pytest.mark.deep) for a in ("llama", "modernbert", "mixtral"))])
def test_generate_and_fill_mask_load_a_clean_folder(tmp_path, arch):
    proc = run_closed_stdin([COMMANDS[arch][0], model_folder(tmp_path / "model", arch), *COMMANDS[arch][1:]])
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.workers
@pytest.mark.parametrize("trap", TRAPS)
@pytest.mark.parametrize("arch", ["gpt2", "bert", *(pytest.param(a, marks=pytest.mark.deep) for a in ("llama", "modernbert"))])
def test_generate_and_fill_mask_never_unpickle_nor_run_the_folder_s_code(tmp_path, arch, trap):
    marker = tmp_path / "marker"
    folder = TRAPS[trap](model_folder(tmp_path / "model", arch), marker)
    proc = run_closed_stdin([COMMANDS[arch][0], folder, *COMMANDS[arch][1:]])
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"hvdtrain: error: '{folder}'"), proc.stderr
    assert "[y/N]" not in proc.stdout + proc.stderr  # never asked
    assert not marker.exists()


@pytest.mark.parametrize("trap", TRAPS)
@pytest.mark.parametrize("arch", ["gpt2", "bert", "llama", "modernbert"])
def test_model_pretrained_never_unpickles_nor_runs_the_folder_s_code(tmp_path, arch, trap, capsys):
    marker = tmp_path / "marker"
    folder = TRAPS[trap](model_folder(tmp_path / "model", arch), marker)
    with pytest.raises(UserError, match="model.pretrained"):
        build_model(ModelConfig(arch=arch, pretrained=str(folder)), Vocab(size=100, pad_id=0), seq_len=16)
    assert "[y/N]" not in capsys.readouterr().out
    assert not marker.exists()


@pytest.mark.parametrize("arch", ["gpt2", "bert", "llama", "modernbert"])
def test_export_reads_a_checkpoint_s_config_without_its_code(tmp_path, arch, capsys):
    """A checkpoint folder's config.json with auto_map: the code is neither asked for nor run."""
    marker = tmp_path / "marker"
    folder = with_custom_code(model_folder(tmp_path / "model", arch), marker)
    with pytest.raises(UserError, match="could not read config.json"):
        checkpoint_config(folder)
    assert "[y/N]" not in capsys.readouterr().out
    assert not marker.exists()


def test_a_pretrained_tokenizer_never_runs_the_folder_s_code(tmp_path, capsys):
    marker = tmp_path / "marker"
    folder = with_custom_code(model_folder(tmp_path / "model", "bert"), marker)
    (folder / "config.json").unlink()  # a tokenizer folder, whose class only the auto_map names
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["tokenizer_class"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="config key 'data.tokenizer': could not load .* contains custom code"):
        _pretrained(str(folder))
    assert "[y/N]" not in capsys.readouterr().out
    assert not marker.exists()


@pytest.mark.parametrize("arch,folder_arch", [("gpt2", "bert"), ("bert", "gpt2"), ("llama", "gpt2"), ("gpt2", "llama"),
                                              ("modernbert", "bert"), ("bert", "modernbert")])
def test_a_pretrained_folder_of_another_family_is_refused(tmp_path, arch, folder_arch):
    folder = model_folder(tmp_path / "model", folder_arch)
    with pytest.raises(UserError, match=f"model.pretrained '{folder}'") as refused:
        build_model(ModelConfig(arch=arch, pretrained=str(folder)), Vocab(size=100, pad_id=0), seq_len=16)
    assert len(str(refused.value).splitlines()) == 1
