"""Preparing a corpus: documents -> token files, in parallel, in memory that does not grow with it.

`plan` opens the corpus, gets the tokenizer (training it on a sample if asked) and names the
folder of the result: `<cache>/tokenized/<key>`, keyed by everything that decides the tokens
(corpus, tokenizer, arch, data.max_tokens), so a changed corpus or tokenizer never reuses a
stale folder. The sequence length is not in the key: blocks are cut when the files are read,
so one preparation serves every data.seq_len.

`prepare` fills the folder. This process reads the corpus from start to end once and cuts it
into pieces of about PIECE_CHARS characters (whole documents); data.num_proc processes
tokenize the pieces into token files (hvdtrain/data/tokenizing.py), one piece each at a
time. Piece k's files depend only on its documents, so any number of processes on any
number of hosts write the same files: a group of workers preparing together just divides
the pieces (piece k is member k mod n's) and its first member then writes the index
(hvdtrain/data/token_files.py), which marks the folder complete. A preparation that was
stopped keeps its finished pieces, and the next one skips them.
"""
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm
from transformers import PreTrainedTokenizerFast

from hvdtrain.config import Config
from hvdtrain.data.cache import cache_key, cache_root
from hvdtrain.data.text import Corpus, open_corpus
from hvdtrain.data.token_files import (FORMAT, INDEX, check_file, read_index, read_json, token_dtype,
                                       verify_pieces, write_json)
from hvdtrain.data.tokenizer import load_or_train_tokenizer, tokenizer_fingerprint
from hvdtrain.data.tokenizing import TokenizingProcesses
from hvdtrain.errors import UserError
from hvdtrain.models import family
from hvdtrain.observe.progress import on_terminal
from hvdtrain.paths import check_writable_folder

log = logging.getLogger(__name__)

# Characters of text per piece: about 2M tokens, a 4 MB token file with 2-byte ids. Larger
# pieces mean fewer files; smaller ones less text in memory (num_proc + 1 pieces at a time).
PIECE_CHARS = 8_000_000
SPLITS = ("train", "validation")
PROGRESS_DELAY_S = 3  # the bar appears only on preparations that take longer


@dataclass
class Group:
    """The processes that prepare one folder together: this one is `rank` of `size`, and
    `barrier()` returns once every one of them has called it. Alone by default;
    `hvdtrain prepare` under horovodrun makes groups of Horovod workers."""
    rank: int = 0
    size: int = 1
    barrier: Callable[[], None] = lambda: None


ALONE = Group()


@dataclass
class Plan:
    corpus: Corpus
    tokenizer: PreTrainedTokenizerFast
    folder: Path
    separator: int  # the token after every document: EOS (GPT) or [SEP] (BERT)
    max_tokens: int | None


def plan(cfg: Config) -> Plan:
    """What preparing `cfg`'s data means: the corpus, the tokenizer (trained now on a sample of
    the corpus if it is not cached yet) and the folder of the token files."""
    root = cache_root(cfg.data)
    check_writable_folder(root, "data.cache_dir")
    data, arch = cfg.data, cfg.model.arch
    if data.tokenizer == "train" and cfg.model.pretrained:
        data = dataclasses.replace(data, tokenizer=cfg.model.pretrained)  # continue with the model's own
    corpus = open_corpus(data, root)
    tokenizer = load_or_train_tokenizer(data, arch, corpus, root)
    causal = family(arch).causal
    # Documents are joined with EOS for a causal LM, SEP for a masked LM.
    separator = special_id(tokenizer, "eos_token" if causal else "sep_token",
                           f"{family(arch).objective} LM (model.arch {arch})")
    # PIECE_CHARS too: a folder's pieces must all be cut the same way.
    key = cache_key(FORMAT, PIECE_CHARS, corpus.fingerprint, tokenizer_fingerprint(tokenizer), arch, data.max_tokens)
    return Plan(corpus, tokenizer, root / "tokenized" / key, separator, data.max_tokens)


def special_id(tokenizer: PreTrainedTokenizerFast, name: str, purpose: str) -> int:
    token_id = getattr(tokenizer, f"{name}_id")
    if token_id is None:
        raise UserError(f"config key 'data.tokenizer': {tokenizer.name_or_path or 'the tokenizer'} has no "
                        f"{name}, which {purpose} needs")
    return token_id


def available_cores() -> int:
    """The cores this process may run on: its affinity mask, which taskset, Slurm, MPI binding
    or a container's cpuset restrict, unlike os.cpu_count()."""
    return len(os.sched_getaffinity(0))


