"""token_loss_sum: the training loss without the whole batch's logits.

It must give the numbers of the path it replaces, cross_entropy(logits.float(), labels,
reduction="sum") on the full (positions, vocab) logits: in fp32 the same loss and gradients to
float rounding, under bf16 autocast the same within bf16's precision. On a GPU (skipped
elsewhere) also: far less memory than the full logits.

Chunked and whole matmuls, and two paths to the same numbers, are different computations: their
roundings differ by CPU (AMD and Intel kernels block matmuls and sums differently), so they are
compared within FP32_RTOL, never bit for bit."""
import pytest
import torch

from hvdtrain.config import ModelConfig
from hvdtrain.data import synthetic_blocks
from hvdtrain.data.collate import CausalLMCollator, MaskedLMCollator
from hvdtrain.errors import UserError
from hvdtrain.models.common import (IGNORE_INDEX, Vocab, build_model, linear_cross_entropy_sum, logits_and_labels,
                             token_loss_sum)

# fp32's epsilon is 1.2e-7; a sum of n terms computed in another order may differ by up to about
# n * eps relative (n ~ 100 positions here). A wrong or missing position changes the loss by ~1%.
FP32_RTOL = 1e-5
VOCAB = 200  # padded to 256 rows: the rows past the tokenizer's size take part in the softmax as in training
SEQ = 16


def reference_loss(model, batch):
    """The former training loss, written out as train.py had it."""
    labels = batch["labels"]
    if hasattr(model, "bert"):
        hidden = model.bert(input_ids=batch["input_ids"]).last_hidden_state
        picked = labels != IGNORE_INDEX
        logits, labels = model.cls(hidden[picked]), labels[picked]
    else:
        logits, labels = model(input_ids=batch["input_ids"]).logits.flatten(0, 1), labels.flatten()
    return torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def tiny(arch: str, batch_size: int = 6, device="cpu"):
    torch.manual_seed(0)
    vocab = (Vocab(size=VOCAB, pad_id=0, bos_id=1, eos_id=1) if arch == "gpt2" else
             Vocab(size=VOCAB, pad_id=0, cls_id=2, sep_id=3, mask_id=4))
    model = build_model(ModelConfig(arch=arch, n_layer=2, n_head=2, d_model=32, dropout=0.0), vocab, SEQ).to(device)
    blocks = synthetic_blocks(batch_size, SEQ, VOCAB, seed=3, arch=arch)
    samples = [{"input_ids": torch.from_numpy(b).long(), "position": i} for i, b in enumerate(blocks)]
    collate = CausalLMCollator() if arch == "gpt2" else MaskedLMCollator(vocab, 0.15, seed=5)
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in collate(samples).items()}
    return model, batch


