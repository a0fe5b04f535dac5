"""hvdtrain.data.packing: blocks hold every token of the corpus, in order, once (apart
from the documented tail), and a second run reads them from the cache."""
import logging
import time

import datasets
import numpy as np
import pytest

from hvdtrain.config import DataConfig
from hvdtrain.data.packing import load_or_pack, pack_causal_lm, pack_masked_lm
from hvdtrain.data.text import builtin_corpus
from hvdtrain.data.tokenizer import train_tokenizer
from hvdtrain.errors import UserError

DOCS = ["Short one.", "A somewhat longer document about the weather in spring and autumn.",
        "x", "Numbers 1 2 3 and symbols $ % & too.", "The last document ends here."] * 7


@pytest.fixture(scope="module")
def tokenizers():
    corpus = builtin_corpus()
    return {arch: train_tokenizer(corpus, arch, vocab_size=600) for arch in ("gpt2", "bert")}


def stream(tokenizer, docs, separator):
    """The expected token stream, built one document at a time without `datasets`."""
    return [t for doc in docs for t in tokenizer(doc, add_special_tokens=False)["input_ids"] + [separator]]


@pytest.mark.parametrize("num_proc", [1, 2])
def test_causal_blocks_are_the_token_stream_in_order(tokenizers, num_proc):
    tok = tokenizers["gpt2"]
    expected = stream(tok, DOCS, tok.eos_token_id)
    blocks = pack_causal_lm(datasets.Dataset.from_dict({"text": DOCS}), tok, seq_len=16, num_proc=num_proc)
    assert blocks.dtype == np.int32 and blocks.shape == (len(expected) // 16, 16)
    assert blocks.ravel().tolist() == expected[:blocks.size]
    assert len(expected) - blocks.size < 16, "only a tail shorter than one block is dropped"


@pytest.mark.parametrize("num_proc", [1, 2])
def test_masked_blocks_are_cls_chunk_sep(tokenizers, num_proc):
    tok = tokenizers["bert"]
    expected = stream(tok, DOCS, tok.sep_token_id)
    blocks = pack_masked_lm(datasets.Dataset.from_dict({"text": DOCS}), tok, seq_len=16, num_proc=num_proc)
    assert blocks.dtype == np.int32 and blocks.shape == (len(expected) // 14, 16)
    assert (blocks[:, 0] == tok.cls_token_id).all() and (blocks[:, -1] == tok.sep_token_id).all()
    assert blocks[:, 1:-1].ravel().tolist() == expected[:len(blocks) * 14]
    assert tok.pad_token_id not in blocks


def test_a_long_document_spans_many_blocks(tokenizers):
    tok = tokenizers["gpt2"]
    long_doc = " ".join(f"word{i}" for i in range(20_000))
    blocks = pack_causal_lm(datasets.Dataset.from_dict({"text": [long_doc]}), tok, seq_len=64, num_proc=1)
    expected = stream(tok, [long_doc], tok.eos_token_id)
    assert len(blocks) == len(expected) // 64 > 100
    assert blocks.ravel().tolist() == expected[:blocks.size]


def test_the_cache_is_reused_and_faster(tmp_path, tokenizers, caplog):
    caplog.set_level(logging.INFO, logger="hvdtrain.data.packing")
    cfg, texts = DataConfig(seq_len=64), builtin_corpus()

    start = time.perf_counter()
    packed = load_or_pack(cfg, "gpt2", texts, tokenizers["gpt2"], tmp_path, "train")
    miss_seconds = time.perf_counter() - start
    assert "packed and cached" in caplog.text
    caplog.clear()

    start = time.perf_counter()
    cached = load_or_pack(cfg, "gpt2", texts, tokenizers["gpt2"], tmp_path, "train")
    hit_seconds = time.perf_counter() - start
    assert "cache hit" in caplog.text
    assert isinstance(cached, np.memmap) and not cached.flags.writeable
    assert np.array_equal(cached, packed) and cached.shape[1] == 64
    assert hit_seconds < miss_seconds / 5, (hit_seconds, miss_seconds)
    print(f"packing builtin corpus: {miss_seconds:.3f}s, cache hit: {hit_seconds:.4f}s")

    caplog.clear()  # anything that changes the blocks is a new entry
    load_or_pack(DataConfig(seq_len=32), "gpt2", texts, tokenizers["gpt2"], tmp_path, "train")
    load_or_pack(cfg, "gpt2", texts, train_tokenizer(texts, "gpt2", vocab_size=500), tmp_path, "train")
    load_or_pack(cfg, "gpt2", texts.select(range(10)), tokenizers["gpt2"], tmp_path, "train")
    assert "cache hit" not in caplog.text
    assert len(list((tmp_path / "tokenized").glob("*/train.npy"))) == 4
    assert not list((tmp_path / "tokenized").glob("*/.*")), "no temporary leftovers"


def test_too_little_text_for_one_block_names_source_and_seq_len(tmp_path, tokenizers):
    cfg = DataConfig(source="tiny.txt", seq_len=512)
    texts = datasets.Dataset.from_dict({"text": ["Far too short."]})
    with pytest.raises(UserError, match=r"data.source 'tiny.txt'.*data.seq_len=512"):
        load_or_pack(cfg, "bert", texts, tokenizers["bert"], tmp_path, "validation")
    assert not (tmp_path / "tokenized").exists() or not list((tmp_path / "tokenized").rglob("*.npy"))


def test_causal_lm_needs_a_tokenizer_with_eos(tokenizers):
    with pytest.raises(UserError, match="data.tokenizer.*eos_token"):
        pack_causal_lm(datasets.Dataset.from_dict({"text": DOCS}), tokenizers["bert"], seq_len=16, num_proc=1)