def prepare(plan: Plan, group: Group = ALONE, num_proc: int | None = None, progress: bool = True,
            verify: bool = False) -> dict:
    """Make `plan.folder` complete (this member's share of the pieces, read back against their
    checksums, then the index) and return its index; at once if it is complete already, after
    reading every file of it back (shared by the members) with `verify`. Every member of
    `group` must call it."""
    start, num_proc = time.perf_counter(), num_proc or available_cores()
    complete = read_index(plan.folder) is not None
    if not complete:
        pieces_read = _tokenize_share(plan, group, num_proc, progress)
        _verify_share(plan, group, pieces_read)
    group.barrier()  # every member's pieces are done
    if not complete and group.rank == 0:
        _log_done(_write_index(plan, pieces_read), plan.folder, time.perf_counter() - start, num_proc, group.size)
    group.barrier()  # the index is written
    index = read_index(plan.folder)
    if complete and verify:
        verify_pieces(plan.folder, index, group.rank, group.size)
        group.barrier()
        if group.rank == 0:
            log.info("verified every token file of %s against its checksum", plan.folder)
    return index


# ---------------------------------------------------------------- reading and dispatching

def _tokenize_share(plan: Plan, group: Group, num_proc: int, progress: bool) -> dict[str, int]:
    """Read the corpus and tokenize this member's pieces that are not done yet with `num_proc`
    processes; returns how many pieces of each stream it read (with data.max_tokens: up to
    where it saw the cut reached, which differs between members)."""
    counts = {}
    with TokenizingProcesses(num_proc, plan.tokenizer.backend_tokenizer.to_str(), plan.separator,
                             token_dtype(len(plan.tokenizer))) as processes, \
            _Progress(plan.corpus, progress and log.isEnabledFor(logging.INFO)) as bar:
        for stream, batches in _streams(plan.corpus):
            prefix = _TrainPrefix(plan.folder) if stream == "train" and plan.max_tokens else None
            counts[stream] = 0
            for number, splits, chars in _pieces(batches):
                bar.read(chars)
                if prefix is not None and prefix.tokens() >= plan.max_tokens:
                    counts[stream] = max(number, prefix.next)  # all done, and they hold data.max_tokens
                    break
                counts[stream] = number + 1
                name = f"{stream}-{number:06d}"
                if number % group.size != group.rank or (plan.folder / "pieces" / f"{name}.json").exists():
                    continue  # another member's piece, or done by an earlier preparation
                bar.done(processes.submit(plan.folder, name, splits))
        bar.done(processes.finish())
    return counts


def _streams(corpus: Corpus) -> Iterator[tuple[str, Iterator[tuple[list[str], np.ndarray]]]]:
    """The source's splits to read, as batches of documents each with a mask: True for the
    documents that go to validation."""
    yield "train", corpus.labelled_batches()
    if corpus.validation is not None:
        yield "validation", ((docs, np.ones(len(docs), bool)) for docs in corpus.validation.batches())


def _pieces(batches) -> Iterator[tuple[int, dict[str, list[str]], int]]:
    """(number, {split: documents}, characters) for consecutive runs of documents of about
    PIECE_CHARS characters: the same pieces for the same documents, whoever reads them."""
    number, splits, chars = 0, {split: [] for split in SPLITS}, 0
    for docs, to_validation in batches:
        for doc, validation in zip(docs, to_validation):
            splits["validation" if validation else "train"].append(doc)
            chars += len(doc)
            if chars >= PIECE_CHARS:
                yield number, splits, chars
                number, splits, chars = number + 1, {split: [] for split in SPLITS}, 0
    if chars:
        yield number, splits, chars


class _TrainPrefix:
    """The training tokens of pieces 0, 1, ... of the train stream, as far as they are done by
    any member of the group (their records are in the shared folder)."""

    def __init__(self, folder: Path):
        self.folder, self.next, self.total = folder, 0, 0

    def tokens(self) -> int:
        while (record := read_json(self.folder / "pieces" / f"train-{self.next:06d}.json")) is not None:
            self.total += record["splits"].get("train", {}).get("tokens", 0)
            self.next += 1
        return self.total


