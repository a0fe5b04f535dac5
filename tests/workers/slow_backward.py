"""For the sharded-optimizer test workers: an identity whose backward sleeps, so that the
reduce-scatters that later layers' gradients started finish meanwhile (or fall behind)."""
import time

import torch


class SlowBackward(torch.autograd.Function):
    """x unchanged; its backward waits `seconds` before passing the gradient on."""

    @staticmethod
    def forward(ctx, x, seconds: float):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None
