"""Raw text for pretraining: the documents of a corpus, read in order as a stream.

`data.source` says where the text comes from:

- "builtin": Python's own documentation prose (`pydoc_data.topics`), so a run works
  with no download at all;
- a local file, directory or glob of .txt / .jsonl / .json / .csv / .parquet files;
- anything else is a Hugging Face hub dataset name; with `data.streaming` it is read as a
  stream to its end instead of being downloaded first.

`open_corpus` gives a `Corpus`: the training documents and, when the source has a split of its
own for it, the validation documents. Each is a `Documents`, which yields batches of non-empty
document strings in the same order every time it is read, and never holds more than a batch:
a corpus may be far larger than memory. Without a validation split, `held_out` picks a fixed
fraction of the training documents for validation.
"""
import glob
import hashlib
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hvdtrain.config import DataConfig
from hvdtrain.data.randomness import uniform
from hvdtrain.data.cache import cache_key
from hvdtrain.errors import UserError

# File extension -> the `datasets` builder that reads it.
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
GLOB_CHARACTERS = "*?["
READ_BATCH = 1000  # documents per batch read from a source
# Seeds the choice of held-out documents. A constant, not train.seed: the validation set stays
# the same across training seeds, so their eval losses compare, and the token files do not
# have to be prepared again for another seed.
HOLDOUT_SEED = 0x5EED


@dataclass
class Documents:
    """The non-empty documents of one split of a source. `batches()` reads them from the start
    each time it is called. `fingerprint` changes whenever the documents could have: it is the
    key of every cache built from them. `size` is the text's size in bytes when known before
    reading it (for the progress bar's ETA)."""
    source: str  # data.source, for messages
    fingerprint: str
    rows: Callable[[], Iterable[dict]]  # batches of rows as {column: [values]}
    column: str
    size: int | None = None
    max_documents: int | None = None

    def batches(self) -> Iterator[list[str]]:
        """Lists of documents in corpus order, empty and whitespace-only ones (and missing
        values in csv/json) dropped, cut after `max_documents`."""
        count = 0
        for rows in self.rows():
            if self.column not in rows:
                raise UserError(f"config key 'data.text_column': data.source '{self.source}' has no column "
                                f"'{self.column}' (columns: {', '.join(rows)})")
            docs = [t for t in rows[self.column] if isinstance(t, str) and t.strip()]
            if self.max_documents is not None:
                docs = docs[:self.max_documents - count]
            if docs:
                yield docs
                count += len(docs)
            if count == self.max_documents:
                return
        if count == 0:
            raise UserError(f"data.source '{self.source}': no text found (every document is empty)")


@dataclass
class Corpus:
    """Training documents, and validation documents from the source's own split or else
    `holdout`: the fraction of the training documents that `held_out` sets aside."""
    train: Documents
    validation: Documents | None
    holdout: float | None

    @property
    def fingerprint(self) -> str:
        """Changes whenever the training or the validation documents could have."""
        return cache_key(self.train.fingerprint, self.validation.fingerprint if self.validation else self.holdout)

    def labelled_batches(self) -> Iterator[tuple[list[str], np.ndarray]]:
        """The training source's documents in batches, each with a mask: True for the documents
        held out for validation (all False when the source has its own validation split)."""
        first = 0
        for docs in self.train.batches():
            ordinals = np.arange(first, first + len(docs))
            yield docs, (held_out(ordinals, self.holdout) if self.holdout else np.zeros(len(docs), bool))
            first += len(docs)

    def training_batches(self) -> Iterator[list[str]]:
        """The training documents alone (held-out ones skipped), in corpus order."""
        for docs, out in self.labelled_batches():
            kept = [d for d, o in zip(docs, out) if not o]
            if kept:
                yield kept


def held_out(ordinals: np.ndarray, fraction: float) -> np.ndarray:
    """Whether the documents at these positions of the corpus (0 = first non-empty document)
    are validation documents: a hash of the position below `fraction`. Each document is
    decided on its own, so a stream can be split without knowing its length, and the same
    corpus always gives the same split."""
    return uniform(HOLDOUT_SEED, ordinals, 1, stream=0)[:, 0] < fraction


def open_corpus(cfg: DataConfig, cache_root: Path) -> Corpus:
    """The corpus `data.source` names, checked by reading its first batch (so a wrong column or
    an empty corpus is reported before any work). Local files are read in place, no copy;
    hub datasets use the Hugging Face cache, so downloads made by other tools are reused."""
    if cfg.source == "synthetic":
        raise ValueError("data.source 'synthetic' has no text: make random tokens instead of calling open_corpus")
    if cfg.source != "builtin" and not _is_local(cfg.source):
        train = _hub_split(cfg, cfg.split)
        validation = None if cfg.validation_split is None else _hub_split(cfg, cfg.validation_split)
    elif cfg.validation_split is not None:
        raise UserError(f"config key 'data.validation_split': data.source '{cfg.source}' has no named splits; "
                        f"leave it null and use data.validation_fraction")
    else:
        train = _builtin(cfg) if cfg.source == "builtin" else _local(cfg, cache_root)
        validation = None
    for documents in (train, validation):
        if documents is not None:
            next(documents.batches())
    return Corpus(train, validation, None if validation else cfg.validation_fraction)


def builtin_corpus() -> list[str]:
    """Python's documentation topics (about half a megabyte of English prose, paragraphs
    kept), one document per topic in sorted order so every process sees the same rows."""
    from pydoc_data.topics import topics
    return [topics[name] for name in sorted(topics)]


