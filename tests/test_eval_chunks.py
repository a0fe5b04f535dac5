"""Evaluation's loss and accuracy from chunks of positions (models.common.evaluation_sums), as the
training loss is: the same numbers as the whole micro batch's logits, and never more memory than
a training step, whatever the vocabulary (issue 35: a 128k vocabulary)."""
from contextlib import nullcontext

import horovod.torch as hvd
import pytest
import torch

from hvdtrain.config import ModelConfig
from hvdtrain.models.common import (IGNORE_INDEX, LOSS_CHUNK_ELEMENTS, Vocab, build_model, evaluation_sums,
                                    logits_and_labels, token_loss_sum)
from hvdtrain.models.model_build import PeakRise
from hvdtrain.training.step_engine import PlainStep
from tests.test_loss import FP32_RTOL, tiny


def whole_logits_sums(model, batch):
    """What evaluation computed before: the whole micro batch's logits, then the picked positions."""
    logits, labels = logits_and_labels(model, batch)
    picked = labels != IGNORE_INDEX
    loss = torch.nn.functional.cross_entropy(logits[picked].float(), labels[picked], reduction="sum")
    return loss, (logits[picked].argmax(-1) == labels[picked]).sum(), int(picked.sum())


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
@pytest.mark.parametrize("rows", [5, 1000])  # a ragged last chunk; one chunk
def test_chunked_evaluation_equals_whole_logits(arch, rows):
    model, batch = tiny(arch)
    model.eval()
    with torch.no_grad():
        expected_loss, expected_hits, expected_targets = whole_logits_sums(model, batch)
        loss, hits, targets = evaluation_sums(model, batch, chunk_elements=rows * 256)
    assert targets == expected_targets > 0
    assert loss.item() == pytest.approx(expected_loss.item(), rel=FP32_RTOL)
    # An argmax can only differ where two logits tie within rounding: none do in a random model.
    assert hits.item() == expected_hits.item()


def test_evaluation_with_a_128k_vocabulary_peaks_at_most_at_training():
    """A 2 x 64 Llama with Llama 3's 128,256-token vocabulary, one micro batch of 8 x 256: its whole
    fp32 logits are 1.05 GB, four of the loss's chunks (LOSS_CHUNK_ELEMENTS). The engine's evaluation
    and a training step's forward and backward, each measured as its process's peak rise."""
    hvd.init()  # one process: evaluation's allreduce of its sums is skipped
    torch.manual_seed(0)
    vocab = Vocab(size=128256, pad_id=0, bos_id=1, eos_id=2)
    model = build_model(ModelConfig(arch="llama", n_layer=2, n_head=2, d_model=64, d_ff=128, dropout=0.0), vocab, 256)
    ids = torch.randint(3, vocab.size, (8, 256))
    batch = {"input_ids": ids, "labels": torch.cat([ids[:, 1:], torch.full((8, 1), IGNORE_INDEX)], dim=1)}
    whole_logits = ids.numel() * 128256 * 4
    assert whole_logits > 3.9 * LOSS_CHUNK_ELEMENTS * 4  # several chunks, or nothing is measured

    def train_step():
        token_loss_sum(model, batch).backward()

    train_step()  # the gradients exist from now on, as in a run
    engine = PlainStep(model, None, None, None, nullcontext(), torch.device("cpu"))
    with PeakRise() as evaluation:
        result = engine.evaluate([batch])
    with PeakRise() as training:
        train_step()
    assert result["eval_loss"] == pytest.approx(11.76, abs=0.2)  # ln(128256): an untrained model
    # at most training's, to the allocator's noise (once 128 KB over, after other tests in the process)
    assert evaluation.rise <= 1.01 * training.rise, (evaluation.rise, training.rise)
    # One chunk's logits and their log-softmax (2 x 256 MB), where the former path held the whole
    # logits and two copies of the picked positions' (3 x 1.05 GB).
    assert evaluation.rise < 0.6 * whole_logits, (evaluation.rise, whole_logits)


