"""metrics.jsonl: the records a run logs, built here and read back here.

One JSON object per line. A training record per log interval:
    step, loss (mean over the interval), step_losses (each step's), lr, world_size,
    global_batch, grad_accum, tokens_per_s, tokens_per_s_per_worker, mfu (when a peak is known),
    grad_norm (of the interval's last step, before clipping), skipped_steps (non-finite ones),
    and with log.step_breakdown the step-time breakdown: time_<phase> for each of PHASES,
    time_step, comm_fraction, compute_min/max, slowest_rank, fastest_rank, imbalance,
    imbalance_warning and ranks (per-rank times of each phase).
An evaluation record: step, eval_loss, eval_ppl, eval_accuracy.
An event record: step, event (e.g. "reset" of an elastic job) and what describes it.

Writers: the training loop (through hvdtrain.observe.run_log.RunLog). Readers: `hvdtrain report`,
`hvdtrain plan --measured`, the benchmarks and the tests, all through `read_metrics` /
`read_records`. This module imports no torch, so the CLI stays fast to start.
"""
import json
from pathlib import Path

from hvdtrain.models import flops
from hvdtrain.errors import UserError

# "pipeline": with pipeline stages, the schedule's runs (forward and backward of the micro
# batches, the sends and receives between stages and the bubble) in place of forward/backward.
PHASES = ("data", "forward", "backward", "allreduce", "optimizer", "pipeline")
FILE_NAME = "metrics.jsonl"


# ---------------------------------------------------------------- building records

class Throughput:
    """Tokens per second and model FLOPs utilisation (MFU) of a log interval.

    `model_config` is the trained model's own transformers config: FLOPs per token come from
    its sizes (a `model.pretrained` checkpoint's, the vocabulary as built), not from model.*."""

    def __init__(self, cfg, model_config, world, global_batch: int):
        self.world = world
        self.tokens_per_step = global_batch * cfg.data.seq_len
        dims = flops.built_model_dims(model_config)
        self.flops_per_token = flops.model_flops_per_token(cfg, dims) if dims else None
        self.peak, self.peak_source = None, None
        if cfg.log.peak_tflops is not None:
            self.peak, self.peak_source = cfg.log.peak_tflops, "log.peak_tflops"
        elif world.device.type == "cuda":
            import torch
            self.peak, self.peak_source = flops.peak_tflops(torch.cuda.get_device_name(world.device),
                                                            cfg.train.precision)
        if world.is_main:
            if self.flops_per_token is None:
                world.print(f"hvdtrain: no FLOPs count for model type '{model_config.model_type}' "
                            "(only gpt2 and bert): no MFU")
            else:
                peak = (f"{self.peak} TFLOP/s per GPU ({self.peak_source})" if self.peak
                        else "none (no GPU peak known: no MFU)")
                world.print(f"hvdtrain: {self.flops_per_token / 1e6:.1f} MFLOPs per token; MFU peak: {peak}")

    def record(self, step_time: float) -> dict:
        tokens_per_s = self.tokens_per_step / step_time if step_time > 0 else 0.0
        out = {"tokens_per_s": tokens_per_s, "tokens_per_s_per_worker": tokens_per_s / self.world.size}
        if self.peak and self.flops_per_token:
            out["mfu"] = flops.mfu(tokens_per_s, self.flops_per_token, self.peak * self.world.size)
        return out


def summarize_ranks(per_rank, threshold: float, copies_per_stage: int | None = None) -> dict:
    """Breakdown and load imbalance from an array (world_size, len(PHASES) + 1) of per-step
    means: the phases, then the whole step. With pipeline stages, `copies_per_stage` names the
    slowest rank's stage too.

    A rank's busy time is data + forward + backward (+ pipeline): what it spends before it can join the
    allreduce. The other ranks wait for the slowest one inside the allreduce, so a straggler
    shows up as a large busy time on one rank and large allreduce time on the others."""
    mean = per_rank.mean(axis=0)
    record = {f"time_{p}": float(mean[i]) for i, p in enumerate(PHASES)}
    record["time_step"] = float(mean[-1])
    record["comm_fraction"] = record["time_allreduce"] / record["time_step"] if record["time_step"] > 0 else 0.0
    compute = per_rank[:, 1] + per_rank[:, 2] + per_rank[:, 5]
    busy = per_rank[:, 0] + compute
    record["compute_min"], record["compute_max"] = float(compute.min()), float(compute.max())
    record["slowest_rank"], record["fastest_rank"] = int(busy.argmax()), int(busy.argmin())
    record["imbalance"] = float((busy.max() - busy.min()) / busy.min()) if busy.min() > 0 else 0.0
    record["imbalance_warning"] = record["imbalance"] > threshold and len(busy) > 1
    if copies_per_stage is not None:  # pipeline stages: rank = stage x copies + copy
        record["slowest_stage"] = record["slowest_rank"] // copies_per_stage
    record["ranks"] = {p: [float(v) for v in per_rank[:, i]] for i, p in enumerate(PHASES)}
    record["ranks"]["step"] = [float(v) for v in per_rank[:, -1]]
    return record


def train_record(step: int, step_losses: list[float], lr: float, world_size: int, global_batch: int,
                 grad_accum: int, measurements: dict, breakdown: dict | None) -> dict:
    """`measurements`: throughput (Throughput.record), skipped steps and the gradient norm."""
    record = {"step": step, "loss": sum(step_losses) / len(step_losses), "step_losses": step_losses, "lr": lr,
              "world_size": world_size, "global_batch": global_batch, "grad_accum": grad_accum, **measurements}
    if breakdown is not None:
        record.update(breakdown)
    return record


def is_eval(record: dict) -> bool:
    return "eval_loss" in record


def is_event(record: dict) -> bool:
    """Not a measurement: something that happened at a step (an elastic reset)."""
    return "event" in record


# ---------------------------------------------------------------- reading them back

def read_records(path: Path, what: str = "metrics file") -> list[dict]:
    """Every record of a metrics.jsonl in file order; a damaged line is a UserError naming it.
    A last line without its newline that is not JSON is skipped: a kill (or the run, still
    writing it) cut it short, so it was never a complete record."""
    if not path.is_file():
        raise UserError(f"{what}: no metrics file '{path}'")
    records = []
    lines = path.read_text().split("\n")  # the last one: "" after a final newline, else unterminated
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise UserError(f"{what}: '{path}' line {number} is not JSON") from None
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    return records


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) of a run folder, in step order. A resumed run removes the
    records of the steps it computes again (hvdtrain.observe.run_log); where a file still holds two
    records of a step (written before that), the later one counts."""
    path = Path(run_dir) / FILE_NAME
    if not path.is_file():
        raise UserError(f"'{run_dir}' is not a run folder: {path} does not exist")
    train, evals = {}, {}
    for record in read_records(path):
        if not is_event(record):
            (evals if is_eval(record) else train)[record["step"]] = record
    if not train:
        raise UserError(f"{path} has no training records yet")
    return [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)]