def _verify_share(plan: Plan, group: Group, pieces_read: dict[str, int]):
    """Read back this member's pieces (those it tokenized now, and those an earlier preparation
    left) against their records: the one full check of the files, since a start of training
    checks only a sample of them (hvdtrain/data/token_files.py)."""
    dtype = token_dtype(len(plan.tokenizer))
    for stream, count in pieces_read.items():
        for k in range(group.rank, count, group.size):
            record = read_json(plan.folder / "pieces" / f"{stream}-{k:06d}.json")
            if record is None:
                continue  # not there: _write_index says so if the index needs it
            for split, part in record["splits"].items():
                check_file(plan.folder, f"{split}/{stream}-{k:06d}.bin", part["tokens"], part["crc32"], dtype,
                           checksum=True)


# ---------------------------------------------------------------- the index

def _write_index(plan: Plan, pieces_read: dict[str, int]) -> dict:
    """Gather the pieces' records into index.json, the last file written. With data.max_tokens,
    the training split ends inside the first piece that reaches it; pieces that members
    tokenized past that point are removed."""
    records = {stream: _records(plan.folder, stream, n, plan.max_tokens if stream == "train" else None)
               for stream, n in pieces_read.items()}
    if plan.max_tokens:
        _remove_pieces_after(plan.folder, len(records["train"]))
    splits = {split: {"documents": 0, "tokens": 0, "pieces": []} for split in SPLITS}
    for stream_records in records.values():
        for record in stream_records:
            for split, part in record["splits"].items():
                splits[split]["pieces"].append({"file": f"{split}/{record['name']}.bin", "tokens": part["tokens"],
                                                "crc32": part["crc32"]})
                splits[split]["documents"] += part["documents"]
                splits[split]["tokens"] += part["tokens"]
    if plan.max_tokens:
        splits["train"]["tokens"] = min(splits["train"]["tokens"], plan.max_tokens)
    index = {"format": FORMAT, "dtype": token_dtype(len(plan.tokenizer)).str, "separator": plan.separator,
             "splits": splits}
    write_json(plan.folder / INDEX, index)
    return index


def _records(folder: Path, stream: str, count: int, max_tokens: int | None) -> list[dict]:
    """The records of the stream's first `count` pieces, or with `max_tokens` of the shortest
    run of them from the first that holds that many training tokens (or all).

    The cut is decided here, from the records every member wrote, and only the pieces before it
    must be there: each member stops reading where it sees the cut reached, which depends on
    how far the others were at that moment, so a member that stopped early never tokenized its
    later pieces that another member, stopping later, counted in `count`."""
    records, tokens = [], 0
    for k in range(count):
        if max_tokens and tokens >= max_tokens:
            break
        record = read_json(folder / "pieces" / f"{stream}-{k:06d}.json")
        if record is None:
            raise RuntimeError(f"{folder}: piece {stream}-{k:06d} is missing after every worker finished")
        records.append(record)
        tokens += record["splits"].get("train", {}).get("tokens", 0)
    return records


def _remove_pieces_after(folder: Path, count: int):
    for record_path in (folder / "pieces").glob("train-*.json"):
        if int(record_path.stem.split("-")[1]) >= count:
            for split in SPLITS:
                (folder / split / f"{record_path.stem}.bin").unlink(missing_ok=True)
            record_path.unlink()


def _log_done(index: dict, folder: Path, seconds: float, num_proc: int, members: int):
    splits = index["splits"]
    tokens = sum(s["tokens"] for s in splits.values())
    log.info("prepared %d training and %d validation documents (%d and %d tokens) in %.1fs (%.0f tokens/s, "
             "%d tokenizing processes x %d workers): %s", splits["train"]["documents"],
             splits["validation"]["documents"], splits["train"]["tokens"], splits["validation"]["tokens"], seconds,
             tokens / max(seconds, 1e-9), num_proc, members, folder)


# ---------------------------------------------------------------- progress

class _Progress:
    """A progress bar on long preparations (it appears after a few seconds): text read (with
    an ETA when the source's size is known), documents and tokens per second of this worker."""

    def __init__(self, corpus: Corpus, enabled: bool):
        sizes = [d.size for d in (corpus.train, corpus.validation) if d is not None]
        total = None if None in sizes else sum(sizes)
        self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="preparing", delay=PROGRESS_DELAY_S, mininterval=1,
                        disable=not (enabled and on_terminal(sys.stderr)), dynamic_ncols=True)
        self.start, self.documents, self.tokens = time.perf_counter(), 0, 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.bar.close()

    def read(self, chars: int):
        self.bar.update(chars)

    def done(self, records):
        for record in records:
            for part in record["splits"].values():
                self.documents += part["documents"]
                self.tokens += part["tokens"]
        seconds = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{self.documents / seconds:,.0f} docs/s, {self.tokens / seconds:,.0f} tokens/s",
                                 refresh=False)
