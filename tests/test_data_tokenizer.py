"""hvdtrain.data.tokenizer: trained tokenizers survive save/reload, carry their special
tokens, learn from a bounded sample of the corpus, and are trained once per corpus then
loaded from the cache."""
import logging

import datasets
import huggingface_hub
import pytest
from transformers import AutoTokenizer, BertConfig, BertForMaskedLM, pipeline

from hvdtrain.config import DataConfig
from hvdtrain.data import tokenizer as tokenizer_module
from hvdtrain.data.cache import atomic_path
from hvdtrain.data.text import builtin_corpus, open_corpus
from hvdtrain.data.tokenizer import load_or_train_tokenizer, tokenizer_fingerprint, train_tokenizer
from hvdtrain.errors import UserError

SAMPLES = ["Hello World, the quick brown fox jumps over the lazy dog.",
           "Naïve café: déjà vu — 3.14 < 42!\n\tTabs and  spaces.",
           "emoji 🙂 and 中文 too"]


@pytest.fixture(scope="module")
def corpus():
    """The builtin corpus as one batch of documents."""
    return [builtin_corpus()]


def builtin(tmp_path, **options):
    return open_corpus(DataConfig(**options), tmp_path)


@pytest.mark.parametrize("arch", ["gpt2", "bert", "llama", "modernbert"])
def test_save_and_reload_gives_identical_ids(tmp_path, corpus, arch):
    trained = train_tokenizer(corpus, arch, vocab_size=1000)
    assert 500 < len(trained) <= 1000
    trained.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in SAMPLES:
        assert reloaded(text)["input_ids"] == trained(text)["input_ids"]
    assert reloaded.special_tokens_map == trained.special_tokens_map
    assert tokenizer_fingerprint(reloaded) == tokenizer_fingerprint(trained)


def test_gpt2_tokenizer_is_byte_level_with_endoftext(corpus):
    tok = train_tokenizer(corpus, "gpt2", vocab_size=1000)
    assert tok.eos_token == tok.bos_token == "<|endoftext|>"
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == "<|endoftext|>"
    for text in SAMPLES:  # bytes, so no unknown token and an exact round trip
        assert tok.decode(tok(text)["input_ids"]) == text


def test_llama_tokenizer_is_byte_level_with_begin_and_end_of_text(corpus):
    tok = train_tokenizer(corpus, "llama", vocab_size=1000)
    assert (tok.bos_token, tok.eos_token) == ("<|begin_of_text|>", "<|end_of_text|>")
    assert tok.bos_token_id != tok.eos_token_id
    for text in SAMPLES:  # BOS before the text, as Llama 3's tokenizer; bytes, so an exact round trip
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id and tok.eos_token_id not in ids
        assert tok.decode(ids[1:]) == text and tok.decode(ids, skip_special_tokens=True) == text
    assert tok("a", "b")["input_ids"].count(tok.bos_token_id) == 2


def test_bert_tokenizer_is_uncased_wordpiece_with_cls_and_sep(corpus):
    tok = train_tokenizer(corpus, "bert", vocab_size=1000)
    assert [tok.pad_token, tok.unk_token, tok.cls_token, tok.sep_token, tok.mask_token] == \
        ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    ids = tok("The Quick brown fox")["input_ids"]
    assert ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "the quick brown fox"


def test_modernbert_tokenizer_is_cased_byte_level_with_cls_sep_and_a_mask_that_takes_its_space(corpus):
    tok = train_tokenizer(corpus, "modernbert", vocab_size=1000)
    assert [tok.pad_token, tok.unk_token, tok.cls_token, tok.sep_token, tok.mask_token] == \
        ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    ids = tok("The Quick brown fox")["input_ids"]
    assert ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "The Quick brown fox"
    masked = tok("the [MASK] fox")["input_ids"]
    assert masked[:3] == tok("the")["input_ids"][:2] + [tok.mask_token_id]  # no lone space token before it


