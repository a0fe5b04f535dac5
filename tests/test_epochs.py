"""Many epochs of a small text corpus with real horovodrun workers: every epoch cuts the token
stream on a new grid (hvdtrain.data.bundle.TokenBlocks), and the guarantees of one epoch still
hold across epochs: 2 workers equal 1, and a run stopped in the middle of epoch 2 resumes
exactly, its data continuing from the stream position."""
import pytest

from helpers import assert_same_losses, assert_same_params, load_params, step_losses, train_workers
from hvdtrain.config import load_config
from hvdtrain.data import build_data

pytestmark = pytest.mark.workers

# About 93 blocks of 32 tokens, global batch 8: an epoch is ~11.6 steps, 32 steps ~2.75 epochs.
CORPUS = {"data": {"source": "builtin", "vocab_size": 600, "seq_len": 32, "validation_fraction": 0.1,
                   "tokenizer_sample_mb": 0.5, "max_tokens": 3000},
          "train": {"global_batch_size": 8, "max_steps": 32}, "eval": {"batches": 1},
          "checkpoint": {"every": 2, "keep": 1}}
STOP = 26  # stream position 208: epoch 2 began at 186


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from helpers import write_config
    folder = tmp_path_factory.mktemp("epochs")
    cache = f"data.cache_dir={folder / 'cache'}"
    config = write_config(folder / "config.yaml", CORPUS)
    train_workers(1, config, cache, f"out_dir={folder / 'one'}")
    return config, cache, folder / "one"


@pytest.mark.deep
def test_the_run_crosses_epochs_on_new_grids(corpus):
    config, cache, _ = corpus
    data = build_data(load_config(config, [cache]), seed=load_config(config).train.seed)
    n = len(data.train)
    assert 8 * STOP > 2 * n and 8 * CORPUS["train"]["max_steps"] < 3 * n
    assert data.train.grid_offset(0) == 0 and data.train.grid_offset(1) != 0 != data.train.grid_offset(2)
    assert data.train.block(0, 1).tolist() != data.train.block(0, 0).tolist()
    assert data.val.block(0, 1).tolist() == data.val.block(0, 0).tolist()  # the same validation set


def test_two_workers_equal_one_over_several_epochs(tmp_path, corpus):
    config, cache, one = corpus
    train_workers(2, config, cache, f"out_dir={tmp_path / 'two'}")
    assert_same_losses(step_losses(one), step_losses(tmp_path / "two"), min_steps=32)
    assert_same_params(load_params(one, 0), load_params(tmp_path / "two", 1), atol=1e-5)


@pytest.mark.deep
def test_a_stop_in_the_middle_of_epoch_2_resumes_exactly(tmp_path, corpus):
    config, cache, one = corpus
    out = tmp_path / "resumed"
    train_workers(2, config, cache, f"out_dir={out}", f"train.stop_at_step={STOP}")
    proc = train_workers(1, config, cache, f"out_dir={out}")
    assert f"resuming at step {STOP}" in proc.stdout
    losses = step_losses(out)
    assert sorted(losses) == list(range(1, 33))
    assert_same_losses(step_losses(one), losses, min_steps=32)
    assert_same_params(load_params(one, 0), load_params(out, 0), atol=1e-5)
