"""The stream sampler: disjoint, covering, reshuffled per epoch (a permutation without a
table), deterministic, and the same global batches whatever the world size; and each epoch's
grid of token blocks (no processes needed)."""
import time
import tracemalloc

import numpy as np
import pytest
import torch

from hvdtrain.config import load_config, resolve_batch
from hvdtrain.data.bundle import TokenBlocks
from hvdtrain.data.randomness import permute
from hvdtrain.data.token_files import TokenStream
from hvdtrain.errors import UserError
from hvdtrain.data.sampler import STAND_IN, EvalSampler, StreamSampler


def rank_batches(n, micro, accum, world, seed=0, steps=10, start=0):
    """{rank: list of micro batches (lists of (position, epoch, index))} for `steps` steps."""
    return {r: list(StreamSampler(n, micro * accum * world, accum, r, world, seed, start_position=start,
                                  max_steps=steps))
            for r in range(world)}


def global_batches(n, micro, accum, world, seed=0, steps=10, start=0):
    """Per step: the multiset of dataset indices all ranks read, as a sorted list."""
    per_rank = rank_batches(n, micro, accum, world, seed, steps, start)
    out = []
    for s in range(steps - start // (micro * accum * world)):
        keys = [k for r in range(world) for mb in per_rank[r][s * accum:(s + 1) * accum] for k in mb]
        out.append(sorted(i for _, _, i in keys))
    return out


@pytest.mark.parametrize("n", [64, 67, 101])  # divisible and odd dataset sizes
def test_each_epoch_covers_the_dataset_once_and_shards_are_disjoint(n):
    micro, accum, world = 2, 2, 2
    per_rank = rank_batches(n, micro, accum, world, steps=60)
    positions = {}
    for batches in per_rank.values():
        for pos, epoch, idx in (k for mb in batches for k in mb):
            assert pos not in positions, "a stream position was read by two ranks"
            assert epoch == pos // n
            positions[pos] = idx
    assert sorted(positions) == list(range(len(positions)))  # no gaps
    full_epochs = len(positions) // n
    assert full_epochs >= 2
    for e in range(full_epochs):
        assert sorted(positions[p] for p in range(e * n, (e + 1) * n)) == list(range(n))
    epoch0 = [positions[p] for p in range(n)]
    epoch1 = [positions[p] for p in range(n, 2 * n)]
    assert epoch0 != epoch1, "each epoch must be reshuffled"


def test_tail_of_an_epoch_continues_into_the_next():
    """67 samples, global batch 8: step 8 holds the last 3 samples of epoch 0 and 5 of epoch 1."""
    s = StreamSampler(67, 8, 1, 0, 2, seed=1)
    keys = s.global_batch_keys(8)
    assert [p for p, _, _ in keys] == list(range(64, 72))
    assert [e for _, e, _ in keys] == [0] * 3 + [1] * 5
    epoch0_tail = {i for p, _, i in keys if p < 67}
    seen_before = {i for step in range(8) for _, _, i in s.global_batch_keys(step)}
    assert len(epoch0_tail) == 3 and not epoch0_tail & seen_before
    assert seen_before | epoch0_tail == set(range(67))


def test_deterministic_and_seed_dependent():
    assert global_batches(50, 2, 1, 2, seed=3) == global_batches(50, 2, 1, 2, seed=3)
    assert global_batches(50, 2, 1, 2, seed=3) != global_batches(50, 2, 1, 2, seed=4)


def test_global_batch_is_the_same_for_1_2_and_4_workers():
    """Global batch 8: 1 worker x accum 4 x micro 2, 2 x 2 x 2, 4 x 1 x 2."""
    one = global_batches(37, 2, 4, 1, seed=5, steps=12)
    two = global_batches(37, 2, 2, 2, seed=5, steps=12)
    four = global_batches(37, 2, 1, 4, seed=5, steps=12)
    assert one == two == four


def test_resume_jumps_to_the_next_unseen_sample():
    full = rank_batches(45, 2, 2, 2, seed=9, steps=10)
    resumed = rank_batches(45, 2, 2, 2, seed=9, steps=10, start=4 * 8)
    for r in range(2):
        assert resumed[r] == full[r][4 * 2:]
    # resume with another world size: same global batches from the same position
    assert global_batches(45, 2, 4, 1, seed=9, steps=10, start=32) == global_batches(45, 2, 2, 2, seed=9, steps=10)[4:]


def test_resume_does_not_iterate_through_seen_batches():
    """Starting at a position far away costs no replay: the keys there are computed directly."""
    s = StreamSampler(1000, 10, 1, 0, 1, seed=0, start_position=10_000_000, max_steps=1_000_001)  # world of 1
    start = time.perf_counter()
    first = next(iter(s))
    assert time.perf_counter() - start < 1.0
    assert [p for p, _, _ in first] == list(range(10_000_000, 10_000_010))
    assert first == StreamSampler(1000, 10, 1, 0, 1, seed=0).keys(10_000_000, 10)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 16, 17, 64, 97, 1000, 1024, 4099, 65_536])  # primes, powers of 2
