"""Tokenizing processes: pieces of the corpus in, token files out.

`TokenizingProcesses` starts `num_proc` processes, each a fresh `python -m
hvdtrain.data.tokenizing`, and feeds them one piece at a time through a pipe. Fresh
interpreters rather than multiprocessing's fork or spawn: nothing is inherited from the
caller (torch, Horovod's threads, a large heap), nothing depends on how the caller's main
module is written, and a process that dies is reported at once instead of leaving the
caller waiting. They import numpy and the Rust `tokenizers` library only, so they start in a
fraction of a second and stay small.
"""
import itertools
import os
import signal
import subprocess
import sys
from multiprocessing.connection import Connection, Pipe, wait
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from hvdtrain.data.token_files import write_json, write_tokens

# Text tokenized in one call. The tokenizer's output objects take ~100 bytes per token, so
# this, not the piece, bounds what a process holds beyond the piece's text.
SUB_BATCH_CHARS = 1_000_000


class TokenizingProcesses:
    """`num_proc` processes tokenizing with `tokenizer_json` (a `tokenizers` serialization),
    every document followed by `separator`, ids written as `dtype`."""

    def __init__(self, num_proc: int, tokenizer_json: str, separator: int, dtype: np.dtype):
        self.idle, self.busy = [], {}  # busy: the connection a process answers on -> the process
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}  # one thread each: the processes are the parallelism
        for _ in range(num_proc):
            to_child, child_inbox = Pipe(duplex=False)[::-1]
            child_outbox, from_child = Pipe(duplex=False)[::-1]
            process = subprocess.Popen([sys.executable, "-m", "hvdtrain.data.tokenizing", str(child_inbox.fileno()),
                                        str(child_outbox.fileno())], pass_fds=(child_inbox.fileno(), child_outbox.fileno()),
                                       env=env)
            child_inbox.close()
            child_outbox.close()
            to_child.send((tokenizer_json, separator, dtype.str))
            self.idle.append(_Process(process, to_child, from_child))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for process in [*self.idle, *self.busy.values()]:
            process.stop(kill=exc[0] is not None)

    def submit(self, folder: Path, name: str, splits: dict[str, list[str]]) -> list[dict]:
        """Give the piece to an idle process, first waiting for one if all are busy. Returns
        the records (see `tokenize`) of the pieces finished meanwhile."""
        records = [] if self.idle else self._collect()
        process = self.idle.pop()
        process.inbox.send((str(folder), name, splits))
        self.busy[process.outbox] = process
        return records

    def finish(self) -> list[dict]:
        """Wait for every piece given; their records."""
        records = []
        while self.busy:
            records += self._collect()
        return records

    def _collect(self) -> list[dict]:
        records = []
        for outbox in wait(list(self.busy)):
            process = self.busy.pop(outbox)
            try:
                records.append(outbox.recv())
            except EOFError:
                raise RuntimeError(f"a tokenizing process exited with code {process.process.wait()} "
                                   f"(its error is printed above)") from None
            self.idle.append(process)
        return records


class _Process:
    def __init__(self, process: subprocess.Popen, inbox: Connection, outbox: Connection):
        self.process, self.inbox, self.outbox = process, inbox, outbox

    def stop(self, kill: bool):
        if kill:
            self.process.kill()
        else:
            self.inbox.send(None)
        self.process.wait()
        self.inbox.close()
        self.outbox.close()


# ---------------------------------------------------------------- in the tokenizing process

def tokenize(tokenizer: Tokenizer, separator: int, dtype: np.dtype, folder: Path, name: str,
             splits: dict[str, list[str]]) -> dict:
    """Write a piece's documents of each split as `<split>/<name>.bin`, then its record
    `pieces/<name>.json`, which says the piece is done. Returns the record."""
    record = {"name": name, "splits": {}}
    for split, docs in splits.items():
        if docs:
            tokens, crc = write_tokens(folder / split / f"{name}.bin", _token_arrays(tokenizer, separator, dtype, docs))
            record["splits"][split] = {"documents": len(docs), "tokens": tokens, "crc32": crc}
    write_json(folder / "pieces" / f"{name}.json", record)
    return record


def _token_arrays(tokenizer: Tokenizer, separator: int, dtype: np.dtype, docs: list[str]):
    """The documents' tokens, each document followed by the separator, a sub-batch at a time.
    No special tokens of the tokenizer's own (a pretrained one may add BOS/CLS): separators
    are placed here, and long documents are fine since they get cut into blocks."""
    for batch in _sub_batches(docs):
        ids = [encoding.ids for encoding in tokenizer.encode_batch_fast(batch, add_special_tokens=False)]
        for doc in ids:
            doc.append(separator)
        # fromiter into the file's dtype raises OverflowError for an id that does not fit.
        yield np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=sum(map(len, ids)))


def _sub_batches(docs: list[str]):
    batch, chars = [], 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc)
        if chars >= SUB_BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def serve(inbox: Connection, outbox: Connection):
    """A tokenizing process: the tokenizer first, then pieces until None (or the caller is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle: it stops us
    tokenizer_json, separator, dtype = inbox.recv()
    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokenizer.no_truncation()
    tokenizer.no_padding()
    try:
        while (piece := inbox.recv()) is not None:
            folder, name, splits = piece
            outbox.send(tokenize(tokenizer, separator, np.dtype(dtype), Path(folder), name, splits))
    except EOFError:
        pass  # the caller stopped (or was stopped): nothing more to do


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
