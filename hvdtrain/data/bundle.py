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
from hvdtrain.data.token_files import TokenStream, check_split, read_index
from hvdtrain.errors import UserError
from hvdtrain.models import Vocab

log = logging.getLogger(__name__)
SYNTHETIC_SPECIALS = 5  # ids 0..4: pad, eos (GPT) / cls, sep, mask (BERT), unk


class TokenBlocks(torch.utils.data.Dataset):
    """Fixed-length blocks cut from a token stream, indexed by the sampler's (stream position,
    index) keys: block i is tokens [i*width, (i+1)*width), between `prefix` and `suffix`.

    - causal LM (GPT-2): blocks of seq_len tokens of the stream (documents joined by EOS);
    - masked LM (BERT): [CLS] + seq_len - 2 tokens of the stream (documents joined by [SEP]) + [SEP].

    No compute is spent on padding, a long document simply spans several blocks, and the tail
    of the stream shorter than a block is dropped; nothing else is lost or repeated."""

    def __init__(self, stream: TokenStream, width: int, prefix: tuple[int, ...] = (), suffix: tuple[int, ...] = ()):
        self.stream, self.width = stream, width
        self.prefix, self.suffix = np.array(prefix, np.int64), np.array(suffix, np.int64)

    def __len__(self):
        return len(self.stream) // self.width

    def block(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(f"block {index} of {len(self)}")
        return np.concatenate([self.prefix, self.stream.read(index * self.width, self.width), self.suffix])

    def __getitem__(self, key: tuple[int, int]) -> dict:
        position, index = key
        return {"input_ids": torch.from_numpy(self.block(index)), "position": position}


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
    if arch == "bert":
        blocks[:, 0], blocks[:, -1] = 2, 3  # [CLS] ... [SEP]
    return blocks.astype(np.int32)


def synthetic_vocab(cfg: Config) -> Vocab:
    if cfg.model.arch == "gpt2":
        return Vocab(size=cfg.data.vocab_size, pad_id=0, bos_id=1, eos_id=1)
    return Vocab(size=cfg.data.vocab_size, pad_id=0, cls_id=2, sep_id=3, mask_id=4)


def tokenizer_vocab(tokenizer) -> Vocab:
    return Vocab(size=len(tokenizer), pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
                 bos_id=tokenizer.bos_token_id, eos_id=tokenizer.eos_token_id, cls_id=tokenizer.cls_token_id,
                 sep_id=tokenizer.sep_token_id, mask_id=tokenizer.mask_token_id)


def text_blocks(cfg: Config) -> tuple[TokenBlocks, TokenBlocks, object]:
    """(train blocks, validation blocks, tokenizer) of the prepared text, prepared now if the
    folder is not complete yet; first every token file's size and a sample's checksums are
    checked against the index (cheap at any size: the preparation read every file back)."""
    start = time.perf_counter()
    plan = preparation.plan(cfg)
    hit = read_index(plan.folder) is not None
    index = preparation.prepare(plan, num_proc=cfg.data.num_proc, progress=cfg.log.progress)
    seq_len, tokenizer = cfg.data.seq_len, plan.tokenizer
    if cfg.model.arch == "gpt2":
        layout = {"width": seq_len}
    else:
        layout = {"width": seq_len - 2, "prefix": (tokenizer.cls_token_id,), "suffix": (tokenizer.sep_token_id,)}
    blocks = []
    for split in ("train", "validation"):
        check_split(plan.folder, index, split)
        split_blocks = TokenBlocks(TokenStream.open(plan.folder, index, split), **layout)
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
        train, val, tokenizer = text_blocks(cfg)
        vocab = tokenizer_vocab(tokenizer)
    collate = CausalLMCollator() if arch == "gpt2" else MaskedLMCollator(vocab, cfg.data.mlm_probability, seed)
    return DataBundle(train, val, vocab, collate, tokenizer)
