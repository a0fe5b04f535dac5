"""Tokenized data on disk: flat token files written in pieces, an index, and reading tokens back.

A prepared folder (`<cache>/tokenized/<key>/`) holds each split's token stream: every
document's token ids followed by a separator (EOS for GPT, [SEP] for BERT), documents in
corpus order. The stream is stored in pieces, one per stretch of the corpus, as raw
little-endian uint16 (uint32 when the vocabulary has more than 65,536 ids) with no header,
like nanoGPT's train.bin and Megatron's .bin files:

    train/train-000000.bin, ...       training tokens of stretch 0, 1, ... of the source's train split
    validation/train-000000.bin, ...  the documents of the same stretches held out for validation
    pieces/train-000000.json, ...     a piece's token counts and checksums, written once it is done
    index.json                        written last: every split's pieces in order (file, tokens,
                                      CRC-32) and the tokens the split uses

index.json appears by renaming a complete temporary file, after every piece is done and read
back against its checksum, so a folder without it is an unfinished preparation and is never
read, however far it got. Reading every file takes hours at terabytes of tokens, so that full
check runs once per preparation and on request (`hvdtrain prepare --verify`); every start of
training checks only every piece's size and the checksums of a few pieces chosen at random. A
truncated, missing or damaged file found is a one-line error, not a silently different run.
"""
import json
import random
import zlib
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from hvdtrain.data.cache import atomic_path
from hvdtrain.errors import UserError

FORMAT = 1
INDEX = "index.json"
CHECK_CHUNK = 16 * 1024 * 1024  # bytes read at a time when checking a file: memory stays flat
# Pieces of each split whose checksums a start of training reads, chosen anew at every start on
# every rank: damage that keeps a file's size is found sooner or later without reading it all.
SAMPLED_PIECES = 2


def token_dtype(vocab_size: int) -> np.dtype:
    """2 bytes per token when every id fits, else 4."""
    return np.dtype("<u2") if vocab_size <= 2 ** 16 else np.dtype("<u4")


def write_tokens(path: Path, arrays: Iterable[np.ndarray]) -> tuple[int, int]:
    """Write `arrays` one after another as the token file `path`, appearing only once complete.
    Each array is written as soon as it arrives, so memory holds one at a time. Returns
    (tokens, CRC-32 of the bytes)."""
    tokens, crc = 0, 0
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        for array in arrays:
            f.write(array.data)
            crc = zlib.crc32(array.data, crc)
            tokens += len(array)
    return tokens, crc


def write_json(path: Path, record: dict):
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(record, indent=1) + "\n")


def read_json(path: Path) -> dict | None:
    """The record at `path`, or None when it is not there (yet)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def read_index(folder: Path) -> dict | None:
    """The index of a complete folder, or None when the folder is missing or unfinished."""
    return read_json(folder / INDEX)


def check_split(folder: Path, index: dict, split: str, sampled: int | None = SAMPLED_PIECES):
    """Every piece of `split` is there with the size the index gives it, and `sampled` pieces
    chosen at random (None: all of them) have its checksum; a UserError naming the first file
    that does not."""
    pieces = index["splits"][split]["pieces"]
    chosen = (range(len(pieces)) if sampled is None
              else set(random.SystemRandom().sample(range(len(pieces)), min(sampled, len(pieces)))))
    for i, piece in enumerate(pieces):
        check_file(folder, piece["file"], piece["tokens"], piece["crc32"], index["dtype"], checksum=i in chosen)


def verify_pieces(folder: Path, index: dict, member: int = 0, members: int = 1):
    """The full check of a complete folder: every piece's size and checksum, or with `members`
    processes sharing the work, those of every `members`-th piece from `member` on."""
    pieces = [piece for split in index["splits"].values() for piece in split["pieces"]]
    for piece in pieces[member::members]:
        check_file(folder, piece["file"], piece["tokens"], piece["crc32"], index["dtype"], checksum=True)


def check_file(folder: Path, file: str, tokens: int, crc32: int, dtype, checksum: bool):
    """The token file `folder / file` is there with `tokens` tokens of `dtype` and, when
    `checksum`, the CRC-32 `crc32`; a UserError naming it otherwise. Read in chunks, not mapped,
    so checking adds nothing to the memory of the process."""
    path = folder / file
    fix = f"delete {folder} and prepare the data again (hvdtrain prepare, or train does it)"
    expected = tokens * np.dtype(dtype).itemsize
    size = path.stat().st_size if path.exists() else None
    if size is None:
        raise UserError(f"token file {path} is missing; {fix}")
    if size != expected:
        raise UserError(f"token file {path} has {size} bytes but its index says {expected} ({tokens} "
                        f"tokens): it is truncated or was overwritten; {fix}")
    if not checksum:
        return
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHECK_CHUNK):
            crc = zlib.crc32(chunk, crc)
    if crc != crc32:
        raise UserError(f"token file {path} does not match its recorded checksum: it is corrupt; {fix}")


class TokenStream:
    """One split's tokens in order, read from its pieces: token files mapped with np.memmap on
    first use (in each DataLoader worker too, since maps are not pickled), or arrays in memory.
    Only the pages read are loaded, so memory does not grow with the size of the data."""

    def __init__(self, pieces: list, sizes: list[int], dtype, length: int | None = None):
        self.pieces = pieces  # Paths of token files, or 1-D arrays
        self.dtype = np.dtype(dtype)
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])  # piece i: [starts[i], starts[i+1])
        self.length = int(self.starts[-1]) if length is None else length
        self._maps = {}

    @classmethod
    def open(cls, folder: Path, index: dict, split: str) -> "TokenStream":
        entry = index["splits"][split]
        return cls([folder / p["file"] for p in entry["pieces"]], [p["tokens"] for p in entry["pieces"]],
                   index["dtype"], entry["tokens"])

    def __len__(self) -> int:
        return self.length

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": {}}

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count) as int64, joined across pieces where they straddle two."""
        if start < 0 or start + count > self.length:
            raise IndexError(f"tokens [{start}, {start + count}) of a stream of {self.length}")
        parts = []
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        while count > 0:
            offset = start - int(self.starts[i])
            take = min(count, int(self.starts[i + 1]) - start)
            parts.append(self._piece(i)[offset:offset + take])
            start, count, i = start + take, count - take, i + 1
        return np.concatenate(parts).astype(np.int64)

    def _piece(self, i: int) -> np.ndarray:
        piece = self.pieces[i]
        if not isinstance(piece, Path):
            return piece
        if i not in self._maps:
            self._maps[i] = np.memmap(piece, dtype=self.dtype, mode="r")
        return self._maps[i]
