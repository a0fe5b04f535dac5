"""The export writes a Hugging Face folder from a checkpoint's parts one safetensors file at a time
(hvdtrain/checkpointing/export.py): the hub's sharded layout, the unsplit model's logits, and a
peak memory of about one file, not the whole model."""
import json
import math
import multiprocessing

import pytest
import torch
import transformers
from safetensors.torch import save_model

from hvdtrain.checkpointing import checkpoint
from hvdtrain.checkpointing.export import export_checkpoint
from hvdtrain.models.model_build import PeakRise
from hvdtrain.models.ties import tie_aliases

CONFIGS = {
    "gpt2": (transformers.GPT2LMHeadModel, transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128)),
    "bert": (transformers.BertForMaskedLM, transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=128)),
    "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=128, tie_word_embeddings=False)),
    "mixtral": (transformers.MixtralForCausalLM, transformers.MixtralConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=128)),
    "modernbert": (transformers.ModernBertForMaskedLM, transformers.ModernBertConfig(
        num_hidden_layers=3, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=128,
        global_attn_every_n_layers=3, local_attention=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        cls_token_id=1, sep_token_id=2)),
}


def sliced_checkpoint(folder, model, parts: int):
    """A checkpoint as `parts` copies of a sharded optimizer write it: each a flat slice of every tensor."""
    folder.mkdir()
    model.config.save_pretrained(folder)
    unique = {}
    for name, tensor in model.state_dict().items():  # a tied tensor once, as save_model writes it
        if all(tensor.data_ptr() != t.data_ptr() for t in unique.values()):
            unique[name] = tensor
    for index in range(parts):
        weights = {}
        for name, tensor in unique.items():
            flat = tensor.detach().reshape(-1)
            step = math.ceil(flat.numel() / parts)
            weights[name] = (flat[index * step:(index + 1) * step].clone(), index * step, tuple(tensor.shape))
        checkpoint.write_slices(folder, index, parts, weights, {})


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_a_streamed_export_is_the_hub_layout_and_gives_the_model_s_logits(tmp_path, arch):
    cls, config = CONFIGS[arch]
    torch.manual_seed(0)
    model = cls(config).eval()
    ckpt = tmp_path / "step_00000002"
    if arch in ("gpt2", "modernbert"):  # the two ways a checkpoint holds weights: whole, or sliced by copies
        ckpt.mkdir()
        model.config.save_pretrained(ckpt)
        save_model(model, str(ckpt / "model.safetensors"))
    else:
        sliced_checkpoint(ckpt, model, parts=2)
    out = tmp_path / "hf"
    export_checkpoint(ckpt, None, out, max_shard_bytes=20_000)

    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(files) > 1 and sorted(set(index["weight_map"].values())) == files
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    for names in tie_aliases(model).values():  # a tied matrix written once
        assert sum(n in index["weight_map"] for n in names) <= 1

    loaded = cls.from_pretrained(out).eval()
    ids = torch.randint(3, 128, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    if model.can_generate():
        assert (out / "generation_config.json").is_file()


def _export_peak(ckpt, out, max_shard_bytes, queue):
    import transformers  # noqa: F401 (the imports are not the export's memory)
    from huggingface_hub import split_torch_state_dict_into_shards  # noqa: F401
    from transformers.modeling_utils import remove_tied_weights_from_state_dict  # noqa: F401
    with PeakRise() as peak:
        export_checkpoint(ckpt, None, out, max_shard_bytes=max_shard_bytes)
    queue.put(peak.rise)


@pytest.mark.workers
def test_the_export_holds_about_one_file_not_the_whole_model(tmp_path):
    """A 12 x 256 GPT (40 MiB of fp32 weights) exported in files of 4 MB: the export process's
    peak rises by far less than the model (12 MiB measured; in one file: 49 MiB, and the former
    export rebuilt the whole model, then save_pretrained held it again)."""
    config = transformers.GPT2Config(n_layer=12, n_embd=256, n_head=4, vocab_size=4096, n_positions=128)
    model = transformers.GPT2LMHeadModel(config)
    whole = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in model.state_dict().values()}.values())
    ckpt = tmp_path / "step_00000001"
    ckpt.mkdir()
    model.config.save_pretrained(ckpt)
    save_model(model, str(ckpt / "model.safetensors"))
    del model

    context = multiprocessing.get_context("spawn")  # a fresh process: nothing freed before is reused
    queue = context.Queue()
    process = context.Process(target=_export_peak, args=(ckpt, tmp_path / "hf", 4 * 10 ** 6, queue))
    process.start()
    rise = queue.get(timeout=300)
    process.join()
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 5
    assert rise < 0.5 * whole, f"the export's peak rose by {rise / 2**20:.1f} MiB for a {whole / 2**20:.1f} MiB model"
