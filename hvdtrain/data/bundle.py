"""Training and validation data for a run: token blocks, the vocabulary, the collator.

`build_data` returns a `DataBundle`. Token blocks come from:
  * "synthetic": learnable token patterns made from the seed (tests, benchmarks), or
  * text (builtin corpus, local files, hub datasets), prepared into token files by
    hvdtrain.data.preparation the first time (once per host: call on one process per host
    first) and read back through memory maps.
"""
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from hvdtrain.config import Config
from hvdtrain.data import preparation
from hvdtrain.data.collate import CausalLMCollator, MaskedLMCollator
from hvdtrain.data.randomness import permute
from hvdtrain.data.token_files import TokenStream, check_split, read_index
from hvdtrain.models import family
from hvdtrain.errors import UserError
from hvdtrain.models.common import Vocab
from hvdtrain.data.sampler import STAND_IN

log = logging.getLogger(__name__)
SYNTHETIC_SPECIALS = 5  # ids 0..4: pad, eos (GPT) / cls, sep, mask (BERT), unk


class TokenBlocks(torch.utils.data.Dataset):
    """Fixed-length blocks cut from a token stream, indexed by the sampler's (stream position,
    epoch, index) keys: block i of epoch e is tokens [o_e + i*width, o_e + (i+1)*width) of the
    stream, between `prefix` and `suffix`.

    - causal LM (GPT-2): blocks of seq_len tokens of the stream (documents joined by EOS);
    - masked LM (BERT): [CLS] + seq_len - 2 tokens of the stream (documents joined by [SEP]) + [SEP].

    No compute is spent on padding, a long document simply spans several blocks, and the tail
    of the stream shorter than a block is dropped; nothing else is lost or repeated.

    The grid moves every epoch, so that a corpus trained on for many epochs shows the model
    new windows instead of the same blocks again: o_e is epoch e's offset in [0, width), drawn
    from `grid_seed` so that any `width` consecutive epochs (0..width-1, width..2*width-1, ...)
    all have different offsets, and o_0 = 0 (a one-epoch run cuts the blocks it always cut).
    Every epoch has the same len(self) blocks: the grid wraps around the end of the stream, so
    the last block of a shifted epoch continues at the stream's start (the stream ends with a
    document separator, so that is a document boundary like any other, unless data.max_tokens
    cut the last document). What is dropped is the len(stream) % width tokens just before o_e,
    a different stretch each epoch. With `grid_seed` None every epoch has epoch 0's grid
    (synthetic blocks, which are separate sequences rather than cuts of a stream, and
    validation blocks)."""

    def __init__(self, stream: TokenStream, width: int, prefix: tuple[int, ...] = (), suffix: tuple[int, ...] = (),
                 grid_seed: int | None = None):
        self.stream, self.width, self.grid_seed = stream, width, grid_seed
        self.prefix, self.suffix = np.array(prefix, np.int64), np.array(suffix, np.int64)
        self._offsets = {}  # epoch -> o_e, computed once per epoch, not per block

    def __len__(self):
        return len(self.stream) // self.width

    def grid_offset(self, epoch: int) -> int:
        """o_e: a seeded order of the offsets [0, width) for each round of `width` epochs,
        shifted so that epoch 0's is 0."""
        if self.grid_seed is None:
            return 0
        if epoch not in self._offsets:
            self._offsets[epoch] = (self._offset_order(epoch) - self._offset_order(0)) % self.width
        return self._offsets[epoch]

    def _offset_order(self, epoch: int) -> int:
        rounds, place = divmod(epoch, self.width)
        return int(permute(np.array([place]), self.width, self.grid_seed, rounds)[0])

    def block(self, index: int, epoch: int = 0) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(f"block {index} of {len(self)}")
        start = self.grid_offset(epoch) + index * self.width  # < len(self) * width <= len(stream)
        head = min(self.width, len(self.stream) - start)
        tokens = [self.stream.read(start, head)]
        if head < self.width:  # wraps around the end of the stream
            tokens.append(self.stream.read(0, self.width - head))
        return np.concatenate([self.prefix, *tokens, self.suffix])

    def __getitem__(self, key: tuple[int, int, int] | None) -> dict:
        """The sample of a sampler's key; for its STAND_IN key (None), block 0 without a stream
        position: the collators give it no targets."""
        position, epoch, index = key if key is not STAND_IN else (None, 0, 0)
        return {"input_ids": torch.from_numpy(self.block(index, epoch)), "position": position}


