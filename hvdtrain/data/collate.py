"""Turn fixed-length token blocks into training batches.

Both collators return `input_ids`, `labels` aligned with the model's outputs (IGNORE_INDEX
where nothing is predicted) and `num_targets`, the number of labelled positions, which the
training loop sums over the whole optimizer step to normalise the loss. A sample without a
stream position (the sampler's stand-in for an empty micro batch) predicts nothing.
"""
import numpy as np
import torch

from hvdtrain.data.randomness import uniform
from hvdtrain.models.common import IGNORE_INDEX, Vocab


class CausalLMCollator:
    """GPT: predict token t+1 from tokens <= t. The last position of a block has no target."""

    def __call__(self, samples: list[dict]) -> dict:
        input_ids = torch.stack([s["input_ids"] for s in samples])
        predicting = torch.tensor([s["position"] is not None for s in samples])
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        labels[predicting, :-1] = input_ids[predicting, 1:]
        return {"input_ids": input_ids, "labels": labels,
                "num_targets": int(predicting.sum()) * (input_ids.shape[1] - 1)}


class MaskedLMCollator:
    """BERT dynamic masking: each step draws new masks (15% of non-special tokens; of those
    80% become [MASK], 10% a random token, 10% stay), as DataCollatorForLanguageModeling does.

    The random draws of a sample are a function of (seed, its stream position), not of a
    per-process RNG, so the masks of a global batch are the same whatever the world size, the
    number of loader workers or a resume in between, and differ between epochs."""

    def __init__(self, vocab: Vocab, mlm_probability: float, seed: int):
        self.vocab = vocab
        self.p = mlm_probability
        self.seed = seed
        self.special = np.array(vocab.special_ids)
        # Random replacements come from the ordinary tokens, never from the special ones.
        self.random_pool = np.setdiff1d(np.arange(vocab.size), self.special)

    def __call__(self, samples: list[dict]) -> dict:
        ids = np.stack([s["input_ids"].numpy() for s in samples])
        predicting = np.array([s["position"] is not None for s in samples])
        positions = np.array([s["position"] if s["position"] is not None else 0 for s in samples])
        draw, choice, pick = (uniform(self.seed, positions, ids.shape[1], k) for k in range(3))
        masked = (draw < self.p) & ~np.isin(ids, self.special) & predicting[:, None]
        labels = np.where(masked, ids, IGNORE_INDEX)
        out = ids.copy()
        out[masked & (choice < 0.8)] = self.vocab.mask_id
        randomised = masked & (choice >= 0.8) & (choice < 0.9)
        out[randomised] = self.random_pool[(pick[randomised] * len(self.random_pool)).astype(np.int64)]
        return {"input_ids": torch.from_numpy(out), "labels": torch.from_numpy(labels),
                "num_targets": int(masked.sum())}
