"""Tokens per second and model FLOPs utilisation (MFU) for the log records."""
import torch

from hvdtrain import flops


class Throughput:
    def __init__(self, cfg, vocab_size: int, world, global_batch: int):
        self.world = world
        self.tokens_per_step = global_batch * cfg.data.seq_len
        self.flops_per_token = flops.model_flops_per_token(cfg, vocab_size)
        self.peak, self.peak_source = None, None
        if cfg.log.peak_tflops is not None:
            self.peak, self.peak_source = cfg.log.peak_tflops, "log.peak_tflops"
        elif world.device.type == "cuda":
            self.peak, self.peak_source = flops.peak_tflops(torch.cuda.get_device_name(world.device), cfg.train.precision)
        if world.is_main:
            peak = f"{self.peak} TFLOP/s per GPU ({self.peak_source})" if self.peak else "none (no GPU peak known: no MFU)"
            world.print(f"hvdtrain: {self.flops_per_token / 1e6:.1f} MFLOPs per token; MFU peak: {peak}")

    def record(self, step_time: float) -> dict:
        tokens_per_s = self.tokens_per_step / step_time if step_time > 0 else 0.0
        out = {"tokens_per_s": tokens_per_s, "tokens_per_s_per_worker": tokens_per_s / self.world.size}
        if self.peak:
            out["mfu"] = flops.mfu(tokens_per_s, self.flops_per_token, self.peak * self.world.size)
        return out
