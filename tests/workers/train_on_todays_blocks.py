"""Test worker: train as `hvdtrain train CONFIG [key=value ...]` does, but on the blocks that
today's in-memory packing makes from the same documents (todays_packing.py) instead of the
prepared token files."""
import sys

import numpy as np
import torch

import hvdtrain.training.train as train_module
from hvdtrain.config import load_config
from hvdtrain.data import build_data
from todays_packing import split_documents, todays_blocks


class Blocks(torch.utils.data.Dataset):
    """Rows of a 2-D array, indexed by the sampler's (stream position, epoch, index) keys
    (epoch 0's grid in every epoch: the runs compared stay within the first epoch)."""

    def __init__(self, rows: np.ndarray):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, key):
        position, _, index = key
        return {"input_ids": torch.from_numpy(self.rows[index].astype(np.int64)), "position": position}


def with_todays_blocks(cfg, seed):
    data = build_data(cfg, seed)  # the tokenizer, vocabulary and collator of the real run
    docs = split_documents(cfg)
    data.train, data.val = (Blocks(todays_blocks(data.tokenizer, docs[split], cfg.model.arch, cfg.data.seq_len))
                            for split in ("train", "validation"))
    return data


if __name__ == "__main__":
    train_module.build_data = with_todays_blocks
    train_module.train(load_config(sys.argv[1], sys.argv[2:]))