@dataclass
class DataBundle:
    train: TokenBlocks
    val: TokenBlocks
    vocab: Vocab
    collate: object
    tokenizer: object = None  # a transformers tokenizer for text data; None for synthetic data


def synthetic_blocks(n: int, seq_len: int, vocab_size: int, seed: int, arch: str) -> np.ndarray:
    """Arithmetic token sequences (random start and stride): random-looking yet learnable,
    so a loss curve on synthetic data means something."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, vocab_size, size=(n, 1))
    stride = rng.integers(1, 4, size=(n, 1))
    ordinary = vocab_size - SYNTHETIC_SPECIALS
    blocks = SYNTHETIC_SPECIALS + (start + stride * np.arange(seq_len)) % ordinary
    if not family(arch).causal:  # a masked LM's block: [CLS] ... [SEP]
        blocks[:, 0], blocks[:, -1] = 2, 3
    return blocks.astype(np.int32)


def synthetic_vocab(cfg: Config) -> Vocab:
    if family(cfg.model.arch).causal:
        return Vocab(size=cfg.data.vocab_size, pad_id=0, bos_id=1, eos_id=1)
    return Vocab(size=cfg.data.vocab_size, pad_id=0, cls_id=2, sep_id=3, mask_id=4)


def tokenizer_vocab(tokenizer) -> Vocab:
    return Vocab(size=len(tokenizer), pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
                 bos_id=tokenizer.bos_token_id, eos_id=tokenizer.eos_token_id, cls_id=tokenizer.cls_token_id,
                 sep_id=tokenizer.sep_token_id, mask_id=tokenizer.mask_token_id, origin="data.tokenizer")


def text_blocks(cfg: Config, seed: int) -> tuple[TokenBlocks, TokenBlocks, object]:
    """(train blocks, validation blocks, tokenizer) of the prepared text, prepared now if the
    folder is not complete yet; first every token file's size and a sample's checksums are
    checked against the index (cheap at any size: the preparation read every file back). The
    training blocks' grid moves every epoch (from `seed`); validation keeps the same blocks."""
    start = time.perf_counter()
    plan = preparation.plan(cfg)
    hit = read_index(plan.folder) is not None
    index = preparation.prepare(plan, num_proc=cfg.data.num_proc, progress=cfg.log.progress)
    seq_len, tokenizer = cfg.data.seq_len, plan.tokenizer
    if family(cfg.model.arch).causal:
        layout = {"width": seq_len}
    else:  # a masked LM sees [CLS] block [SEP]
        layout = {"width": seq_len - 2, "prefix": (tokenizer.cls_token_id,), "suffix": (tokenizer.sep_token_id,)}
    blocks = []
    for split in ("train", "validation"):
        check_split(plan.folder, index, split)
        split_blocks = TokenBlocks(TokenStream.open(plan.folder, index, split), **layout,
                                   grid_seed=seed if split == "train" else None)
        if len(split_blocks) == 0:
            raise UserError(f"data.source '{cfg.data.source}': the {split} text is shorter than one block of "
                            f"data.seq_len={seq_len} tokens; use more text or a smaller data.seq_len")
        log.info("%s: %d blocks of %d tokens, %s %s in %.3fs", split, len(split_blocks), seq_len,
                 "cache hit" if hit else "prepared", plan.folder, time.perf_counter() - start)
        blocks.append(split_blocks)
    return blocks[0], blocks[1], tokenizer


def build_data(cfg: Config, seed: int) -> DataBundle:
    """Call on one process per host first (it prepares the data when needed), then on the others."""
    arch = cfg.model.arch
    if cfg.data.source == "synthetic":
        n, seq_len = cfg.data.synthetic_samples, cfg.data.seq_len
        train = synthetic_blocks(n, seq_len, cfg.data.vocab_size, seed, arch)
        val = synthetic_blocks(max(1, n // 10), seq_len, cfg.data.vocab_size, seed + 1, arch)
        train, val = (TokenBlocks(TokenStream([b.ravel()], [b.size], b.dtype), seq_len) for b in (train, val))
        vocab, tokenizer = synthetic_vocab(cfg), None
    else:
        train, val, tokenizer = text_blocks(cfg, seed)
        vocab = tokenizer_vocab(tokenizer)
    collate = CausalLMCollator() if family(arch).causal else MaskedLMCollator(vocab, cfg.data.mlm_probability, seed)
    return DataBundle(train, val, vocab, collate, tokenizer)
