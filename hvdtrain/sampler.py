"""Which samples each rank reads at each step.

The data is treated as one endless stream: epoch 0's shuffled order, then epoch 1's, and
so on (each epoch a fresh permutation from the seed and the epoch, computed per position by
`permute`: no table, so memory does not grow with the dataset). Optimizer step `s` consumes stream
positions [s*G, (s+1)*G) where G is the global batch. So:

* the samples of a global batch depend only on the seed, the dataset and G, never on the
  world size: 1 worker with 4 accumulation steps and 4 workers with 1 see the same data;
* every sample is used exactly once per epoch, including the tail when G does not divide
  the dataset size: the last global batch of an epoch simply continues into the next epoch;
* resuming needs one number, the stream position, and jumps there directly (no replay).

Within a global batch, rank r takes the r-th contiguous slice of micro_batch*accum samples
and cuts it into `accum` micro batches. Ranks' slices are disjoint; together they cover G.
"""
import numpy as np
import torch

from hvdtrain.data.randomness import hash_int, mix64

FEISTEL_ROUNDS = 6  # 4 already make a pseudorandom permutation (Luby-Rackoff); 2 more for margin


def permute(offsets: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """Where each of `offsets` (in [0, n)) goes in epoch `epoch`'s shuffled order: a seeded
    bijection on [0, n), evaluated per element with no table of n entries.

    A Feistel network over the smallest domain of 4**h >= n values (h bits per half, each round
    mixing one half with a hash of the other and a round key from (seed, epoch, round)) is a
    bijection on [0, 4**h); cycle walking (apply it again while the result is >= n) restricts it
    to a bijection on [0, n). The domain is less than 4n, so that takes under 4 rounds of the
    network on average, vectorised over all offsets at once."""
    half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = [np.uint64(hash_int(seed, epoch, r)) for r in range(FEISTEL_ROUNDS)]
    x = np.asarray(offsets, dtype=np.uint64).copy()
    todo = np.arange(len(x))  # the elements still walking
    while len(todo):
        left, right = x[todo] >> np.uint64(half), x[todo] & mask
        for key in keys:
            left, right = right, left ^ (mix64(right ^ key) & mask)
        x[todo] = (left << np.uint64(half)) | right
        todo = todo[x[todo] >= np.uint64(n)]
    return x.astype(np.int64)


class StreamSampler(torch.utils.data.Sampler):
    """Yields this rank's micro batches as lists of (stream_position, dataset_index) keys.

    Use as `DataLoader(dataset, batch_sampler=StreamSampler(...))`. The position travels with
    the sample so per-sample randomness (e.g. BERT masking) can be seeded from it, which makes
    it independent of the world size and exact on resume.
    """

    def __init__(self, dataset_size: int, micro_batch: int, grad_accum: int, rank: int, world_size: int,
                 seed: int, start_position: int = 0, max_steps: int | None = None):
        self.n = dataset_size
        self.micro_batch = micro_batch
        self.grad_accum = grad_accum
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.global_batch = micro_batch * grad_accum * world_size
        if start_position % self.global_batch:
            # Checkpoints store positions at step boundaries; a different global batch on
            # resume is allowed as long as the position still falls on a step boundary.
            raise ValueError(f"start position {start_position} is not a multiple of the global batch {self.global_batch}")
        self.start_position = start_position
        self.max_steps = max_steps

    def keys(self, start: int, count: int) -> list[tuple[int, int]]:
        """(position, dataset index) for stream positions [start, start+count)."""
        positions = np.arange(start, start + count, dtype=np.int64)
        epochs, offsets = np.divmod(positions, self.n)
        indices = np.empty_like(offsets)
        for epoch in np.unique(epochs):  # one, or two where the range crosses an epoch's end
            picked = epochs == epoch
            indices[picked] = permute(offsets[picked], self.n, self.seed, int(epoch))
        return list(zip(positions.tolist(), indices.tolist()))

    def global_batch_keys(self, step: int) -> list[tuple[int, int]]:
        return self.keys(step * self.global_batch, self.global_batch)

    def rank_slice(self, step: int) -> list[tuple[int, int]]:
        per_rank = self.micro_batch * self.grad_accum
        return self.keys(step * self.global_batch + self.rank * per_rank, per_rank)

    def __iter__(self):
        step = self.start_position // self.global_batch
        while self.max_steps is None or step < self.max_steps:
            mine = self.rank_slice(step)
            for i in range(self.grad_accum):
                yield mine[i * self.micro_batch:(i + 1) * self.micro_batch]
            step += 1

    def __len__(self):
        if self.max_steps is None:
            raise TypeError("an endless sampler has no length")
        return max(0, self.max_steps - self.start_position // self.global_batch) * self.grad_accum


class EvalSampler(torch.utils.data.Sampler):
    """The same `batches` micro batches of the validation set at every evaluation, whatever
    the world size: micro batch b holds samples [b*micro, (b+1)*micro) (wrapping around a
    small set), and rank r evaluates batches r, r+W, r+2W, ... Results are summed over ranks."""

    def __init__(self, dataset_size: int, micro_batch: int, batches: int, rank: int, world_size: int):
        self.batches = [[(i, i % dataset_size) for i in range(b * micro_batch, (b + 1) * micro_batch)]
                        for b in range(rank, batches, world_size)]

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)
