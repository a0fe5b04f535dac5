"""How long verifying a GPT-2 124M checkpoint's manifest takes (issue: well under a second per GB).

    .venv/bin/python scripts/bench_checkpoint_verify.py
"""
import tempfile
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from hvdtrain.checkpointing import checkpoint
from hvdtrain.training import rng

model = GPT2LMHeadModel(GPT2Config())
opt = torch.optim.AdamW(model.parameters())
model(input_ids=torch.randint(0, 50257, (1, 8))).logits.sum().backward()
opt.step()
with tempfile.TemporaryDirectory() as d:
    t = time.perf_counter()
    path = checkpoint.save_checkpoint(d, 1, model, opt, {"step": 1, "position": 0, "world_size": 1, "scaler": {}, "config": {}}, [rng.capture()], 2)
    write = time.perf_counter() - t
    size = sum(f.stat().st_size for f in path.iterdir())
    times = []
    for _ in range(3):
        t = time.perf_counter()
        assert checkpoint.find_problem(path) is None
        times.append(time.perf_counter() - t)
    print(f"GPT-2 124M checkpoint: {size/1e9:.2f} GB, write {write:.1f} s, verify {min(times):.2f} s (best of 3) = {min(times)/(size/1e9):.2f} s/GB")