def loss_and_grads(model, batch, fn, autocast=False, scale=0.37):
    model.zero_grad(set_to_none=True)
    with torch.autocast(next(model.parameters()).device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = fn(model, batch)
    (loss * scale).backward()  # training multiplies by a constant before backward
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def relative_error(grad, expected, all_expected) -> float:
    """|grad - expected| / |expected|, with a floor of 1e-3 of the largest gradient's norm: some
    gradients are zero up to rounding (attention key biases), where only an absolute error means
    anything."""
    floor = 1e-3 * max(g.norm() for g in all_expected.values())
    return ((grad - expected).norm() / torch.maximum(expected.norm(), floor)).item()


def chunked(chunk_elements):
    return lambda model, batch: token_loss_sum(model, batch, chunk_elements=chunk_elements)


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
@pytest.mark.parametrize("chunk_elements", [2 ** 26, 7 * 256])  # one chunk; 7 positions a chunk (a partial last one)
def test_fp32_same_loss_and_gradients_within_rounding(arch, chunk_elements):
    model, batch = tiny(arch)
    expected, expected_grads = loss_and_grads(model, batch, reference_loss)
    loss, grads = loss_and_grads(model, batch, chunked(chunk_elements))
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(expected.item(), rel=FP32_RTOL)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert relative_error(grad, expected_grads[name], expected_grads) < 1e-5, name


def test_bert_positions_picked_without_a_host_copy_are_the_same():
    """With the host-side count (num_targets, a Python int) BERT's masked positions are picked
    with nonzero_static, which needs no device-to-host copy; same result as the boolean mask."""
    model, batch = tiny("bert")
    assert isinstance(batch["num_targets"], int) and batch["num_targets"] > 0
    without = {k: v for k, v in batch.items() if k != "num_targets"}
    a, grads_a = loss_and_grads(model, batch, token_loss_sum)
    b, grads_b = loss_and_grads(model, without, token_loss_sum)
    assert a.item() == pytest.approx(b.item(), rel=FP32_RTOL)
    for name in grads_a:
        assert relative_error(grads_a[name], grads_b[name], grads_b) < FP32_RTOL, name
    logits, labels = logits_and_labels(model, batch)
    assert logits.shape == (batch["num_targets"], 256) and torch.equal(labels, batch["labels"][batch["labels"] != -100])


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_bf16_autocast_within_bf16_precision(arch):
    model, batch = tiny(arch)
    expected, expected_grads = loss_and_grads(model, batch, reference_loss, autocast=True)
    loss, grads = loss_and_grads(model, batch, chunked(5 * 256), autocast=True)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(expected.item(), rel=1e-2)
    for name, grad in grads.items():
        assert grad.dtype == torch.float32
        assert relative_error(grad, expected_grads[name], expected_grads) < 2e-2, name


def test_without_gradients_and_with_no_targets():
    model, batch = tiny("gpt2")
    with torch.no_grad():
        loss = token_loss_sum(model, batch, chunk_elements=3 * 256)
        assert loss.item() == pytest.approx(reference_loss(model, batch).item(), rel=FP32_RTOL)
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(16, 8, requires_grad=True)
    loss = linear_cross_entropy_sum(x, w, None, torch.full((4,), IGNORE_INDEX))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(w.grad, torch.zeros_like(w))


def test_logits_switch_is_the_former_path_and_bad_values_are_refused(monkeypatch):
    model, batch = tiny("gpt2")
    monkeypatch.setenv("HVDTRAIN_LOSS", "logits")
    # The former path's ops, on (positions, d_model) features rather than GPT2LMHeadModel's
    # (batch, seq, d_model): another matmul shape, so rounding may differ.
    assert token_loss_sum(model, batch).item() == pytest.approx(reference_loss(model, batch).item(), rel=FP32_RTOL)
    monkeypatch.setenv("HVDTRAIN_LOSS", "fused")
    with pytest.raises(UserError, match="HVDTRAIN_LOSS='fused': expected one of chunked, compiled, logits"):
        token_loss_sum(model, batch)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_cuda_bf16_matches_the_former_path(arch):
    model, batch = tiny(arch, batch_size=8, device="cuda")
    expected, expected_grads = loss_and_grads(model, batch, reference_loss, autocast=True)
    for mode in ("chunked", "compiled"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("HVDTRAIN_LOSS", mode)
            loss, grads = loss_and_grads(model, batch, chunked(5 * 256), autocast=True)
        assert loss.item() == pytest.approx(expected.item(), rel=1e-2), mode
        for name, grad in grads.items():
            assert relative_error(grad, expected_grads[name], expected_grads) < 2e-2, (mode, name)


@cuda
def test_cuda_gpt2_sized_head_needs_a_fraction_of_the_memory():
    """16 x 1024 positions, GPT-2's padded vocabulary: the full fp32 logits alone are 3.3 GB."""
    torch.manual_seed(0)
    n, d, v = 16 * 1024, 768, 50304
    x = torch.randn(n, d, device="cuda", requires_grad=True)
    w = (torch.randn(v, d, device="cuda") * 0.02).requires_grad_()
    targets = torch.randint(0, v, (n,), device="cuda")

    def peak(fn):
        x.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn()
        loss.backward()
        torch.cuda.synchronize()
        return loss.item(), torch.cuda.max_memory_allocated() - base

    full_loss, full = peak(lambda: torch.nn.functional.cross_entropy(
        torch.nn.functional.linear(x, w).float(), targets, reduction="sum"))
    loss, chunked_peak = peak(lambda: linear_cross_entropy_sum(x, w, None, targets))
    assert loss == pytest.approx(full_loss, rel=1e-2)
    assert full > 6e9 and chunked_peak < 1.5e9, (full, chunked_peak)
