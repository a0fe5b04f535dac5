"""The packing hvdtrain did in memory before token files, restated as the reference they
must match: every document tokenized on its own by the transformers tokenizer and followed
by EOS (GPT-2, Llama) or [SEP] (BERT), all joined, cut into blocks of seq_len (BERT: [CLS] + seq_len - 2
tokens + [SEP]), the tail shorter than a block dropped."""
import numpy as np

from hvdtrain.data import preparation
from hvdtrain.models import family


def todays_blocks(tokenizer, docs: list[str], arch: str, seq_len: int) -> np.ndarray:
    causal = family(arch).causal
    separator = tokenizer.eos_token_id if causal else tokenizer.sep_token_id
    stream = [t for doc in docs for t in tokenizer(doc, add_special_tokens=False)["input_ids"] + [separator]]
    width = seq_len if causal else seq_len - 2
    blocks = np.array(stream[:len(stream) // width * width], np.int64).reshape(-1, width)
    if not causal:
        column = np.ones((len(blocks), 1), np.int64)
        blocks = np.hstack([tokenizer.cls_token_id * column, blocks, tokenizer.sep_token_id * column])
    return blocks


def split_documents(cfg) -> dict[str, list[str]]:
    """The corpus's training and held-out validation documents, in order."""
    out = {"train": [], "validation": []}
    for docs, held_out in preparation.plan(cfg).corpus.labelled_batches():
        for doc, validation in zip(docs, held_out):
            out["validation" if validation else "train"].append(doc)
    return out
