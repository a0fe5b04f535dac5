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
            waiting = []  # (p, update, take) whose trust ratio needs the norms of other ranks' slices
            for p in group["params"]:
                if p.grad is None:
                    continue
                update, take = self._adam_update(p, group)
                if group["weight_decay"] == 0:  # no decay, no trust ratio (FusedLAMB, use_nvlamb=False)
                    p.sub_(update * (group["lr"] * take))
                    continue
                update.add_(p, alpha=group["weight_decay"])
                if self.norms_across_shards is None:
                    p.sub_(update * (group["lr"] * _trust(p.norm(), update.norm()) * take))
                else:
                    waiting.append((p, update, take))
            if waiting:
                squares = torch.stack([torch.stack([p.square().sum(), u.square().sum()]) for p, u, _ in waiting])
                norms = self.norms_across_shards(squares).sqrt()
                for (p, update, take), (w_norm, u_norm) in zip(waiting, norms):
                    p.sub_(update * (group["lr"] * _trust(w_norm, u_norm) * take))
        return loss

    def _adam_update(self, p, group) -> tuple[torch.Tensor, torch.Tensor | float]:
        """Advance p's moments; returns Adam's bias-corrected update and `take` (see below)."""
        beta1, beta2 = group["betas"]
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        grad = p.grad if self.grad_scale is None else p.grad / self.grad_scale
        # take = 1, or 0 for a skipped step: the moments then keep their values
        # (beta 1, nothing added) and so do the step count and the parameter. A
        # GradScaler's found_inf is a sum over devices, so any non-zero value skips.
        take = 1.0 if self.found_inf is None else (self.found_inf.to(p.device) == 0).float()
        if self.found_inf is not None:
            grad = torch.where(take > 0, grad, 0.0)  # inf or NaN times 0 would still be NaN
        state["step"] = state["step"].to(p.device)  # a resumed state has it on the CPU
        t = state["step"].add_(take)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(1 - (1 - beta1) * take).add_(grad, alpha=1 - beta1)
        v.mul_(1 - (1 - beta2) * take).addcmul_(grad, grad, value=1 - beta2)
        # A skipped first step leaves t = 0, where the bias corrections 1 - beta^0 would be
        # 0 and the update 0/0 = NaN, which no factor 0 removes. With m = v = 0 the update is
        # 0 for any t >= 1, so the corrections take t >= 1.
        t = t.clamp(min=1)
        return (m / (1 - beta1 ** t)) / ((v / (1 - beta2 ** t)).sqrt_().add_(group["eps"])), take


def _trust(w_norm: torch.Tensor, u_norm: torch.Tensor) -> torch.Tensor:
    """||p|| / ||u||, or 1 when either norm is 0."""
    return torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
