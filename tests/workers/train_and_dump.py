"""Test worker: train (as `hvdtrain train` does), then every rank saves its final parameters
to OUT_DIR/params_rank{R}.safetensors so tests can compare ranks and runs (with parallel.shard=full
the model's weights are empty after the run: only its buffers are saved; with
parallel.tensor_parallel a split weight's slice is saved)."""
import sys
from pathlib import Path

import horovod.torch as hvd
from safetensors.torch import save_file

from hvdtrain.config import load_config
from hvdtrain.parallel.tensor_parallel import local
from hvdtrain.training.train import train

cfg = load_config(sys.argv[1], sys.argv[2:])
model = train(cfg)
state = {k: local(v).detach().contiguous().clone() for k, v in model.state_dict().items() if v.numel()}
save_file(state, str(Path(cfg.out_dir) / f"params_rank{hvd.rank()}.safetensors"))
