"""The optimizer a recipe asks for: AdamW (fused on GPUs) or LAMB (hvdtrain.optim.lamb)."""
import torch
from torch.distributed.tensor import DTensor

from hvdtrain.config import TrainConfig
from hvdtrain.optim.lamb import Lamb


def build_optimizer(model, cfg: TrainConfig, peak_lr: float, device: torch.device) -> torch.optim.Optimizer:
    """AdamW (or LAMB) with weight decay on matrices only, not on biases and LayerNorm weights."""
    params = [p for p in model.parameters() if p.requires_grad]
    return optimizer_for(params, [p.dim() >= 2 for p in params], cfg, peak_lr, device)


def optimizer_for(tensors: list, decayed: list[bool], cfg: TrainConfig, peak_lr: float, device: torch.device,
                  lamb_norms=None) -> torch.optim.Optimizer:
    """The optimizer over `tensors`, with weight decay where `decayed` says (the parameters
    themselves, or the slices of them that hvdtrain.parallel.sharded_optimizer steps). `lamb_norms`: see
    Lamb's `norms_across_shards`."""
    # torch's fused and foreach kernels take each group's tensors as one list and refuse one that
    # mixes DTensors (parallel.tensor_parallel's split layers) with plain tensors: DTensors get
    # groups of their own (checkpoints name the state by parameter, not by group)
    kinds = (False, True) if any(isinstance(t, DTensor) for t in tensors) else (False,)
    groups = [{"params": [t for t, d in zip(tensors, decayed) if d == decay and isinstance(t, DTensor) == split],
               "weight_decay": cfg.weight_decay if decay else 0.0}
              for split in kinds for decay in (True, False)]
    if cfg.optimizer == "lamb":
        return Lamb(groups, lr=peak_lr, betas=tuple(cfg.betas), eps=cfg.eps, norms_across_shards=lamb_norms)
    return torch.optim.AdamW(groups, lr=peak_lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=device.type == "cuda")
