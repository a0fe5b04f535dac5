"""Data for a run: text sources, tokenizers, token files, blocks and batches.

    text.py          the documents of a corpus, read as a stream
    tokenizer.py     a tokenizer trained on a sample of the corpus, or a pretrained one
    preparation.py   documents -> token files, in parallel (tokenizing.py: the processes)
    token_files.py   the on-disk format: token files in pieces, their index, reading them back
    cache.py         where the data cache is, the keys of its entries, atomic writes
    bundle.py        build_data: token blocks, vocabulary and collator of a run (collate.py)
    randomness.py    random numbers as functions of counters (BERT masks, held-out documents)

`build_data` and the other names of bundle.py are imported from this package on first use:
they need torch, which a preparation's tokenizing processes, importing modules of this
package, should not load.
"""
_BUNDLE = ("build_data", "DataBundle", "TokenBlocks", "synthetic_blocks", "synthetic_vocab", "tokenizer_vocab")


def __getattr__(name: str):
    if name in _BUNDLE:
        from hvdtrain.data import bundle
        return getattr(bundle, name)
    raise AttributeError(f"module 'hvdtrain.data' has no attribute '{name}'")
