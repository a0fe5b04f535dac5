"""The tokenizer: trained on a sample of the corpus (`data.tokenizer: train`) or a pretrained one.

A trained tokenizer follows its family's convention (hvdtrain.models: its `tokenizer` kind
and `special_tokens`): byte-level BPE with `<|endoftext|>` for GPT-2, the same with Llama 3's
`<|begin_of_text|>` (put before every text it encodes) and `<|end_of_text|>` for Llama,
lowercase WordPiece with [PAD] [UNK] [CLS] [SEP] [MASK] for BERT, and cased byte-level BPE with
the same five for ModernBERT. It learns from a bounded sample (`tokenizer_sample`), so training takes the same time
and memory for a corpus of a megabyte or a terabyte. Training is cached on disk, keyed by the
corpus and the sample, so only the first process on a host trains and the others load the result.
"""
import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from hvdtrain.config import DataConfig
from hvdtrain.data.cache import atomic_path, cache_key
from hvdtrain.data.text import Corpus, one_line
from hvdtrain.errors import UserError
from hvdtrain.models import family

log = logging.getLogger(__name__)



def train_tokenizer(batches: Iterable[list[str]], arch: str, vocab_size: int) -> PreTrainedTokenizerFast:
    """A new tokenizer with (at most) `vocab_size` tokens learnt from the texts in `batches`,
    wrapped for `transformers` with its special tokens set (so `save_pretrained` keeps them)."""
    spec = family(arch)
    special = spec.special_tokens
    tokens = list(dict.fromkeys(special.values()))  # each once, in the family's order
    if spec.tokenizer == "byte-level-bpe":
        tokenizer, trainer = _byte_level_bpe(), _bpe_trainer(vocab_size, tokens)
    elif spec.tokenizer == "wordpiece":
        tokenizer, trainer = _wordpiece(special["unk_token"]), _wordpiece_trainer(vocab_size, tokens)
    else:
        raise ValueError(f"no tokenizer recipe {spec.tokenizer!r} (model.arch {arch})")
    tokenizer.train_from_iterator(batches, trainer)
    # The templates need the ids, which exist only after training.
    if "cls_token" in special:
        tokenizer.post_processor = _cls_sep_template(tokenizer, special["cls_token"], special["sep_token"])
    elif special.get("bos_token", special.get("eos_token")) != special.get("eos_token"):
        tokenizer.post_processor = _bos_template(tokenizer, special["bos_token"])
    if spec.tokenizer == "byte-level-bpe" and "mask_token" in special:
        # Bytes keep spaces, so the mask takes the space before it (as ModernBERT's tokenizer
        # does): in "the [MASK] fox" it stands for " word", one token as the model learnt it.
        tokenizer.add_special_tokens([AddedToken(special["mask_token"], lstrip=True, special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special)


def tokenizer_sample(corpus: Corpus, megabytes: float) -> Iterator[list[str]]:
    """The text a tokenizer is trained on: the training documents from the start of the corpus,
    in order, whole, until `megabytes` million characters (held-out validation documents are
    skipped). The start and not a spread over the corpus, because a stream can only be read
    from its start and reading a terabyte to sample it would cost more than the training; a
    corpus whose beginning is unlike the rest (sorted by topic, say) should be shuffled first."""
    budget = megabytes * 1_000_000
    for docs in corpus.training_batches():
        taken = []
        for doc in docs:
            taken.append(doc)
            budget -= len(doc)
            if budget <= 0:
                yield taken
                return
        yield taken


def load_or_train_tokenizer(cfg: DataConfig, arch: str, corpus: Corpus, cache_root: Path) -> PreTrainedTokenizerFast:
    """The tokenizer `data.tokenizer` asks for. A trained one is cached under
    `cache_root/tokenizers/<key>`, keyed by (corpus, sample size, arch, vocab_size); every
    caller gets the copy loaded back from disk, so the first process and later ones hold the
    same tokenizer (and the same fingerprint)."""
    if cfg.tokenizer != "train":
        return _pretrained(cfg.tokenizer)
    path = cache_root / "tokenizers" / cache_key(corpus.fingerprint, cfg.tokenizer_sample_mb, arch, cfg.vocab_size)
    if path.exists():
        log.info("tokenizer: cache hit %s", path)
    else:
        log.info("tokenizer: training a %s tokenizer (vocab %d) on up to %g MB of the corpus", arch,
                 cfg.vocab_size, cfg.tokenizer_sample_mb)
        with atomic_path(path) as tmp:
            train_tokenizer(tokenizer_sample(corpus, cfg.tokenizer_sample_mb), arch, cfg.vocab_size).save_pretrained(tmp)
    return AutoTokenizer.from_pretrained(path, trust_remote_code=False)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerFast) -> str:
    """A hash of everything that decides the token ids: the serialized tokenizer and its
    special tokens."""
    return cache_key(tokenizer.backend_tokenizer.to_str(), json.dumps(tokenizer.special_tokens_map, sort_keys=True))


def _pretrained(name: str) -> PreTrainedTokenizerFast:
    """A fast (Rust `tokenizers`) tokenizer: batch tokenization needs its speed and the
    cache key its serialized form."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=False)  # no code from a folder or the hub
    except (OSError, ValueError) as e:  # missing local folder, unknown hub name, or the hub cannot be reached
        raise UserError(f"config key 'data.tokenizer': could not load '{name}' as a local tokenizer folder or "
                        f"from the hub ({one_line(e)}); use data.tokenizer=train to train one") from None
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(f"config key 'data.tokenizer': '{name}' has no fast (tokenizer.json) version")
    # A model folder without tokenizer files (weights and config.json only) still gives a
    # tokenizer: an empty one of the config's model type, which turns every text into nothing.
    if len(tokenizer) <= len(tokenizer.all_special_tokens):
        raise UserError(f"config key 'data.tokenizer': '{name}' has no tokenizer files (tokenizer.json or a "
                        f"vocabulary); set data.tokenizer to the model's tokenizer, a folder or hub name "
                        f"(with model.pretrained it is the model's folder by default)")
    return tokenizer


# ---------------------------------------------------------------- recipes

def _byte_level_bpe() -> Tokenizer:
    """GPT-2's design: BPE over bytes, so any text is encodable without an unknown token."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _bpe_trainer(vocab_size: int, special_tokens: list[str]) -> trainers.BpeTrainer:
    return trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)


def _wordpiece(unk_token: str) -> Tokenizer:
    """BERT's uncased design: lowercase, strip accents, split on whitespace and punctuation."""
    tokenizer = Tokenizer(models.WordPiece(unk_token=unk_token))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    return tokenizer


def _wordpiece_trainer(vocab_size: int, special_tokens: list[str]) -> trainers.WordPieceTrainer:
    return trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                     continuing_subword_prefix="##", show_progress=False)


def _bos_template(tokenizer: Tokenizer, bos: str) -> processors.Sequence:
    """BOS A (BOS B): what `tokenizer(text)` adds, as Llama 3's tokenizer does, after the
    byte-level offsets."""
    template = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1",
                                             special_tokens=[(bos, tokenizer.token_to_id(bos))])
    return processors.Sequence([processors.ByteLevel(trim_offsets=False), template])


def _cls_sep_template(tokenizer: Tokenizer, cls: str, sep: str) -> processors.TemplateProcessing:
    """[CLS] A [SEP] (B [SEP]): what `tokenizer(text)` adds, as BERT expects."""
    return processors.TemplateProcessing(single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
                                         special_tokens=[(t, tokenizer.token_to_id(t)) for t in (cls, sep)])
