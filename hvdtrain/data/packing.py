"""Tokenized training blocks: an int32 array of shape (N, seq_len), every row full.

Documents are tokenized, joined into one token stream with a separator between them
and cut into equal blocks, so no compute is spent on padding and a long document simply
spans several blocks. The tail of the stream shorter than a block is dropped; nothing
else is lost or repeated.

- causal LM (GPT-2): documents joined by EOS, cut into blocks of seq_len;
- masked LM (BERT): documents joined by [SEP], cut into chunks of seq_len - 2, each
  wrapped as [CLS] chunk [SEP].

The in-memory packing that hvdtrain.data.preparation replaces, kept for one commit so that
the token files are checked against it (tests/test_data_prepare.py).
"""
import logging

import datasets
import numpy as np
import pyarrow.compute as pc
from transformers import PreTrainedTokenizerFast

from hvdtrain.errors import UserError

log = logging.getLogger(__name__)


def pack_causal_lm(texts: datasets.Dataset, tokenizer: PreTrainedTokenizerFast, seq_len: int,
                   num_proc: int) -> np.ndarray:
    """Blocks of seq_len tokens from the documents, each followed by EOS."""
    eos = _special_id(tokenizer, "eos_token", "causal LM (model.arch gpt2)")
    return _blocks(_token_stream(texts, tokenizer, eos, num_proc), seq_len)


def pack_masked_lm(texts: datasets.Dataset, tokenizer: PreTrainedTokenizerFast, seq_len: int,
                   num_proc: int) -> np.ndarray:
    """Blocks of [CLS] + seq_len - 2 tokens + [SEP], from the documents each followed by [SEP]."""
    cls = _special_id(tokenizer, "cls_token", "masked LM (model.arch bert)")
    sep = _special_id(tokenizer, "sep_token", "masked LM (model.arch bert)")
    chunks = _blocks(_token_stream(texts, tokenizer, sep, num_proc), seq_len - 2)
    column = np.ones((len(chunks), 1), dtype=np.int32)
    return np.hstack([cls * column, chunks, sep * column])


def _special_id(tokenizer: PreTrainedTokenizerFast, name: str, purpose: str) -> int:
    token_id = getattr(tokenizer, f"{name}_id")
    if token_id is None:
        raise UserError(f"config key 'data.tokenizer': {tokenizer.name_or_path or 'the tokenizer'} has no "
                        f"{name}, which {purpose} needs")
    return token_id


def _token_stream(texts: datasets.Dataset, tokenizer: PreTrainedTokenizerFast, separator: int,
                  num_proc: int) -> np.ndarray:
    """All documents' tokens in order, each document followed by `separator`, as one flat
    int32 array. Tokenized by `datasets.map` in `num_proc` processes, kept in memory:
    the .npy cache replaces the map cache."""
    def tokenize(batch):
        # No special tokens of the tokenizer's own (a pretrained one may add BOS/CLS): the
        # separators are placed here, and long documents are fine since they get chunked.
        ids = tokenizer(batch["text"], add_special_tokens=False, return_attention_mask=False,
                        verbose=False)["input_ids"]
        return {"input_ids": [doc + [separator] for doc in ids]}

    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"))})
    tokens = texts.map(tokenize, batched=True, num_proc=num_proc, remove_columns=texts.column_names,
                       features=features, keep_in_memory=True, desc="tokenizing")
    return pc.list_flatten(tokens.data.column("input_ids")).to_numpy()


def _blocks(stream: np.ndarray, width: int) -> np.ndarray:
    """`stream` cut into rows of `width` tokens; the tail shorter than a row is dropped."""
    n = len(stream) // width
    log.debug("packing %d tokens into %d blocks of %d, dropping the last %d", len(stream), n, width,
              len(stream) - n * width)
    return stream[: n * width].reshape(n, width)