def test_permutation_covers_every_index_once(n):
    for seed, epoch in [(0, 0), (7, 3)]:
        order = permute(np.arange(n), n, seed, epoch)
        assert np.array_equal(np.sort(order), np.arange(n))


def test_permutation_differs_per_epoch_and_seed_and_looks_shuffled():
    n = 10_000
    orders = {(seed, epoch): permute(np.arange(n), n, seed, epoch).tolist() for seed in (0, 1) for epoch in (0, 1, 2)}
    assert len({tuple(o) for o in orders.values()}) == len(orders)
    for order in orders.values():  # no trace of the input order: rank correlation ~ 1/sqrt(n)
        assert abs(np.corrcoef(np.arange(n), order)[0, 1]) < 0.05
        assert np.mean(np.abs(np.diff(order)) == 1) < 0.01  # neighbours do not stay neighbours


def test_permutation_needs_no_table_at_a_billion_blocks():
    """1T tokens in 1024-token blocks: a step's keys take kilobytes, not 8 bytes per block."""
    n = 10 ** 9
    sampler = StreamSampler(n, 512, 4, 3, 16, seed=1)
    tracemalloc.start()
    start = time.perf_counter()
    keys = sampler.rank_slice(5 * n // 512 + 1000)  # in epoch 5
    elapsed = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(keys) == 32 and all(0 <= i < n and e == 5 for _, e, i in keys)
    assert peak < 1_000_000, f"{peak} bytes for 32 keys"
    assert elapsed < 0.5
    big = permute(np.arange(0, n, 15_259), n, 1, 5)  # a global batch of 65,536 keys
    assert len(np.unique(big)) == len(big) and big.max() < n


def test_a_step_of_keys_is_fast():
    sampler = StreamSampler(50_000_000, 65_536, 8, 0, 256, seed=2)
    start = time.perf_counter()
    keys = sampler.global_batch_keys(10)
    assert len(keys) == 65_536 and time.perf_counter() - start < 1.0


def test_start_position_must_fall_on_a_step_boundary():
    with pytest.raises(ValueError):
        StreamSampler(100, 8, 1, 0, 2, seed=0, start_position=4)


@pytest.mark.parametrize("global_batch, world, micro", [(512, 7, 8), (9, 2, 3), (10, 4, 8), (5, 2, 1), (7, 3, 1),
                                                          (12, 2, 4), (6, 6, 2)])
def test_uneven_shares_cover_the_global_batch_once_in_the_same_number_of_micro_batches(global_batch, world, micro):
    """Global batches the world does not divide (512 on 7 workers at micro batch 8): each rank a
    contiguous share, all ranks the same number of micro batches, none larger than micro, and
    the same global batches as one worker reads."""
    cfg = load_config(None, [f"train.global_batch_size={global_batch}", f"train.micro_batch_size={micro}"])
    accum, resolved = resolve_batch(cfg, world)
    assert resolved == global_batch
    steps, n, accum_alone = 4, 1000, resolve_batch(cfg, 1)[0]
    per_rank = [list(StreamSampler(n, global_batch, accum, r, world, seed=3, max_steps=steps)) for r in range(world)]
    alone = list(StreamSampler(n, global_batch, accum_alone, 0, 1, seed=3, max_steps=steps))
    stand_ins = 0
    for step in range(steps):
        micro_batches = [mb for r in range(world) for mb in per_rank[r][step * accum:(step + 1) * accum]]
        assert len(micro_batches) == world * accum and all(1 <= len(mb) <= micro for mb in micro_batches)
        keys = [k for mb in micro_batches for k in mb if k is not STAND_IN]
        stand_ins += sum(k is STAND_IN for mb in micro_batches for k in mb)
        assert [k[0] for k in keys] == list(range(step * global_batch, (step + 1) * global_batch))
        assert keys == [k for mb in alone[step * accum_alone:(step + 1) * accum_alone] for k in mb]
    # A stand-in only where a share is shorter than the micro batches: micro batch 1, uneven shares.
    assert (stand_ins > 0) == (micro == 1 and global_batch % world != 0)


def test_a_stand_in_sample_predicts_nothing():
    """The key of an empty micro batch's place: block 0, no targets, no masks (GPT and BERT)."""
    from hvdtrain.data.collate import CausalLMCollator, MaskedLMCollator
    from hvdtrain.models.common import IGNORE_INDEX, Vocab
    blocks = stream_blocks(100, 10)
    samples = [blocks[(5, 0, 3)], blocks[STAND_IN]]
    assert samples[1]["position"] is None and samples[1]["input_ids"].tolist() == list(range(10))
    gpt = CausalLMCollator()(samples)
    assert gpt["num_targets"] == 9 and (gpt["labels"][1] == IGNORE_INDEX).all()
    assert gpt["labels"][0, :-1].tolist() == list(range(31, 40))
    vocab = Vocab(size=200, pad_id=0, cls_id=2, sep_id=3, mask_id=4)
    bert = MaskedLMCollator(vocab, 0.5, seed=1)(samples)
    assert (bert["labels"][1] == IGNORE_INDEX).all() and bert["input_ids"][1].tolist() == list(range(10))
    assert bert["num_targets"] == int((bert["labels"][0] != IGNORE_INDEX).sum()) > 0
    alone = MaskedLMCollator(vocab, 0.5, seed=1)(samples[:1])  # the real sample's masks are its own
    assert torch.equal(alone["labels"][0], bert["labels"][0])


def test_a_global_batch_smaller_than_the_workers_is_refused():
    cfg = load_config(None, ["train.global_batch_size=3", "train.micro_batch_size=1"])
    with pytest.raises(UserError, match="train.global_batch_size.*smaller than the 4 workers"):
        resolve_batch(cfg, 4)


@pytest.mark.parametrize("batches", [None, 99])
def test_eval_sampler_scores_the_whole_split_once_for_any_world_size(batches):
    """10 blocks in micro batches of 3: 4 micro batches, the last filled with 2 stand-ins, split
    over 1, 2, 3 (uneven: 2, 1, 1) or 4 ranks; every block once; the same at every evaluation."""
    def keys(world):
        per_rank = [[k for b in EvalSampler(10, 3, batches, r, world) for k in b] for r in range(world)]
        assert all(len(b) == 3 for r in range(world) for b in EvalSampler(10, 3, batches, r, world))
        return sorted(k for keys in per_rank for k in keys if k is not STAND_IN), sum(k is STAND_IN for keys in per_rank
                                                                                      for k in keys)
    assert keys(1) == keys(2) == keys(3) == keys(4) == ([(i, 0, i) for i in range(10)], 2)
    assert [len(EvalSampler(10, 3, batches, r, 3)) for r in range(3)] == [2, 1, 1]
    assert list(EvalSampler(10, 3, batches, 0, 1)) == list(EvalSampler(10, 3, batches, 0, 1))


def test_eval_sampler_cap_takes_the_first_micro_batches():
    capped = [k for b in EvalSampler(10, 3, 2, 0, 1) for k in b]
    assert capped == [(i, 0, i) for i in range(6)]


def test_eval_batches_default_is_the_whole_split_and_a_cap_is_checked():
    assert load_config(None, []).eval.batches is None
    assert load_config(None, ["eval.batches=4"]).eval.batches == 4
    with pytest.raises(UserError, match="eval.batches"):
        load_config(None, ["eval.batches=0"])


# ---------------------------------------------------------------- each epoch's block grid

def stream_blocks(length, width, grid_seed=3):
    """TokenBlocks over tokens 0, 1, ..., length-1: a block's first token is where it starts."""
    tokens = np.arange(length, dtype=np.int32)
    return TokenBlocks(TokenStream([tokens], [length], tokens.dtype), width, grid_seed=grid_seed)


@pytest.mark.parametrize("length, width", [(1000, 16), (1007, 16), (100, 7), (33, 16)])
def test_every_epoch_cuts_new_windows_of_the_stream_with_the_same_number_of_blocks(length, width):
    blocks = stream_blocks(length, width)
    n = len(blocks)
    epoch0 = [blocks.block(i, 0).tolist() for i in range(n)]
    assert epoch0 == [list(range(i * width, (i + 1) * width)) for i in range(n)]  # one-epoch runs unchanged
    offsets = []
    for epoch in range(1, 3 * width):
        grid = [blocks.block(i, epoch) for i in range(n)]
        start = grid[0][0]
        offsets.append(int(start))
        for i, block in enumerate(grid):  # windows of the stream, wrapping around its end
            assert block.tolist() == [(start + i * width + k) % length for k in range(width)]
        tokens = np.concatenate(grid)
        assert len(np.unique(tokens)) == n * width, "a token read twice in one epoch"
        if start != 0:  # never in epochs 1 .. width-1 (checked below)
            assert not {tuple(b.tolist()) for b in grid} & {tuple(b) for b in epoch0}, "an epoch-0 window again"
    # Any `width` consecutive rounds' epochs have different offsets: every offset once per round.
    assert sorted([0] + offsets[:width - 1]) == list(range(width))
    assert sorted(offsets[width - 1:2 * width - 1]) == list(range(width))
    assert offsets != [o for o in [stream_blocks(length, width, grid_seed=4).block(0, e)[0] for e in range(1, 3 * width)]]


def test_a_fixed_grid_without_a_seed_and_keys_name_the_epoch():
    fixed = stream_blocks(100, 10, grid_seed=None)
    assert all(fixed.block(3, e).tolist() == list(range(30, 40)) for e in range(5))
    shifted = stream_blocks(100, 10)
    sample = shifted[(123, 2, 4)]
    assert sample["position"] == 123 and sample["input_ids"].tolist() == shifted.block(4, 2).tolist()
    assert shifted.block(4, 2).tolist() != fixed.block(4, 2).tolist()
