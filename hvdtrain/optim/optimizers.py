"""The optimizer a recipe asks for: AdamW (fused on GPUs) or LAMB (hvdtrain.optim.lamb)."""
import torch

from hvdtrain.config import TrainConfig
from hvdtrain.optim.lamb import Lamb


def build_optimizer(model, cfg: TrainConfig, peak_lr: float, device: torch.device) -> torch.optim.Optimizer:
    """AdamW (or LAMB) with weight decay on matrices only, not on biases and LayerNorm weights."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.optimizer == "lamb":
        return Lamb(groups, lr=peak_lr, betas=tuple(cfg.betas), eps=cfg.eps)
    return torch.optim.AdamW(groups, lr=peak_lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=device.type == "cuda")