def test_bert_tokenizer_serves_a_fill_mask_pipeline(tmp_path, corpus):
    train_tokenizer(corpus, "bert", vocab_size=1000).save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    model = BertForMaskedLM(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, intermediate_size=64))
    guesses = pipeline("fill-mask", model=model, tokenizer=tok)(f"the value of {tok.mask_token} is", top_k=3)
    assert len(guesses) == 3
    assert all(g["sequence"].startswith("the value of") for g in guesses)


def test_trained_on_a_bounded_sample_of_training_documents(tmp_path, monkeypatch):
    seen = []

    def spy(batches, arch, vocab_size):
        seen.extend(d for batch in batches for d in batch)
        return real_train([seen], arch, vocab_size)
    real_train = tokenizer_module.train_tokenizer
    monkeypatch.setattr(tokenizer_module, "train_tokenizer", spy)
    corpus = builtin(tmp_path)
    load_or_train_tokenizer(DataConfig(tokenizer_sample_mb=0.1), "gpt2", corpus, tmp_path)
    training = [d for batch in corpus.training_batches() for d in batch]
    assert seen == training[:len(seen)], "the first training documents, in order, no held-out ones"
    chars = sum(map(len, seen))
    assert 100_000 <= chars < 100_000 + len(seen[-1]), "whole documents until the budget is reached"


def test_trained_once_then_loaded_from_the_cache(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="hvdtrain.data.tokenizer")
    cfg, corpus = DataConfig(vocab_size=800), builtin(tmp_path)
    first = load_or_train_tokenizer(cfg, "gpt2", corpus, tmp_path)
    assert "training a gpt2 tokenizer" in caplog.text

    def no_training(*args):
        raise AssertionError("trained again instead of using the cache")
    monkeypatch.setattr(tokenizer_module, "train_tokenizer", no_training)
    second = load_or_train_tokenizer(cfg, "gpt2", corpus, tmp_path)
    assert "cache hit" in caplog.text
    assert tokenizer_fingerprint(second) == tokenizer_fingerprint(first)
    assert [p.name.startswith(".") for p in (tmp_path / "tokenizers").iterdir()] == [False], \
        "one cache entry, no temporary leftovers"

    with pytest.raises(AssertionError, match="trained again"):  # another key: another vocab size
        load_or_train_tokenizer(DataConfig(vocab_size=900), "gpt2", corpus, tmp_path)
    with pytest.raises(AssertionError, match="trained again"):  # another sample
        load_or_train_tokenizer(DataConfig(vocab_size=800, tokenizer_sample_mb=0.2), "gpt2", corpus, tmp_path)


def test_a_pretrained_tokenizer_is_loaded_from_a_folder(tmp_path, corpus):
    train_tokenizer(corpus, "bert", vocab_size=600).save_pretrained(tmp_path / "tok")
    tok = load_or_train_tokenizer(DataConfig(tokenizer=str(tmp_path / "tok")), "bert", builtin(tmp_path), tmp_path)
    assert tok.mask_token == "[MASK]"
    assert not (tmp_path / "tokenizers").exists()


@pytest.mark.parametrize("name", ["some-org/some-tokenizer", "/no/such/tokenizer/folder"])
def test_an_unloadable_tokenizer_is_a_one_line_user_error(tmp_path, monkeypatch, name):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError) as error:
        load_or_train_tokenizer(DataConfig(tokenizer=name), "gpt2", builtin(tmp_path), tmp_path)
    assert f"config key 'data.tokenizer': could not load '{name}'" in str(error.value)
    assert "\n" not in str(error.value)


def test_atomic_path_leaves_nothing_behind_on_failure(tmp_path):
    target = tmp_path / "entry"
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.mkdir()
            (tmp / "half-written").write_text("x")
            raise RuntimeError("crash while writing")
    assert list(tmp_path.iterdir()) == []
    with atomic_path(target) as tmp:
        tmp.mkdir()
        (tmp / "complete").write_text("x")
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]
    assert (target / "complete").exists()
