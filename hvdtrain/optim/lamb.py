"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76
minutes"), as NVIDIA's BERT pretraining recipe runs it at global batches of 32k-64k sequences.

Per parameter tensor p with gradient g, at step t:
    m = beta1 m + (1 - beta1) g,   v = beta2 v + (1 - beta2) g^2          (Adam's moments)
    u = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) + weight_decay p
    p = p - lr * trust * u,   trust = ||p|| / ||u||   (1 when either norm is 0)
with the trust ratio only for tensors whose param group has weight_decay != 0. The others,
biases and LayerNorm weights in hvdtrain (weight decay on matrices only), take the plain Adam
step lr * u.

The paper's Algorithm 2 scales every layer by its trust ratio (with a scaling function phi of
||p||, the identity here as in FusedLAMB). NVIDIA's recipe does not: its BERT
run_pretraining.py (DeepLearningExamples, PyTorch/LanguageModeling/BERT) puts biases and
LayerNorm parameters in a group with weight_decay 0.0 and steps apex's FusedLAMB with its
default use_nvlamb=False, whose kernel (csrc/multi_tensor_lamb.cu, LAMBStage2Functor) applies
the ratio "only to those with non-zero weight decay". TensorFlow Addons' LAMB likewise
exempts from the ratio what it exempts from weight decay (exclude_from_layer_adaptation
defaults to exclude_from_weight_decay). The BERT-large hyperparameters that bert-large.yaml
takes from NVIDIA's recipe were tuned with this rule, so it is the one here. The rest also
matches FusedLAMB's defaults: bias-corrected moments, decoupled weight decay inside the trust
ratio (adam_w_mode=True), eps outside the square root; its clipping to a global gradient norm
of 1.0 is train.grad_clip here, applied before the step.

A step with non-finite gradients is skipped on the device, as fused AdamW skips one: when
`found_inf` (set by hvdtrain's NonFiniteGuard, or by a GradScaler) is not 0, the step changes
neither the parameters nor the moments nor the step count, with no read of the flag on the
host, so a GPU step does not wait for it.

Sharded (hvdtrain.parallel.sharded_optimizer): each rank steps a slice of every parameter, but the
trust ratio needs the norms of the whole parameter and of its whole update. With
`norms_across_shards` given, the step first computes every slice's update and the squared
norms of the slice and of its update, hands them to that function in one tensor (it sums
them over the ranks holding the other slices: one small allreduce per step), then applies
the updates with the ratios of the whole parameters.

Written here because no maintained LAMB on PyPI installs without apex or torchvision; it is
small and checked against the formula in tests/test_lamb.py.
"""
import torch


class Lamb(torch.optim.Optimizer):
    _step_supports_amp_scaling = True  # reads found_inf and grad_scale itself (see GradScaler.step)
    # Set on the instance for one step (GradScaler deletes them after it), else these defaults:
    found_inf = None  # a 0/1 tensor: skip this step where it is 1
    grad_scale = None  # a GradScaler's scale when the gradients are still scaled

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, norms_across_shards=None):
        """`norms_across_shards(squares)`: squares is a (tensors, 2) tensor of the squared norms of
        each tensor with weight decay and of its update; returns those of the whole parameters
        each tensor is a slice of (None: every tensor is a whole parameter)."""
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.norms_across_shards = norms_across_shards

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            updates, take = self._adam_updates(params, group)
            if group["weight_decay"] == 0:  # no decay, no trust ratio (FusedLAMB, use_nvlamb=False)
                scale = -group["lr"] * take
            else:
                torch._foreach_add_(updates, params, alpha=group["weight_decay"])
                norms = torch.stack([torch.stack(torch._foreach_norm(params)),
                                     torch.stack(torch._foreach_norm(updates))], dim=1)
                if self.norms_across_shards is not None:  # the norms of the whole parameters
                    norms = self.norms_across_shards(norms.square()).sqrt()
                scale = (-group["lr"] * take * _trust(norms[:, 0], norms[:, 1])).unbind()
            torch._foreach_mul_(updates, scale)
            torch._foreach_add_(params, updates)
        return loss

    def _adam_updates(self, params: list, group) -> tuple[list, torch.Tensor | float]:
        """Advance the moments of `params`; returns Adam's bias-corrected updates and `take` (see
        below). Every tensor of the group at once (torch._foreach_*): a kernel per operation on a
        GPU, not one per parameter and operation."""
        beta1, beta2 = group["betas"]
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] = state["step"].to(p.device)  # a resumed state has it on the CPU
        steps = [self.state[p]["step"] for p in params]
        m = [self.state[p]["exp_avg"] for p in params]
        v = [self.state[p]["exp_avg_sq"] for p in params]
        grads = [p.grad for p in params]
        if self.grad_scale is not None:
            grads = torch._foreach_div(grads, self.grad_scale)
        # take = 1, or 0 for a skipped step: the moments then keep their values
        # (beta 1, nothing added) and so do the step count and the parameter. A
        # GradScaler's found_inf is a sum over devices, so any non-zero value skips.
        take = 1.0
        if self.found_inf is not None:
            take = (self.found_inf.to(params[0].device) == 0).float()
            grads = [torch.where(take > 0, g, 0.0) for g in grads]  # inf or NaN times 0 would still be NaN
        torch._foreach_add_(steps, take)
        torch._foreach_mul_(m, 1 - (1 - beta1) * take)
        torch._foreach_add_(m, grads, alpha=1 - beta1)
        torch._foreach_mul_(v, 1 - (1 - beta2) * take)
        torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
        # A skipped first step leaves t = 0, where the bias corrections 1 - beta^0 would be
        # 0 and the update 0/0 = NaN, which no factor 0 removes. With m = v = 0 the update is
        # 0 for any t >= 1, so the corrections take t >= 1.
        t = torch.stack(steps).clamp(min=1)
        updates = torch._foreach_div(m, (1 - beta1 ** t).unbind())
        denominators = torch._foreach_div(v, (1 - beta2 ** t).unbind())
        torch._foreach_sqrt_(denominators)
        torch._foreach_add_(denominators, group["eps"])
        torch._foreach_div_(updates, denominators)
        return updates, take


def _trust(w_norm: torch.Tensor, u_norm: torch.Tensor) -> torch.Tensor:
    """||p|| / ||u||, or 1 when either norm is 0."""
    return torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
