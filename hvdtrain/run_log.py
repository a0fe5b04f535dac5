"""What rank 0 shows and records about a run: progress bar, metrics.jsonl, TensorBoard.

metrics.jsonl holds one JSON object per logged step (`step`, `loss`, `lr`, `tokens_per_s`,
`world_size`, the step-time breakdown ...) and one per evaluation (`step`, `eval_loss`, ...).
"""
import json
import math
import os
from pathlib import Path

from tqdm import tqdm

TAIL_BLOCK = 64 * 1024  # bytes read at a time looking for the last line


class RunLog:
    def __init__(self, out_dir: str, start_step: int, max_steps: int, progress: bool, tensorboard: bool):
        self.path = Path(out_dir) / "metrics.jsonl"
        end_with_a_complete_line(self.path)
        self.file = open(self.path, "a")
        self.bar = tqdm(total=max_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                        disable=not progress)
        self.straggler = None  # the rank over the imbalance threshold in the previous interval
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(Path(out_dir) / "tensorboard"))

    def write(self, record: dict):
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                    self.tb.add_scalar(key, value, record["step"])

    def train_record(self, record: dict):
        self.write(record)
        self.bar.n = record["step"]
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                             tok_s=f"{record['tokens_per_s']:.0f}", comm=f"{record.get('comm_fraction', 0):.0%}",
                             refresh=False)
        self.bar.refresh()
        # Warn about a rank that is the slow one in two intervals in a row: one noisy interval
        # (a shared machine, a GC pause) is not a straggler.
        slow = record["slowest_rank"] if record.get("imbalance_warning") else None
        if slow is not None and slow == self.straggler:
            stage = f" (pipeline stage {record['slowest_stage']})" if "slowest_stage" in record else ""
            self.message(f"warning: rank {record['slowest_rank']}{stage} is slow: its data+compute time is "
                         f"{record['imbalance']:.0%} above the fastest rank's (rank {record['fastest_rank']})")
        self.straggler = slow

    def eval_record(self, record: dict):
        self.write(record)
        ppl = f", perplexity {record['eval_ppl']:.2f}" if math.isfinite(record["eval_ppl"]) else ""
        acc = f", accuracy {record['eval_accuracy']:.3f}" if "eval_accuracy" in record else ""
        self.message(f"step {record['step']}: eval loss {record['eval_loss']:.4f}{ppl}{acc}")

    def event(self, record: dict):
        """Something that happened to the run at a step (e.g. an elastic reset): a record and a line."""
        self.write(record)
        details = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in record.items() if k not in ("step", "event"))
        self.message(f"step {record['step']}: {record['event']} ({details})")

    def message(self, text: str):
        self.bar.write(text)

    def close(self):
        self.bar.close()
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def end_with_a_complete_line(path: Path):
    """Make `path` end with a newline before records are appended to it: a last line without
    one that is not JSON was cut short by a kill while it was written, never a complete record,
    and is cut off (a complete one only lacks its newline)."""
    if not path.exists():
        return
    with open(path, "rb+") as f:
        end = f.seek(0, os.SEEK_END)
        start = end
        while start > 0:  # back to the last newline, a block at a time
            block_start = max(0, start - TAIL_BLOCK)
            f.seek(block_start)
            newline = f.read(start - block_start).rfind(b"\n")
            if newline >= 0:
                start = block_start + newline + 1
                break
            start = block_start
        if start == end:
            return
        f.seek(start)
        try:
            json.loads(f.read())
        except ValueError:  # not JSON, or not even UTF-8
            f.truncate(start)
        else:
            f.write(b"\n")
