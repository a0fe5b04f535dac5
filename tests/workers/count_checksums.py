"""Test worker: `hvdtrain train`, recording every file this rank checksums (hvdtrain.checkpointing.checkpoint's
checksum, which reads the whole file) in OUT_DIR/checksummed_rank{R}.txt, one path a line."""
import sys
from pathlib import Path

import horovod.torch as hvd

from hvdtrain.checkpointing import checkpoint
from hvdtrain.config import load_config
from hvdtrain.training.train import train

cfg = load_config(sys.argv[1], sys.argv[2:])
read = []
real_checksum = checkpoint.checksum


def checksum(path):
    read.append(Path(path).name)
    return real_checksum(path)


checkpoint.checksum = checksum
try:
    train(cfg)
finally:
    (Path(cfg.out_dir) / f"checksummed_rank{hvd.rank()}.txt").write_text("".join(f"{n}\n" for n in read))
