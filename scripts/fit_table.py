"""The fit table of docs/memory.md ("Llama 3 8B and 70B, GPT-3 175B: which level fits where"),
computed from `hvdtrain plan`'s own functions, so that it can be made again whenever the plan
changes:

    .venv/bin/python scripts/fit_table.py > /tmp/fit.md

For each model, GPU and sharding level: every layout of powers of two up to 64 pipeline stages
the model's layers and GPUs allow, each with activation checkpointing off and on and with m =
the run's accumulation, 2p, 4p or 8p micro batches per run (those the schedule accepts); the
stage counts where some choice fits within 90% of the GPU, and the fastest of all that fit
(at the plan's assumed 40% of the GPU's peak). Estimates, not measurements.
"""
import dataclasses

from hvdtrain.config import load_config
from hvdtrain.errors import UserError
from hvdtrain.models.flops import peak_tflops
from hvdtrain.tools.plan import (DEFAULT_LATENCY_US, DEFAULT_MFU, GIB, USABLE_FRACTION, find_gpu, pipeline_plan,
                                 seconds_per_flop)

LLAMA_70B = ["model.n_layer=80", "model.d_model=8192", "model.n_head=64", "model.d_ff=28672"]
# (name, recipe, overrides, GPUs, Gbit/s of the slowest link: one node's NVLink, or 100 between nodes)
MODELS = [("Llama 3 8B", "recipes/llama-8b.yaml", [], 8, 3600.0),
          ("Llama 3 70B", "recipes/llama-8b.yaml", LLAMA_70B, 64, 100.0),
          ("GPT-3 175B", "recipes/gpt3-175b.yaml", [], 256, 100.0)]
GPUS = ("H100", "H200")
LEVELS = ("none", "optimizer", "gradients", "full")


def layouts(cfg, gpus: int, gpu: str, net_gbps: float):
    """Every layout of `cfg` that the plan accepts: pipeline_plan's rows."""
    budget = USABLE_FRACTION * find_gpu(gpu).memory_gib * GIB
    peak = peak_tflops(gpu, cfg.train.precision)[0]
    for p in (2 ** k for k in range(7)):
        if gpus % p or p > cfg.model.n_layer:
            continue
        for ckpt in (False, True):
            for m in sorted({None, 2 * p, 4 * p, 8 * p}, key=lambda x: x or 0):
                c = dataclasses.replace(
                    cfg, model=dataclasses.replace(cfg.model, activation_checkpointing=ckpt),
                    parallel=dataclasses.replace(cfg.parallel, pipeline_stages=p, microbatches=m if p > 1 else None))
                spf = seconds_per_flop(c, peak, DEFAULT_MFU, None)[0]
                try:
                    yield pipeline_plan(c, p, gpus, budget, net_gbps, DEFAULT_LATENCY_US * 1e-6, spf, peak)
                except UserError:  # m not dividing the accumulation, or a schedule that refuses it
                    continue
                if p == 1:
                    break


def table() -> str:
    lines = ["| model, GPUs | GPU | `parallel.shard` | stages that fit | the plan's fastest: stages x copies, m, "
             "checkpointing, largest rank, step, MFU |", "|---|---|---|---|---|"]
    for name, recipe, overrides, gpus, net_gbps in MODELS:
        for gpu in GPUS:
            for level in LEVELS:
                cfg = load_config(recipe, overrides + [f"parallel.shard={level}"])
                fitting = [r for r in layouts(cfg, gpus, gpu, net_gbps) if r["fits"]]
                stages = sorted({r["stages"] for r in fitting})
                best = min(fitting, key=lambda r: r["step_s"], default=None)
                fastest = "" if best is None else (
                    f"{best['stages']} x {best['copies']}, m = {best['microbatches']}, "
                    f"{'on' if best['checkpointing'] else 'off'}, {best['largest'] / GIB:.0f} GiB, "
                    f"{best['step_s']:.1f} s, {best['mfu']:.0%}")
                lines.append(f"| {name}, {gpus} | {gpu} | {level} | {', '.join(map(str, stages)) or 'none'} "
                             f"| {fastest} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