def _builtin(cfg: DataConfig) -> Documents:
    texts = builtin_corpus()
    digest = hashlib.sha256("\0".join(texts).encode()).hexdigest()
    return Documents("builtin", cache_key("builtin", digest, cfg.max_documents), lambda: [{"text": texts}],
                     "text", size=sum(len(t) for t in texts), max_documents=cfg.max_documents)


# ---------------------------------------------------------------- local files

def _is_local(source: str) -> bool:
    """Hub names look like 'name' or 'owner/name'; anything that exists, is a glob, starts
    like a path, ends in a known extension or has deeper folders is taken as a local path
    (so a typo in a path reports a missing path, not an unreachable hub dataset)."""
    path = Path(source).expanduser()
    return (path.exists() or any(c in source for c in GLOB_CHARACTERS) or source.startswith(("/", ".", "~"))
            or path.suffix in BUILDERS or source.count("/") > 1)


def _local(cfg: DataConfig, cache_root: Path) -> Documents:
    """Local files, streamed by the `datasets` builder for their extension (no Arrow copy is
    made). A .txt file gives one document per paragraph (blocks separated by a blank line);
    bytes that are not UTF-8 become U+FFFD instead of stopping the run. The fingerprint
    covers the files' paths, sizes and modification times."""
    files = _local_files(cfg.source)
    builder = BUILDERS[Path(files[0]).suffix]
    options = {"sample_by": "paragraph", "encoding_errors": "replace"} if builder == "text" else {}
    stats = [(f, stat.st_size, stat.st_mtime_ns) for f in files for stat in [Path(f).stat()]]

    def rows():
        import datasets  # here, not at the top: a run on synthetic, built-in or tokenized data never loads it (0.5 s)

        stream = datasets.load_dataset(builder, data_files=files, split="train", streaming=True,
                                       cache_dir=str(cache_root / "datasets"), **options)
        return stream.iter(batch_size=READ_BATCH)
    fingerprint = cache_key("files", builder, options, stats, cfg.text_column, cfg.max_documents)
    return Documents(cfg.source, fingerprint, rows, cfg.text_column, size=sum(s[1] for s in stats),
                     max_documents=cfg.max_documents)


def _local_files(source: str) -> list[str]:
    """The sorted files `source` names: itself, the supported files in a directory (searched
    recursively, hidden ones skipped), or the matches of a glob."""
    path = Path(source).expanduser()
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = [p for p in path.rglob("*") if p.is_file() and p.suffix in BUILDERS
                 and not any(part.startswith(".") for part in p.relative_to(path).parts)]
        if not files:
            raise UserError(f"data.source '{source}': the directory has no {' / '.join(BUILDERS)} files")
    elif any(c in source for c in GLOB_CHARACTERS):
        files = [Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file()]
        if not files:
            raise UserError(f"data.source '{source}': the pattern matches no files")
    else:
        raise UserError(f"data.source '{source}': no such file or directory")
    unsupported = sorted({p.suffix or p.name for p in files if p.suffix not in BUILDERS})
    if unsupported:
        raise UserError(f"data.source '{source}': unsupported file type {', '.join(unsupported)} "
                        f"(supported: {' '.join(BUILDERS)})")
    unreadable = [p for p in files if not os.access(p, os.R_OK, effective_ids=True)]  # as open() will
    if unreadable:
        more = f" (and {len(unreadable) - 1} more files)" if len(unreadable) > 1 else ""
        raise UserError(f"data.source '{source}': {unreadable[0]} is not readable{more}")
    builders = {BUILDERS[p.suffix] for p in files}
    if len(builders) > 1:
        found = sorted({p.suffix for p in files})
        raise UserError(f"data.source '{source}': mixes file types {', '.join(found)}; point it at one kind")
    return sorted(str(p.resolve()) for p in files)


# ---------------------------------------------------------------- hub

def _hub_split(cfg: DataConfig, split: str) -> Documents:
    """One split of a hub dataset. Streamed, it is read to its end (or to data.max_documents)
    and keyed by the dataset's revision. Downloaded, it is keyed by `datasets`' fingerprint of
    its Arrow cache and read through that cache's memory map (the pages read count in the
    process's RSS but are the kernel's page cache, dropped when memory is short)."""
    import datasets

    try:
        if cfg.streaming:
            builder = datasets.load_dataset_builder(cfg.source, cfg.hub_config)
            stream = builder.as_streaming_dataset(split=split)
            fingerprint, size = cache_key("hub", cfg.source, cfg.hub_config, split, builder.hash), None
        else:
            stream = datasets.load_dataset(cfg.source, cfg.hub_config, split=split)
            fingerprint, size = stream._fingerprint, stream.data.nbytes
    except ConnectionError as e:
        raise UserError(f"data.source '{cfg.source}': could not reach the Hugging Face hub ({one_line(e)}); "
                        f"to train on local files set data.source to a file, directory or glob of "
                        f"{' '.join(BUILDERS)} files, or data.source=builtin") from None
    except FileNotFoundError as e:
        raise UserError(f"data.source '{cfg.source}': no such hub dataset or local path ({one_line(e)})") from None
    except ValueError as e:  # `datasets` reports an unknown split or config this way
        raise UserError(f"data.source '{cfg.source}' (data.hub_config={cfg.hub_config}, split '{split}'): "
                        f"{one_line(e)}") from None
    return Documents(cfg.source, cache_key(fingerprint, cfg.text_column, cfg.max_documents),
                     lambda: stream.iter(batch_size=READ_BATCH), cfg.text_column, size=size,
                     max_documents=cfg.max_documents)


def one_line(error: Exception) -> str:
    """The message of a library's exception squeezed onto one line, as UserErrors are printed."""
    return " ".join(str(error).split()) or type(error).__name__
