"""Batches: GPT labels shifted by one; BERT dynamic masking at 15% with the 80/10/10 split,
never on special tokens, and reproducible per stream position."""
import numpy as np
import torch

from hvdtrain.data import synthetic_blocks, synthetic_vocab
from hvdtrain.data.collate import CausalLMCollator, MaskedLMCollator
from hvdtrain.config import Config
from hvdtrain.models.common import IGNORE_INDEX


def samples(blocks, start=0):
    return [{"input_ids": torch.from_numpy(b.astype(np.int64)), "position": start + i} for i, b in enumerate(blocks)]


def bert_batch_parts(n, seq_len):
    """(vocab, blocks, collator) for synthetic BERT data."""
    cfg = Config()
    cfg.model.arch = "bert"
    vocab = synthetic_vocab(cfg)
    blocks = synthetic_blocks(n, seq_len, cfg.data.vocab_size, seed=0, arch="bert")
    return vocab, blocks, MaskedLMCollator(vocab, 0.15, seed=1)


def test_causal_labels_are_the_next_token():
    blocks = np.arange(12).reshape(2, 6)
    batch = CausalLMCollator()(samples(blocks))
    assert batch["labels"][0].tolist() == [1, 2, 3, 4, 5, IGNORE_INDEX]
    assert batch["num_targets"] == 10


def test_masking_rate_and_80_10_10_split():
    vocab, blocks, collate = bert_batch_parts(2000, 64)
    batch = collate(samples(blocks))
    original = torch.from_numpy(blocks.astype(np.int64))
    picked = batch["labels"] != IGNORE_INDEX
    ordinary = ~torch.isin(original, torch.tensor(vocab.special_ids))
    assert not (picked & ~ordinary).any(), "special tokens must never be masked"
    assert torch.equal(batch["labels"][picked], original[picked])
    rate = picked.sum().item() / ordinary.sum().item()
    assert abs(rate - 0.15) < 0.005
    n = picked.sum().item()
    as_mask = (batch["input_ids"][picked] == vocab.mask_id).sum().item() / n
    unchanged = (batch["input_ids"][picked] == original[picked]).sum().item() / n
    assert abs(as_mask - 0.8) < 0.01
    assert abs(unchanged - 0.1) < 0.01  # kept (a random draw equal to the original is ~1/V more)
    assert abs((1 - as_mask - unchanged) - 0.1) < 0.01
    assert batch["num_targets"] == n
    assert not (batch["input_ids"][~picked] != original[~picked]).any()


def test_masks_depend_on_the_stream_position_only():
    _, blocks, collate = bert_batch_parts(8, 32)
    whole = collate(samples(blocks, start=100))
    halves = [collate(samples(blocks[:4], start=100)), collate(samples(blocks[4:], start=104))]
    assert torch.equal(whole["input_ids"], torch.cat([h["input_ids"] for h in halves]))
    other_epoch = collate(samples(blocks, start=100 + 8))
    assert not torch.equal(whole["labels"], other_epoch["labels"])
