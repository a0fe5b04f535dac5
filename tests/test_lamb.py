import torch

from hvdtrain.optim.lamb import Lamb


def reference_lamb(w, grads, lr, betas, eps, wd):
    """The LAMB update written out step by step (You et al. 2019, algorithm 2), with the trust
    ratio only where there is weight decay, as NVIDIA's FusedLAMB (use_nvlamb=False) does."""
    m = torch.zeros_like(w)
    v = torch.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        r = (m / (1 - betas[0] ** t)) / ((v / (1 - betas[1] ** t)).sqrt() + eps) + wd * w
        trust = w.norm() / r.norm() if wd != 0 else 1.0
        w = w - lr * trust * r
    return w


def test_matches_the_written_out_algorithm():
    torch.manual_seed(0)
    w0 = torch.randn(5, 4)
    grads = [torch.randn(5, 4) for _ in range(3)]
    p = torch.nn.Parameter(w0.clone())
    opt = Lamb([p], lr=0.01, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    assert torch.allclose(p.detach(), reference_lamb(w0, grads, 0.01, (0.9, 0.999), 1e-6, 0.01), atol=1e-6)


def test_parameters_without_weight_decay_take_the_plain_adam_step():
    """hvdtrain's groups: matrices with weight decay, biases and LayerNorm weights without. The
    second group gets no trust ratio (NVIDIA's BERT recipe with FusedLAMB's default)."""
    torch.manual_seed(0)
    w0, b0 = torch.randn(5, 4), torch.full((10,), 2.0)
    grads = [(torch.randn(5, 4), torch.randn(10) * 1e-3) for _ in range(3)]
    w, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(b0.clone())
    opt = Lamb([{"params": [w], "weight_decay": 0.01}, {"params": [b], "weight_decay": 0.0}], lr=0.1)
    for gw, gb in grads:
        w.grad, b.grad = gw.clone(), gb.clone()
        opt.step()
    assert torch.allclose(w.detach(), reference_lamb(w0, [g for g, _ in grads], 0.1, (0.9, 0.999), 1e-6, 0.01),
                          atol=1e-6)
    assert torch.allclose(b.detach(), reference_lamb(b0, [g for _, g in grads], 0.1, (0.9, 0.999), 1e-6, 0.0),
                          atol=1e-6)
    # The first step of Adam moves every element by lr (m/sqrt(v) = sign(g)); a trust ratio
    # would have moved the bias by lr * ||b|| = 0.1 * 2 * sqrt(10) instead.
    b = torch.nn.Parameter(b0.clone())
    b.grad = torch.linspace(-1, 1, 10)
    Lamb([{"params": [b], "weight_decay": 0.0}], lr=0.1).step()
    assert torch.allclose((b.detach() - b0).abs(), torch.full((10,), 0.1), rtol=1e-4)


def test_trust_ratio_makes_the_step_relative_to_the_weight():
    """With one step, ||delta w|| = lr * ||w|| whatever the gradient's scale."""
    for scale in (1e-3, 1.0, 1e3):
        p = torch.nn.Parameter(torch.full((10,), 2.0))
        p.grad = torch.randn(10) * scale
        Lamb([p], lr=0.1, weight_decay=0.01).step()
        assert torch.isclose((p.detach() - 2.0).norm(), torch.tensor(0.1 * 2.0 * 10 ** 0.5), rtol=1e-4)


def test_zero_weights_use_trust_ratio_one():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    Lamb([p], lr=0.1, weight_decay=0.01).step()
    assert torch.allclose(p.detach(), torch.full((3,), -0.1), atol=1e-5)


def test_a_step_flagged_non_finite_changes_nothing_and_the_next_continues_as_if_it_never_was():
    """found_inf, as NonFiniteGuard sets it on a GPU: the skip is decided without reading it."""
    torch.manual_seed(0)
    w0 = torch.randn(5, 4)
    grads = [torch.randn(5, 4) for _ in range(3)]
    p = torch.nn.Parameter(w0.clone())
    opt = Lamb([p], lr=0.01, weight_decay=0.01)
    for i, g in enumerate(grads):
        if i == 1:  # a NaN step in between, flagged
            p.grad = torch.full_like(g, float("nan"))
            opt.found_inf = torch.ones(())
            before = {k: v.clone() for k, v in opt.state[p].items()}, p.detach().clone()
            opt.step()
            assert all(torch.equal(before[0][k], v) for k, v in opt.state[p].items())
            assert torch.equal(before[1], p.detach())
        p.grad = g.clone()
        opt.found_inf = torch.zeros(())
        opt.step()
    assert torch.allclose(p.detach(), reference_lamb(w0, grads, 0.01, (0.9, 0.999), 1e-6, 0.01), atol=1e-6)


def test_a_skipped_first_step_leaves_everything_as_it_was():
    """fp16 often overflows on the very first step: with a fresh state the skipped step must not
    divide by the bias corrections 1 - beta^0 = 0 (NaN in every parameter). Weight decay 0 and
    not: the plain Adam step and the trust ratio both see the update of the skipped step."""
    torch.manual_seed(0)
    for wd in (0.01, 0.0):
        w0 = torch.randn(5, 4)
        grads = [torch.randn(5, 4) for _ in range(3)]
        p = torch.nn.Parameter(w0.clone())
        opt = Lamb([{"params": [p], "weight_decay": wd}], lr=0.01)
        p.grad = torch.full_like(w0, float("inf"))
        opt.found_inf = torch.ones(())  # as a GradScaler (or NonFiniteGuard) sets it
        opt.step()
        assert torch.equal(p.detach(), w0) and opt.state[p]["step"].item() == 0
        for g in grads:
            p.grad = g.clone()
            opt.found_inf = torch.zeros(())
            opt.step()
        assert torch.allclose(p.detach(), reference_lamb(w0, grads, 0.01, (0.9, 0.999), 1e-6, wd), atol=1e-6)
