"""Data parallelism must not change the maths: np=2 equals np=1 and accumulation equals a
bigger micro batch, step by step, with real horovodrun workers."""
import pytest

from helpers import assert_same_losses, assert_same_params, load_params, step_losses, train_workers

pytestmark = pytest.mark.workers


@pytest.mark.parametrize("model", [
    {"arch": "gpt2"}, {"arch": "bert"},
    pytest.param({"arch": "llama", "n_kv_head": 1}, marks=pytest.mark.deep),
    pytest.param({"arch": "modernbert", "local_attention": 8}, marks=pytest.mark.deep),
], ids=["gpt2", "bert", "llama", "modernbert"])
def test_two_workers_equal_one_worker(tmp_path, tiny_config, model):
    """Same global batch (4 x 2): np=1 accumulates 2 micro batches, np=2 runs 1 per rank.
    BERT's random masks give ranks different numbers of target tokens each step. Llama with
    grouped-query attention (both query heads share one key/value head); ModernBERT with its
    second layer attending to 8 of the 16 positions."""
    config = tiny_config({"model": model, "train": {"global_batch_size": 8}})
    one, two = tmp_path / "np1", tmp_path / "np2"
    train_workers(1, config, f"out_dir={one}")
    train_workers(2, config, f"out_dir={two}")
    assert_same_losses(step_losses(one), step_losses(two))
    # Every rank ends with exactly the same parameters ...
    assert_same_params(load_params(two, 0), load_params(two, 1))
    # ... and they match the single worker's up to float rounding.
    assert_same_params(load_params(one, 0), load_params(two, 0), atol=1e-5)


@pytest.mark.deep
def test_accumulation_equals_bigger_micro_batch_masked_lm(tmp_path, tiny_config):
    """grad_accum=2 x micro 4 equals micro 8 on 2 workers, with uneven target counts per rank."""
    config = tiny_config({"model": {"arch": "bert"}})
    accum, big = tmp_path / "accum", tmp_path / "big"
    train_workers(2, config, f"out_dir={accum}", "train.micro_batch_size=4", "train.grad_accum=2")
    train_workers(2, config, f"out_dir={big}", "train.micro_batch_size=8", "train.grad_accum=1")
    assert_same_losses(step_losses(accum), step_losses(big))
    assert_same_params(load_params(accum, 0), load_params(big, 0), atol=1e-5)
