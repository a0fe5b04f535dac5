"""Training and validation data for a run: token blocks, the vocabulary, the collator.

`build_data` returns a `DataBundle`. Token blocks come from:
  * "synthetic": learnable token patterns made from the seed (tests, benchmarks), or
  * text (builtin corpus, local files, hub datasets) tokenized and packed by
    hvdtrain.data.text / .tokenizer / .packing, with the work done once per host and cached.
"""
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hvdtrain.config import Config
from hvdtrain.data.collate import CausalLMCollator, MaskedLMCollator
from hvdtrain.models import Vocab

SYNTHETIC_SPECIALS = 5  # ids 0..4: pad, eos (GPT) / cls, sep, mask (BERT), unk


class TokenBlocks(torch.utils.data.Dataset):
    """Fixed-length token blocks, indexed by the sampler's (stream position, index) keys."""

    def __init__(self, blocks: np.ndarray):
        self.blocks = blocks

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, key: tuple[int, int]) -> dict:
        position, index = key
        return {"input_ids": torch.from_numpy(np.asarray(self.blocks[index], dtype=np.int64)), "position": position}


@dataclass
class DataBundle:
    train: TokenBlocks
    val: TokenBlocks
    vocab: Vocab
    collate: object
    tokenizer: object = None  # a transformers tokenizer for text data; None for synthetic data


def cache_root(cfg: Config) -> Path:
    return Path(cfg.data.cache_dir).expanduser() if cfg.data.cache_dir else Path.home() / ".cache" / "hvdtrain"


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


def text_data(cfg: Config, root: Path):
    """Load, tokenize and pack text; every expensive step is cached under `root`."""
    from hvdtrain.data.packing import load_or_pack
    from hvdtrain.data.text import load_text, split_validation
    from hvdtrain.data.tokenizer import load_or_train_tokenizer

    data, arch = cfg.data, cfg.model.arch
    train_texts, val_texts = load_text(data, root)
    if val_texts is None:
        train_texts, val_texts = split_validation(train_texts, data.validation_fraction, cfg.train.seed)
    if data.tokenizer == "train" and cfg.model.pretrained:
        data = dataclasses.replace(data, tokenizer=cfg.model.pretrained)  # continue with the model's own
    tokenizer = load_or_train_tokenizer(data, arch, train_texts, root)
    train = load_or_pack(data, arch, train_texts, tokenizer, root, "train")
    val = load_or_pack(data, arch, val_texts, tokenizer, root, "validation")
    return train, val, tokenizer


def build_data(cfg: Config, seed: int) -> DataBundle:
    """Call on one process per host first (it fills the caches), then on the others."""
    arch = cfg.model.arch
    if cfg.data.source == "synthetic":
        n = cfg.data.synthetic_samples
        train = synthetic_blocks(n, cfg.data.seq_len, cfg.data.vocab_size, seed, arch)
        val = synthetic_blocks(max(1, n // 10), cfg.data.seq_len, cfg.data.vocab_size, seed + 1, arch)
        vocab, tokenizer = synthetic_vocab(cfg), None
    else:
        train, val, tokenizer = text_data(cfg, cache_root(cfg))
        vocab = tokenizer_vocab(tokenizer)
    collate = CausalLMCollator() if arch == "gpt2" else MaskedLMCollator(vocab, cfg.data.mlm_probability, seed)
    return DataBundle(TokenBlocks(train), TokenBlocks(val), vocab, collate, tokenizer)
