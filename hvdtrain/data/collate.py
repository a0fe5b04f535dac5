"""Turn fixed-length token blocks into training batches.

Both collators return `input_ids`, `labels` aligned with the model's outputs (IGNORE_INDEX
where nothing is predicted) and `num_targets`, the number of labelled positions, which the
training loop sums over the whole optimizer step to normalise the loss.
"""
import numpy as np
import torch

from hvdtrain.models import IGNORE_INDEX, Vocab


class CausalLMCollator:
    """GPT: predict token t+1 from tokens <= t. The last position of a block has no target."""

    def __call__(self, samples: list[dict]) -> dict:
        input_ids = torch.stack([s["input_ids"] for s in samples])
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        labels[:, :-1] = input_ids[:, 1:]
        return {"input_ids": input_ids, "labels": labels, "num_targets": labels[:, :-1].numel()}


class MaskedLMCollator:
    """BERT dynamic masking: each step draws new masks (15% of non-special tokens; of those
    80% become [MASK], 10% a random token, 10% stay), as DataCollatorForLanguageModeling does.

    The random draw of a sample is seeded by (seed, its stream position), not by a per-process
    RNG, so the masks of a global batch are the same whatever the world size, the number of
    loader workers or a resume in between."""

    def __init__(self, vocab: Vocab, mlm_probability: float, seed: int):
        self.vocab = vocab
        self.p = mlm_probability
        self.seed = seed
        self.special = np.array(vocab.special_ids)
        # Random replacements come from the ordinary tokens, never from the special ones.
        self.random_pool = np.setdiff1d(np.arange(vocab.size), self.special)

    def mask_one(self, ids: np.ndarray, position: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, position])
        draw = rng.random(ids.shape)
        choice = rng.random(ids.shape)
        maskable = ~np.isin(ids, self.special)
        picked = (draw < self.p) & maskable
        labels = np.where(picked, ids, IGNORE_INDEX)
        out = ids.copy()
        out[picked & (choice < 0.8)] = self.vocab.mask_id
        randomised = picked & (choice >= 0.8) & (choice < 0.9)
        out[randomised] = rng.choice(self.random_pool, size=int(randomised.sum()))
        return out, labels

    def __call__(self, samples: list[dict]) -> dict:
        pairs = [self.mask_one(s["input_ids"].numpy(), s["position"]) for s in samples]
        input_ids = torch.from_numpy(np.stack([p[0] for p in pairs]))
        labels = torch.from_numpy(np.stack([p[1] for p in pairs]))
        return {"input_ids": input_ids, "labels": labels, "num_targets": int((labels != IGNORE_INDEX).sum())}
