"""hvdtrain.data.text: every kind of source becomes a stream of non-empty documents in a fixed
order, read to its end; held-out documents are a fixed fraction; every mistake is a one-line
UserError naming the key or path."""
import os
import pwd
import re
import shutil
import tempfile
from pathlib import Path

import datasets
import huggingface_hub
import numpy as np
import pytest

from hvdtrain.config import DataConfig
from hvdtrain.data.text import builtin_corpus, held_out, open_corpus
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
    return open_corpus(DataConfig(source=str(source), **options), cache_root=tmp_path / "cache")


def documents(docs) -> list[str]:
    """Every document of a `Documents` stream, in order."""
    return [d for batch in docs.batches() for d in batch]


def test_builtin_corpus_is_real_prose_in_a_fixed_order(tmp_path):
    corpus = load(tmp_path, "builtin")
    assert corpus.validation is None and corpus.holdout == 0.02
    texts = documents(corpus.train)
    assert len(texts) > 50
    assert sum(len(t) for t in texts) > 300_000
    assert any("\n\n" in t for t in texts), "paragraphs are kept inside a document"
    assert texts == builtin_corpus()
    assert documents(corpus.train) == texts, "read again from the start"
    assert corpus.fingerprint == load(tmp_path, "builtin").fingerprint


def test_txt_gives_one_document_per_paragraph(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(DOCS) + "\n\n   \n\n\n\n")
    assert [t.strip() for t in documents(load(tmp_path, path).train)] == DOCS


def test_txt_with_bytes_that_are_not_utf8(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("café au lait".encode("latin-1") + b"\n\nplain ascii\n")
    texts = documents(load(tmp_path, path).train)
    assert texts[0] == "caf\ufffd au lait"
    assert texts[1].strip() == "plain ascii"


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_table_files_use_the_text_column(tmp_path, suffix):
    table = datasets.Dataset.from_dict({"id": [1, 2, 3, 4], "body": DOCS[:2] + ["", DOCS[2]]})
    path = tmp_path / f"corpus{suffix}"
    {".jsonl": table.to_json, ".csv": table.to_csv, ".parquet": table.to_parquet}[suffix](str(path))
    assert documents(load(tmp_path, path, text_column="body").train) == DOCS, "the empty one is dropped, the order kept"


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
    assert documents(load(tmp_path, folder).train) == DOCS
    assert documents(load(tmp_path, f"{folder}/*.txt").train) == DOCS[:2]


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


def test_an_unreadable_file_is_named():
    """Tests run as root here, who reads everything: the check runs as the user nobody."""
    folder = Path(tempfile.mkdtemp())  # not under pytest's tmp_path, which only root may enter
    try:
        folder.chmod(0o755)
        secret = folder / "secret.txt"
        secret.write_text("words\n")
        secret.chmod(0)
        if os.geteuid() == 0:
            os.seteuid(pwd.getpwnam("nobody").pw_uid)
        try:
            with pytest.raises(UserError, match=re.escape(f"data.source '{folder}': {secret} is not readable")):
                load(folder, folder)
        finally:
            if os.getuid() == 0:
                os.seteuid(0)
    finally:
        shutil.rmtree(folder)


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


class FakeHubBuilder:
    """What `datasets.load_dataset_builder` returns for a hub dataset, with a local stream instead
    of the hub; it records the splits asked for."""

    def __init__(self, rows: int, revision: str = "abc123"):
        self.table = datasets.Dataset.from_dict({"id": list(range(rows)), "content": [f"doc {i}" for i in range(rows)]})
        self.hash, self.splits = revision, []

    def as_streaming_dataset(self, split):
        self.splits.append(split)
        return self.table.to_iterable_dataset(num_shards=3)


@pytest.fixture
def hub(monkeypatch):
    builders = {}

    def load_dataset_builder(name, config):
        builders.setdefault((name, config), FakeHubBuilder(rows=2500))
        return builders[(name, config)]
    monkeypatch.setattr(datasets, "load_dataset_builder", load_dataset_builder)
    return builders


def test_a_streamed_hub_dataset_is_read_to_its_end(tmp_path, hub):
    corpus = load(tmp_path, "org/corpus", hub_config="en", streaming=True, text_column="content",
                  validation_split="test")
    assert hub[("org/corpus", "en")].splits == ["train", "test"]
    expected = [f"doc {i}" for i in range(2500)]
    assert documents(corpus.train) == documents(corpus.validation) == expected, "every document, in order"
    assert corpus.holdout is None


def test_max_documents_cuts_a_stream(tmp_path, hub):
    corpus = load(tmp_path, "org/corpus", streaming=True, text_column="content", max_documents=1234)
    assert documents(corpus.train) == [f"doc {i}" for i in range(1234)]
    uncut = load(tmp_path, "org/corpus", streaming=True, text_column="content")
    assert uncut.fingerprint != corpus.fingerprint


def test_a_new_revision_of_a_streamed_dataset_is_a_new_fingerprint(tmp_path, hub):
    before = load(tmp_path, "org/corpus", streaming=True, text_column="content").fingerprint
    hub[("org/corpus", None)].hash = "def456"
    assert load(tmp_path, "org/corpus", streaming=True, text_column="content").fingerprint != before


def test_validation_split_needs_a_source_with_splits(tmp_path):
    with pytest.raises(UserError, match="data.validation_split"):
        load(tmp_path, "builtin", validation_split="validation")


def test_held_out_documents_are_a_fixed_fraction(tmp_path):
    ordinals = np.arange(100_000)
    out = held_out(ordinals, 0.1)
    assert abs(out.mean() - 0.1) < 0.003  # 3 standard deviations
    assert np.array_equal(held_out(ordinals[5000:6000], 0.1), out[5000:6000]), "each document decided on its own"
    assert not (held_out(ordinals, 0.05) & ~out).any(), "a smaller fraction holds out a subset"
    corpus = load(tmp_path, "builtin", validation_fraction=0.25)
    batches = list(corpus.labelled_batches())
    kept = [d for docs, mask in batches for d, o in zip(docs, mask) if not o]
    assert kept == [d for docs in corpus.training_batches() for d in docs]
    assert 0 < len(kept) < len(documents(corpus.train))


def test_fingerprint_follows_changes_to_the_files(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(DOCS[0])
    before = load(tmp_path, path).fingerprint
    assert load(tmp_path, path).fingerprint == before
    path.write_text(DOCS[1])
    os.utime(path, (1e9, 1e9))
    assert load(tmp_path, path).fingerprint != before
    assert load(tmp_path, path, validation_fraction=0.5).fingerprint != load(tmp_path, path).fingerprint
