"""Raw text for pretraining: a `datasets.Dataset` with a single column, `text`.

`data.source` says where the text comes from:

- "builtin": Python's own documentation prose (`pydoc_data.topics`), so a run works
  with no download at all;
- a local file, directory or glob of .txt / .jsonl / .json / .csv / .parquet files;
- anything else is a Hugging Face hub dataset name.

Every source ends up as one row per document with empty documents dropped, so the
tokenizer and the packing code never need to know where the text came from.
"""
import glob
import itertools
import logging
from pathlib import Path

import datasets

from hvdtrain.config import DataConfig
from hvdtrain.errors import UserError

log = logging.getLogger(__name__)

# File extension -> the `datasets` builder that reads it.
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
# A streamed hub dataset is materialised up to this many documents: enough for the
# small runs this framework targets, without pulling a whole web crawl into memory.
MAX_STREAMED_DOCUMENTS = 100_000
GLOB_CHARACTERS = "*?["


def load_text(cfg: DataConfig, cache_root: Path) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """(train texts, validation texts). The second is None unless the source has a split of
    its own named by `data.validation_split`; the caller then holds out a fraction with
    `split_validation`. Local files are converted to Arrow under `cache_root/"datasets"`;
    hub datasets use the Hugging Face cache, so downloads made by other tools are reused."""
    if cfg.source == "synthetic":
        raise ValueError("data.source 'synthetic' has no text: make random tokens instead of calling load_text")
    if cfg.source != "builtin" and not _is_local(cfg.source):
        return _load_hub(cfg)
    if cfg.validation_split is not None:
        raise UserError(f"config key 'data.validation_split': data.source '{cfg.source}' has no named splits; "
                        f"leave it null and use data.validation_fraction")
    if cfg.source == "builtin":
        texts = builtin_corpus()
    else:
        texts = _text_column(_load_local(_local_files(cfg.source), cache_root / "datasets"), cfg.text_column,
                             cfg.source)
    return _clean(texts, cfg.source), None


def split_validation(texts: datasets.Dataset, fraction: float, seed: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Hold out a random `fraction` of the documents (at least one) as validation data.
    The same texts, fraction and seed always give the same split."""
    if len(texts) < 2:
        raise UserError(f"data.source has {len(texts)} document(s): too few to hold out data.validation_fraction "
                        f"for validation")
    split = texts.train_test_split(test_size=fraction, seed=seed)
    return split["train"], split["test"]


def texts_fingerprint(texts: datasets.Dataset) -> str:
    """A hash that changes whenever the rows could have changed; the key of the caches built
    from them. This is `datasets`' own lineage hash: for local files it covers their paths
    and modification times, for hub datasets name, config, split and revision, for in-memory
    data (the builtin corpus, materialised streams) the content, and it follows every
    transform since (dropping empty documents, a held-out split with its fraction and seed)."""
    return texts._fingerprint


def builtin_corpus() -> datasets.Dataset:
    """Python's documentation topics (about half a megabyte of English prose, paragraphs
    kept), one document per topic in sorted order so every process sees the same rows."""
    from pydoc_data.topics import topics
    return datasets.Dataset.from_dict({"text": [topics[name] for name in sorted(topics)]})


# ---------------------------------------------------------------- local files

def _is_local(source: str) -> bool:
    """Hub names look like 'name' or 'owner/name'; anything that exists, is a glob, starts
    like a path, ends in a known extension or has deeper folders is taken as a local path
    (so a typo in a path reports a missing path, not an unreachable hub dataset)."""
    path = Path(source).expanduser()
    return (path.exists() or any(c in source for c in GLOB_CHARACTERS) or source.startswith(("/", ".", "~"))
            or path.suffix in BUILDERS or source.count("/") > 1)


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
    builders = {BUILDERS[p.suffix] for p in files}
    if len(builders) > 1:
        found = sorted({p.suffix for p in files})
        raise UserError(f"data.source '{source}': mixes file types {', '.join(found)}; point it at one kind")
    return sorted(str(p.resolve()) for p in files)


def _load_local(files: list[str], cache_dir: Path) -> datasets.Dataset:
    """Read the files with the `datasets` builder for their extension. A .txt file gives one
    document per paragraph (blocks separated by a blank line); bytes that are not UTF-8
    become U+FFFD instead of stopping the run."""
    builder = BUILDERS[Path(files[0]).suffix]
    options = {"sample_by": "paragraph", "encoding_errors": "replace"} if builder == "text" else {}
    return datasets.load_dataset(builder, data_files=files, split="train", cache_dir=str(cache_dir), **options)


# ---------------------------------------------------------------- hub

def _load_hub(cfg: DataConfig) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    train = _load_hub_split(cfg, cfg.split)
    validation = None if cfg.validation_split is None else _load_hub_split(cfg, cfg.validation_split)
    return train, validation


def _load_hub_split(cfg: DataConfig, split: str) -> datasets.Dataset:
    """One split of a hub dataset. A streamed one is materialised up to
    MAX_STREAMED_DOCUMENTS documents (a warning says when that cut it short)."""
    try:
        texts = datasets.load_dataset(cfg.source, cfg.hub_config, split=split, streaming=cfg.streaming)
        if cfg.streaming:
            texts = _materialise(texts, cfg.source)
    except ConnectionError as e:
        raise UserError(f"data.source '{cfg.source}': could not reach the Hugging Face hub ({one_line(e)}); "
                        f"to train on local files set data.source to a file, directory or glob of "
                        f"{' '.join(BUILDERS)} files, or data.source=builtin") from None
    except FileNotFoundError as e:
        raise UserError(f"data.source '{cfg.source}': no such hub dataset or local path ({one_line(e)})") from None
    except ValueError as e:  # `datasets` reports an unknown split or config this way
        raise UserError(f"data.source '{cfg.source}' (data.hub_config={cfg.hub_config}, split '{split}'): "
                        f"{one_line(e)}") from None
    return _clean(_text_column(texts, cfg.text_column, cfg.source), cfg.source)


def _materialise(stream: datasets.IterableDataset, source: str) -> datasets.Dataset:
    rows = list(itertools.islice(stream, MAX_STREAMED_DOCUMENTS))
    if len(rows) == MAX_STREAMED_DOCUMENTS:
        log.warning("data.source '%s': streaming, using the first %d documents only", source, len(rows))
    return datasets.Dataset.from_list(rows)


# ---------------------------------------------------------------- every source

def _text_column(texts: datasets.Dataset, column: str, source: str) -> datasets.Dataset:
    """Keep only `column`, renamed to "text"."""
    if column not in texts.column_names:
        raise UserError(f"config key 'data.text_column': data.source '{source}' has no column '{column}' "
                        f"(columns: {', '.join(texts.column_names)})")
    texts = texts.select_columns([column])
    return texts if column == "text" else texts.rename_column(column, "text")


def one_line(error: Exception) -> str:
    """The message of a library's exception squeezed onto one line, as UserErrors are printed."""
    return " ".join(str(error).split()) or type(error).__name__


def _has_text(batch: dict) -> list[bool]:
    return [isinstance(t, str) and t.strip() != "" for t in batch["text"]]


def _clean(texts: datasets.Dataset, source: str) -> datasets.Dataset:
    """Drop empty and whitespace-only documents (and missing values in csv/json)."""
    texts = texts.filter(_has_text, batched=True)
    if len(texts) == 0:
        raise UserError(f"data.source '{source}': no text found (every document is empty)")
    log.info("data.source '%s': %d documents", source, len(texts))
    return texts
