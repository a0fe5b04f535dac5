"""Random numbers that are pure functions of counters, so that they never depend on which
process draws them, in what order, or how often: BERT's masks (a function of the sample's
stream position), the held-out validation documents (a function of the document's position
in the corpus), the sampler's permutation and each epoch's block grid. numpy only, so the
tokenizing processes can use it too."""
import numpy as np

GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection on uint64 whose every output bit depends on every
    input bit. Wraps around on overflow, as it is meant to."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def hash_counters(*counters) -> np.ndarray:
    """64-bit hashes of a few non-negative counters (e.g. seed, epoch, round), mix64 chained;
    arrays among them broadcast, so one call hashes many."""
    z = np.uint64(0)
    with np.errstate(over="ignore"):
        for c in counters:
            z = mix64((z + GOLDEN) ^ np.asarray(c, dtype=np.uint64))
    return z


def uniform(seed: int, positions: np.ndarray, length: int, stream: int) -> np.ndarray:
    """Uniform [0, 1) numbers, shape (len(positions), length), a pure function of (seed, stream
    position, token index, stream): the splitmix64 hash, vectorised over the whole batch, so
    there is no per-sample generator to create (that cost ~2% of a tiny model's step)."""
    with np.errstate(over="ignore"):
        z = (positions.astype(np.uint64)[:, None] * np.uint64(length) + np.arange(length, dtype=np.uint64))
        z = z * np.uint64(8) + np.uint64(stream) + np.uint64(seed) * GOLDEN
        z = mix64(z + GOLDEN)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


FEISTEL_ROUNDS = 6  # 4 already make a pseudorandom permutation (Luby-Rackoff); 2 more for margin


def permute(offsets: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """Where each of `offsets` (in [0, n)) goes in epoch `epoch`'s shuffled order: a seeded
    bijection on [0, n), evaluated per element with no table of n entries.

    A Feistel network over the smallest domain of 4**h >= n values (h bits per half, each round
    mixing one half with a hash of the other and a round key from (seed, epoch, round)) is a
    bijection on [0, 4**h); cycle walking (apply it again while the result is >= n) restricts it
    to a bijection on [0, n). The domain is less than 4n, so that takes under 4 passes of the
    network on average, vectorised over all offsets at once."""
    half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = hash_counters(seed, epoch, np.arange(FEISTEL_ROUNDS))
    x = np.asarray(offsets, dtype=np.uint64).copy()
    todo = np.arange(len(x))  # the elements still walking
    while len(todo):
        left, right = x[todo] >> np.uint64(half), x[todo] & mask
        for key in keys:
            left, right = right, left ^ (mix64(right ^ key) & mask)
        x[todo] = (left << np.uint64(half)) | right
        todo = todo[x[todo] >= np.uint64(n)]
    return x.astype(np.int64)