def test_a_pipeline_s_last_stage_scores_a_128k_vocabulary_in_chunks():
    """pipeline.TokenLoss, the loss of a pipeline's last stage in training and evaluation: the
    same chunks as the whole model's (the same loss), never a micro batch's whole logits."""
    from hvdtrain.parallel import parallel_dims, pipeline

    vocab = Vocab(size=128256, pad_id=0, bos_id=1, eos_id=2)
    config = ModelConfig(arch="llama", n_layer=2, n_head=2, d_model=64, d_ff=128, dropout=0.0)
    first, last = [pipeline.split_model(build_model(config, vocab, 256), parallel_dims.Layout(2, 1, s, 0), [0, 1, 2])
                   for s in range(2)]
    ids = torch.randint(3, vocab.size, (8, 256))
    labels = torch.cat([ids[:, 1:], torch.full((8, 1), IGNORE_INDEX)], dim=1)
    with torch.no_grad():
        hidden = first.chunks[0](ids)
        with PeakRise() as evaluation:
            loss = pipeline.TokenLoss(last, 1.0)(last.chunks[0](hidden), labels)
    assert loss.item() / (labels != IGNORE_INDEX).sum().item() == pytest.approx(11.76, abs=0.2)  # ln(128256)
    whole_logits = ids.numel() * 128256 * 4
    assert evaluation.rise < 0.6 * whole_logits, (evaluation.rise, whole_logits)


def test_plan_counts_the_loss_chunk_training_allocates():
    """hvdtrain plan's "logits and loss" of the whole model (plan.loss_chunk_bytes) against the peak
    rise of the chunked loss's forward and backward, measured: a 128k vocabulary, 2048 positions
    of width 64 (four chunks). The measurement also holds the head's and the inputs' new .grad
    (vocabulary x d_model and positions x d_model fp32), which the plan counts as gradients."""
    from hvdtrain.config import config_from_dict
    from hvdtrain.models.common import linear_cross_entropy_sum
    from hvdtrain.tools import plan

    assert plan.LOSS_CHUNK_ELEMENTS == LOSS_CHUNK_ELEMENTS
    positions, d, v = 2048, 64, 128256
    cfg = config_from_dict({"model": {"arch": "llama", "n_layer": 2, "n_head": 2, "d_model": d},
                            "data": {"seq_len": 256, "vocab_size": v}, "train": {"precision": "fp32"}})
    torch.manual_seed(0)
    x = torch.randn(positions, d, requires_grad=True)
    w = (torch.randn(v, d) * 0.02).requires_grad_()
    targets = torch.randint(0, v, (positions,))
    with PeakRise() as measured:
        linear_cross_entropy_sum(x, w, None, targets).backward()
    predicted = plan.loss_chunk_bytes(cfg, positions // 256) + 4 * (v * d + positions * d)
    # The plan may not count less than is allocated; it counts up to a fifth more where the
    # allocator reuses freed chunks (measured 0.84 to 1.0 of it on different CPUs).
    assert 0.75 * predicted <= measured.rise <= 1.05 * predicted, (measured.rise, predicted)
    # Whole logits (fp32, their log-softmax and two gradients of that size): over four times it.
    assert positions * v * 16 > 4 * measured.rise


def test_two_workers_score_the_whole_uneven_split_as_one(tmp_path, tiny_config):
    """256 synthetic blocks hold 25 for validation: 7 micro batches of 4 (the last with one block),
    4 on rank 0 and 3 on rank 1 of a real 2-worker run. Both ranks finish their evaluations (no
    deadlock) and score the same loss and accuracy as one worker, before and after training."""
    import json

    from helpers import RTOL, train_workers
    config = tiny_config({"eval": {"batches": None}, "train": {"global_batch_size": 8, "max_steps": 2}})
    records = {}
    for np in (1, 2):
        train_workers(np, config, f"out_dir={tmp_path / str(np)}")
        lines = (tmp_path / str(np) / "metrics.jsonl").read_text().splitlines()
        records[np] = [r for r in map(json.loads, lines) if "eval_loss" in r]
    assert [r["step"] for r in records[1]] == [r["step"] for r in records[2]] == [0, 2]
    for one, two in zip(records[1], records[2]):
        assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=RTOL)
        assert two["eval_accuracy"] == pytest.approx(one["eval_accuracy"], rel=RTOL)
