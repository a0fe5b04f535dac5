"""Which samples each rank reads at each step.

The data is treated as one endless stream: epoch 0's shuffled order, then epoch 1's, and
so on (each epoch a fresh permutation from the seed and the epoch, computed per position by
`permute`: no table, so memory does not grow with the dataset). Optimizer step `s` consumes
stream positions [s*G, (s+1)*G) where G is the global batch. So:

* the samples of a global batch depend only on the seed, the dataset and G, never on the
  world size: 1 worker with 4 accumulation steps and 4 workers with 1 see the same data;
* every sample is used exactly once per epoch, including the tail when G does not divide
  the dataset size: the last global batch of an epoch simply continues into the next epoch;
* resuming needs one number, the stream position, and jumps there directly (no replay).

A key names the epoch as well as the block: a dataset may cut each epoch differently (text
blocks are cut from a grid shifted per epoch, hvdtrain.data.bundle.TokenBlocks), with the
same number of blocks in every epoch.

Within a global batch, rank r of W takes the contiguous share [r*G//W, (r+1)*G//W) and cuts
it evenly into `accum` micro batches (config.resolve_batch chooses accum so that none is larger
than train.micro_batch_size). Shares are disjoint and together cover G. When W does not divide
G the shares differ by one sample, and so may the micro batches, but every rank runs the same
number of them (Horovod's backward_passes_per_step); the loss is normalised by the target
tokens of the whole step, so the step's gradient is the same as with even shares.
"""
import numpy as np
import torch

from hvdtrain.data.randomness import permute

STAND_IN = None  # the key of a micro batch's stand-in sample (see StreamSampler)


def share(global_batch: int, rank: int, world_size: int) -> range:
    """The places in each global batch that rank `rank` of `world_size` reads."""
    return range(rank * global_batch // world_size, (rank + 1) * global_batch // world_size)


class StreamSampler(torch.utils.data.Sampler):
    """Yields this rank's micro batches as lists of (stream position, epoch, block index) keys.

    Use as `DataLoader(dataset, batch_sampler=StreamSampler(...))`. The position travels with
    the sample so per-sample randomness (e.g. BERT masking) can be seeded from it, which makes
    it independent of the world size and exact on resume.

    A micro batch that would be empty (a share of fewer than `grad_accum` samples, which only
    micro batches of one sample allow) holds the key STAND_IN instead: a dataset serves it as a
    sample without a stream position, which the collators give no targets, so the rank still
    runs its backward pass and adds nothing to the gradients or the step's target count.
    """

    def __init__(self, dataset_size: int, global_batch: int, grad_accum: int, rank: int, world_size: int,
                 seed: int, start_position: int = 0, max_steps: int | None = None):
        self.n = dataset_size
        self.global_batch = global_batch
        self.grad_accum = grad_accum
        self.share = share(global_batch, rank, world_size)
        self.seed = seed
        if start_position % self.global_batch:
            # Checkpoints store positions at step boundaries; a different global batch on
            # resume is allowed as long as the position still falls on a step boundary.
            raise ValueError(f"start position {start_position} is not a multiple of the global batch "
                             f"{self.global_batch}")
        self.start_position = start_position
        self.max_steps = max_steps

    def keys(self, start: int, count: int) -> list[tuple[int, int, int]]:
        """(position, epoch, block index) for stream positions [start, start+count)."""
        positions = np.arange(start, start + count, dtype=np.int64)
        epochs, offsets = np.divmod(positions, self.n)
        indices = np.empty_like(offsets)
        for epoch in np.unique(epochs):  # one, or two where the range crosses an epoch's end
            picked = epochs == epoch
            indices[picked] = permute(offsets[picked], self.n, self.seed, int(epoch))
        return list(zip(positions.tolist(), epochs.tolist(), indices.tolist()))

    def global_batch_keys(self, step: int) -> list[tuple[int, int, int]]:
        return self.keys(step * self.global_batch, self.global_batch)

    def rank_slice(self, step: int) -> list[tuple[int, int, int]]:
        return self.keys(step * self.global_batch + self.share.start, len(self.share))

    def micro_batches(self, step: int) -> list[list]:
        """This rank's share of step `step`, cut evenly into grad_accum micro batches."""
        mine = self.rank_slice(step)
        cuts = [i * len(mine) // self.grad_accum for i in range(self.grad_accum + 1)]
        return [mine[a:b] or [STAND_IN] for a, b in zip(cuts, cuts[1:])]

    def __iter__(self):
        step = self.start_position // self.global_batch
        while self.max_steps is None or step < self.max_steps:
            yield from self.micro_batches(step)
            step += 1

    def __len__(self):
        if self.max_steps is None:
            raise TypeError("an endless sampler has no length")
        return max(0, self.max_steps - self.start_position // self.global_batch) * self.grad_accum


class EvalSampler(torch.utils.data.Sampler):
    """The validation blocks in order, in micro batches, the same at every evaluation whatever
    the world size: the whole set (`batches` None) or its first `batches` micro batches. Micro
    batch b holds blocks [b*micro, (b+1)*micro); the last one is filled up with STAND_IN keys
    (samples without targets), so every micro batch has the shape a pipeline stage expects and
    no block counts twice. Rank r evaluates micro batches r, r+W, r+2W, ...: ranks may get one
    more or fewer, which is safe as each rank's evaluation ends with one allreduce of its sums
    (every stage of a pipeline reads the same samples, so it runs the same schedules)."""

    def __init__(self, dataset_size: int, micro_batch: int, batches: int | None, rank: int, world_size: int):
        whole = -(-dataset_size // micro_batch)
        count = whole if batches is None else min(batches, whole)
        self.batches = [[(i, 0, i) if i < dataset_size else STAND_IN
                         for i in range(b * micro_batch, (b + 1) * micro_batch)]
                        for b in range(rank, count, world_size)]

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)
