"""A global batch the workers do not divide (plain runs; elastic jobs in test_elastic.py): ranks
take uneven shares of it, and the run equals one worker's with real horovodrun workers."""
import pytest

from helpers import assert_same_losses, assert_same_params, load_params, step_losses, train_workers

pytestmark = pytest.mark.workers


@pytest.mark.parametrize("arch, micro", [("gpt2", 1), pytest.param("bert", 2, marks=pytest.mark.deep)])
def test_two_workers_with_uneven_shares_equal_one_worker(tmp_path, tiny_config, arch, micro):
    """Global batch 5 on 2 workers: shares of 2 and 3 samples. At micro batch 1 every rank runs
    3 micro batches and the share of 2 fills one with a stand-in that predicts nothing; at micro
    batch 2 the micro batches hold 1 or 2 samples. BERT: masks by stream position, so the same."""
    config = tiny_config({"model": {"arch": arch}, "train": {"global_batch_size": 5, "micro_batch_size": micro,
                                                             "max_steps": 6}})
    one, two = tmp_path / "one", tmp_path / "two"
    train_workers(1, config, f"out_dir={one}")
    proc = train_workers(2, config, f"out_dir={two}")
    assert "2 data-parallel workers x 3 or 2 samples in" in proc.stdout
    assert_same_losses(step_losses(one), step_losses(two), min_steps=6)
    # 1e-4: the attention's key bias has a zero gradient in exact arithmetic (softmax ignores a
    # shift shared by all keys), so its gradient is rounding noise, which Adam divides by its
    # eps; every other parameter agrees within 1e-6.
    assert_same_params(load_params(one, 0), load_params(two, 1), atol=1e-4)
