"""hvdtrain.data.text: every kind of source becomes one `text` row per non-empty document,
and every mistake is a one-line UserError naming the key or path."""
import math
import os
import re

import datasets
import huggingface_hub
import pytest

from hvdtrain.config import DataConfig
from hvdtrain.data import text as text_module
from hvdtrain.data.text import builtin_corpus, load_text, split_validation, texts_fingerprint
from hvdtrain.errors import UserError

DOCS = ["The first document.", "A second one,\nover two lines.", "Third, with ünïcödé."]


@pytest.fixture
def offline(monkeypatch):
    """No network. `datasets` and `huggingface_hub` read the variables when imported, so
    their flags are patched too."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def load(tmp_path, source, **options):
    return load_text(DataConfig(source=str(source), **options), cache_root=tmp_path / "cache")


def test_builtin_corpus_is_real_prose_in_a_fixed_order(tmp_path):
    texts, validation = load(tmp_path, "builtin")
    assert validation is None
    assert texts.column_names == ["text"]
    assert len(texts) > 50
    assert sum(len(t) for t in texts["text"]) > 300_000
    assert any("\n\n" in t for t in texts["text"]), "paragraphs are kept inside a document"
    assert list(texts["text"]) == list(builtin_corpus()["text"])
    assert texts_fingerprint(texts) == texts_fingerprint(load(tmp_path, "builtin")[0])


def test_txt_gives_one_document_per_paragraph(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(DOCS) + "\n\n   \n\n\n\n")
    texts, _ = load(tmp_path, path)
    assert [t.strip() for t in texts["text"]] == DOCS


def test_txt_with_bytes_that_are_not_utf8(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("café au lait".encode("latin-1") + b"\n\nplain ascii\n")
    texts, _ = load(tmp_path, path)
    assert texts["text"][0] == "caf\ufffd au lait"
    assert texts["text"][1].strip() == "plain ascii"


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_table_files_use_the_text_column(tmp_path, suffix):
    table = datasets.Dataset.from_dict({"id": [1, 2, 3, 4], "body": DOCS[:2] + ["", DOCS[2]]})
    path = tmp_path / f"corpus{suffix}"
    {".jsonl": table.to_json, ".csv": table.to_csv, ".parquet": table.to_parquet}[suffix](str(path))
    texts, _ = load(tmp_path, path, text_column="body")
    assert texts.column_names == ["text"]
    assert list(texts["text"]) == DOCS, "the empty document is dropped, the order kept"


def test_a_missing_column_names_it_and_the_columns_there_are(tmp_path):
    path = tmp_path / "corpus.jsonl"
    datasets.Dataset.from_dict({"body": DOCS}).to_json(str(path))
    with pytest.raises(UserError, match=r"data\.text_column.*'content'.*columns: body"):
        load(tmp_path, path, text_column="content")


def test_directory_and_glob_read_every_file_in_sorted_order(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text(DOCS[1])
    (folder / "a.txt").write_text(DOCS[0])
    (folder / "sub" / "c.txt").write_text(DOCS[2])
    (folder / ".hidden.txt").write_text("not part of the corpus")
    assert list(load(tmp_path, folder)[0]["text"]) == DOCS
    assert list(load(tmp_path, f"{folder}/*.txt")[0]["text"]) == DOCS[:2]


def test_a_directory_mixing_file_types_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text(DOCS[0])
    datasets.Dataset.from_dict({"text": DOCS}).to_csv(str(tmp_path / "b.csv"))
    with pytest.raises(UserError, match=r"mixes file types \.csv, \.txt"):
        load(tmp_path, tmp_path)


@pytest.mark.parametrize("source", ["missing/corpus.txt", "./missing", "missing/*.jsonl", "a/b/c"])
def test_a_missing_path_is_named(tmp_path, monkeypatch, source):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=re.escape(f"data.source '{source}'")):
        load(tmp_path, source)


def test_an_unsupported_file_type_is_named(tmp_path):
    (tmp_path / "notes.md").write_text(DOCS[0])
    with pytest.raises(UserError, match=r"unsupported file type \.md"):
        load(tmp_path, tmp_path / "notes.md")


def test_an_empty_corpus_is_refused(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("\n\n  \n\n\n")
    with pytest.raises(UserError, match=f"data.source '{path}': no text"):
        load(tmp_path, path)


def test_an_unreachable_hub_dataset_says_how_to_use_local_files(tmp_path, offline):
    with pytest.raises(UserError) as error:
        load(tmp_path, "someone/some-corpus", hub_config="raw")
    message = str(error.value)
    assert "\n" not in message
    assert "data.source 'someone/some-corpus': could not reach the Hugging Face hub" in message
    assert "set data.source to a file, directory or glob" in message


def test_a_streamed_hub_dataset_is_materialised_up_to_a_bound(tmp_path, monkeypatch):
    """The hub is replaced by a local stream: what is asked for, and what comes back."""
    stream = datasets.Dataset.from_dict({"id": list(range(10)), "content": [f"doc {i}" for i in range(10)]})
    requests = []

    def load_dataset(name, config, split, streaming):
        requests.append((name, config, split, streaming))
        return stream.to_iterable_dataset()
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(text_module, "MAX_STREAMED_DOCUMENTS", 4)
    train, validation = load(tmp_path, "org/corpus", hub_config="en", streaming=True, text_column="content",
                             validation_split="test")
    assert requests == [("org/corpus", "en", "train", True), ("org/corpus", "en", "test", True)]
    assert list(train["text"]) == list(validation["text"]) == ["doc 0", "doc 1", "doc 2", "doc 3"]
    assert train.column_names == ["text"]


def test_validation_split_needs_a_source_with_splits(tmp_path):
    with pytest.raises(UserError, match="data.validation_split"):
        load(tmp_path, "builtin", validation_split="validation")


def test_split_validation_is_deterministic_and_disjoint(tmp_path):
    texts = builtin_corpus()
    train, validation = split_validation(texts, 0.1, seed=7)
    assert len(validation) == math.ceil(0.1 * len(texts)) and len(train) + len(validation) == len(texts)
    assert sorted([*train["text"], *validation["text"]]) == sorted(texts["text"])
    again_train, again_validation = split_validation(texts, 0.1, seed=7)
    assert list(again_validation["text"]) == list(validation["text"])
    assert texts_fingerprint(again_train) == texts_fingerprint(train)
    other_train, _ = split_validation(texts, 0.1, seed=8)
    assert texts_fingerprint(other_train) != texts_fingerprint(train), "a new seed must not reuse caches"


def test_fingerprint_follows_changes_to_the_files(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(DOCS[0])
    before = texts_fingerprint(load(tmp_path, path)[0])
    assert texts_fingerprint(load(tmp_path, path)[0]) == before
    path.write_text(DOCS[1])
    os.utime(path, (1e9, 1e9))
    assert texts_fingerprint(load(tmp_path, path)[0]) != before
