"""`hvdtrain tune`: the fastest layout that fits, found by running the candidates.

    hvdtrain tune CONFIG [key=value ...] --gpus N [--budget MINUTES] [--steps K] [--out DIR]
                  [--gpu H100] [--gpu-memory GIB] [--net-gbps 100] [--threads T]

`hvdtrain plan` predicts; tune measures. In order:

1. Candidates (`layouts`, `fitting`): every layout of the config on N workers that hvdtrain
   accepts and that the plan says fits the GPU's memory (plan.pipeline_plan): the layers split
   over t workers (plan.tensor_sweep: 1, 2, 4, 8 where the family splits its layers and t divides
   the heads and N), the pipeline stages of the N / t workers (plan.stage_sweep), for a family
   with experts the expert groups of its copies (plan.expert_sweep: e = 1, 2, 4, 8 dividing the
   experts and the copies) and, with more than one stage, the schedule (gpipe, 1f1b, and
   interleaved1f1b at 2 stages per rank where the layers allow) and the split (even, or measured:
   layer_boundaries auto); the micro batch (the config's, half and double it); activation
   checkpointing off and on; and, with more than one data-parallel copy, the sharding level.
   The global batch stays the config's, so every candidate trains the same batches.
2. Trials (`run_trial`): the recipe's own layout first, the yardstick, then the others in the
   order of their predicted step time. Each is a real run on the config's data: N workers
   started through horovodrun as `hvdtrain launch` starts them, 2K steps, of which the last K
   are measured (the first K are warm-up: allocator, caches, compilation). Each rank reports its
   seconds per step, where they went (metrics.PHASES) and its peak memory
   (bench_common.train_sampling); the run then stops, without the final evaluation, checkpoint
   and export a training run ends with.
3. Learning (`Predictor`): until a trial has run, the plan's compute time rests on an assumed
   model FLOPs utilisation (plan.DEFAULT_MFU of the GPU's peak). After each trial, what it
   measured scales the plan's compute and its exposed communication, each by the median over the
   trials of measured / planned, so the predictions for the candidates not yet run, and their
   order, follow this machine's measured speed. The table's
   "predicted" column is each trial's prediction as it stood just before the trial ran.
4. The result: a table ranked by measured tokens/s beside the prediction, and the winner written
   as a recipe, DIR/best.yaml: `base:` the config, the command's overrides and the winner's keys,
   its measured figures in a comment. `hvdtrain launch -np N DIR/best.yaml` runs it.

Each trial is recorded as it ends, one JSON line in DIR/trials.jsonl (DIR: --out, default the
config's out_dir + "-tune"): the same command again continues after the last recorded trial, and
the budget counts the recorded trials' time. A trial that runs out of memory, fails, or gives no
result within its time limit (--trial-limit, default 3 x its expected time and at least
STALL_FLOOR_S) is recorded as such, its workers ended (TERM, then KILL, to its process group), and
tune goes on with the next. The budget is kept: a trial starts only when its expected time fits
what is left, and is ended when the budget runs out; such a trial is not recorded, so that the
same command with a larger --budget runs it again.
"""
import dataclasses
import itertools
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from hvdtrain.config import SHARD_LEVELS, load_config, merge_override, parse_override
from hvdtrain.errors import UserError
from hvdtrain.observe.metrics import PHASES
from hvdtrain.observe.progress import on_terminal
from hvdtrain.tools import plan
from hvdtrain.tools.bench_common import (RESULT_TAG, train_sampling, worker_command, worker_failure,
                                         worker_results)

TRIAL_START_S = 20.0  # what a trial is expected to take beyond its steps until one has run: start, set-up, data
STALL_FLOOR_S = 60.0  # the least time limit of a trial
OUT_OF_MEMORY = re.compile(r"OutOfMemoryError|out of memory|Killed|signal 9\b", re.IGNORECASE)
RECORDS = "trials.jsonl"


# ---------------------------------------------------------------- the candidates

def layout_of(cfg) -> dict:
    """The keys tune varies, as `cfg` has them (the recipe's own layout)."""
    par = cfg.parallel
    return {"parallel.tensor_parallel": par.tensor_parallel, "parallel.expert_parallel": par.expert_parallel,
            "parallel.pipeline_stages": par.pipeline_stages, "parallel.schedule": par.schedule,
            "parallel.stages_per_rank": par.stages_per_rank, "parallel.layer_boundaries": par.layer_boundaries,
            "train.micro_batch_size": cfg.train.micro_batch_size,
            "model.activation_checkpointing": cfg.model.activation_checkpointing, "parallel.shard": par.shard}


def layout_overrides(layout: dict) -> list[str]:
    return [f"{key}={json.dumps(value)}" for key, value in layout.items()]


def layout_name(layout: dict) -> str:
    """'t=2, 2 stages 1f1b auto, micro 4, ckpt, shard none' or 'e=2, 1 stage, ...' (t=1 and e=1 left out)"""
    t, p, v = layout["parallel.tensor_parallel"], layout["parallel.pipeline_stages"], layout["parallel.stages_per_rank"]
    e = layout["parallel.expert_parallel"]
    parts = [f"{p} stage{'s' if p > 1 else ''}"]
    if p > 1:
        bounds = layout["parallel.layer_boundaries"]
        split = "even" if bounds is None else bounds if isinstance(bounds, str) else ",".join(map(str, bounds))
        parts[0] += f" {layout['parallel.schedule']}{f' x{v}' if v > 1 else ''} {split}"
    parts.append(f"micro {layout['train.micro_batch_size']}")
    if layout["model.activation_checkpointing"]:
        parts.append("ckpt")
    parts.append(f"shard {layout['parallel.shard']}")
    return ", ".join(([f"t={t}"] if t > 1 else []) + ([f"e={e}"] if e > 1 else []) + parts)


def layouts(cfg, gpus: int) -> list[dict]:
    """Every combination tune considers on `gpus` workers, the recipe's own first; hvdtrain and the
    plan may still refuse some (`fitting`)."""
    own = layout_of(cfg)
    micro = cfg.train.micro_batch_size
    out = [own]
    grid = [(split, stages, experts) for split in plan.tensor_sweep(cfg, gpus)
            for stages in plan.stage_sweep(cfg, gpus // split, cfg.parallel.pipeline_stages)
            for experts in plan.expert_sweep(cfg, gpus // (split * stages))]
    for t, p, e in grid:
        if p == 1:
            schedules, splits = [(cfg.parallel.schedule, 1)], [None]
        else:
            schedules = [("gpipe", 1), ("1f1b", 1)] + ([("interleaved1f1b", 2)] if 2 * p <= cfg.model.n_layer else [])
            splits = [None, "auto"]
        shards = SHARD_LEVELS if gpus // (t * p) > 1 else ("none",)  # with more than one copy
        for (schedule, v), split, mb, ckpt, shard in itertools.product(
                schedules, splits, sorted({max(1, micro // 2), micro, 2 * micro}), (False, True), shards):
            layout = {"parallel.tensor_parallel": t, "parallel.expert_parallel": e,
                      "parallel.pipeline_stages": p, "parallel.schedule": schedule,
                      "parallel.stages_per_rank": v,
                      "parallel.layer_boundaries": split, "train.micro_batch_size": mb,
                      "model.activation_checkpointing": ckpt, "parallel.shard": shard}
            if layout not in out:
                out.append(layout)
    return out


@dataclasses.dataclass
class Candidate:
    layout: dict
    cfg: object  # the config with the layout's keys
    stages: int
    global_batch: int
    fits: bool  # as the plan counts the largest rank's memory
    largest: float  # that rank's bytes


@dataclasses.dataclass
class Machine:
    """What the plan is told of the GPUs (plan's own options and defaults)."""
    gpus: int
    gpu: str
    memory_budget: float  # bytes a GPU may use (plan.USABLE_FRACTION of its memory)
    net_gbps: float
    peak: float | None  # TFLOP/s


def fitting(config: str, overrides: list[str], machine: Machine) -> list[Candidate]:
    """The recipe's own layout (the yardstick, whether or not it fits), then every other layout
    that hvdtrain accepts and the plan says fits."""
    found = []
    for layout in layouts(load_config(config, overrides), machine.gpus):
        try:
            cfg = load_config(config, [*overrides, *layout_overrides(layout)])
            row = plan.pipeline_plan(cfg, layout["parallel.pipeline_stages"], machine.gpus, machine.memory_budget,
                                     machine.net_gbps, plan.DEFAULT_LATENCY_US * 1e-6, None, None)
        except UserError as e:  # a combination hvdtrain refuses (a micro batch that does not divide, a schedule's needs)
            if not found:  # the recipe's own layout on --gpus
                raise UserError(f"--gpus {machine.gpus}: {e}") from None
            continue
        if row["fits"] or not found:
            found.append(Candidate(layout, cfg, layout["parallel.pipeline_stages"], row["global_batch"], row["fits"],
                                   row["largest"]))
    return found


class Predictor:
    """The plan's step time for a candidate (plan.pipeline_plan at the assumed MFU), its two parts
    each scaled by what the trials measured: the compute (forward, backward, pipeline schedule) by
    the median over the trials of measured / planned compute, where measured is the step less the
    wait for communication, and the exposed communication by the median of measured allreduce
    wait / planned exposed communication. Both scales are 1 before a trial has run."""

    def __init__(self, machine: Machine):
        self.machine = machine
        self.compute_ratios: list[float] = []
        self.comm_ratios: list[float] = []

    def planned(self, c: Candidate) -> tuple[float, float] | None:
        """(compute, the rest: exposed communication) in seconds per step, as the plan has them."""
        m = self.machine
        spf, _ = plan.seconds_per_flop(c.cfg, m.peak, plan.DEFAULT_MFU, None)
        if spf is None:  # no peak known for the GPU: no timing in the plan
            return None
        row = plan.pipeline_plan(c.cfg, c.stages, m.gpus, m.memory_budget, m.net_gbps,
                                 plan.DEFAULT_LATENCY_US * 1e-6, spf, m.peak)
        return row["compute_s"], row["step_s"] - row["compute_s"]

    def step_s(self, c: Candidate) -> float | None:
        parts = self.planned(c)
        if parts is None:
            return None
        return parts[0] * _scale(self.compute_ratios) + parts[1] * _scale(self.comm_ratios)

    def learn(self, c: Candidate, record: dict):
        parts = self.planned(c)
        if parts is None:
            return
        comm = record["phases"]["allreduce"]
        self.compute_ratios.append((record["step_s"] - comm) / parts[0])
        if parts[1] > 0:
            self.comm_ratios.append(comm / parts[1])


def _scale(ratios: list[float]) -> float:
    return statistics.median(ratios) if ratios else 1.0


# ---------------------------------------------------------------- one trial

def trial_overrides(steps: int, run_dir: Path) -> list[str]:
    """2 x `steps` steps, a log point after each `steps`: the second interval is the measured one."""
    return [f"train.max_steps={2 * steps}", f"log.every={steps}", "log.progress=false", "log.tensorboard=false",
            "log.step_breakdown=true", "checkpoint.every=0", "checkpoint.resume=false", "eval.every=0",
            "eval.batches=1", f"out_dir={run_dir}"]


def end_process_group(proc: subprocess.Popen):
    """horovodrun and every worker it started: TERM, and KILL for what is left after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_trial(config: str, overrides: list[str], c: Candidate, workers: int, steps: int, threads: int,
              limit_s: float, run_dir: Path) -> dict:
    """One trial of candidate `c`: its record (status ok, out of memory, stalled or failed)."""
    args = [*overrides, *layout_overrides(c.layout), *trial_overrides(steps, run_dir)]
    cmd, env = worker_command(workers, ["_tune-worker", config, *args], threads)
    start = time.monotonic()
    # Its own session: ending the trial ends horovodrun's whole process group, its workers too.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        end_process_group(proc)
        return {"status": "stalled", "error": f"no result within its limit of {limit_s:.0f} s",
                "seconds": time.monotonic() - start}
    except BaseException:  # interrupted: nothing of the trial is left running
        end_process_group(proc)
        raise
    seconds = time.monotonic() - start
    reports = worker_results(output)
    if proc.returncode or len(reports) != workers:
        text, _ = worker_failure(output, workers, proc.returncode)
        lines = [line for line in text.splitlines() if line.strip()]
        status = "out of memory" if OUT_OF_MEMORY.search(output) else "failed"
        return {"status": status, "error": lines[-1] if lines else f"exit code {proc.returncode}",
                "seconds": seconds}
    step_s = max(r["step_s"] for r in reports)  # the ranks wait for each other: the slowest one's pace
    return {"status": "ok", "seconds": seconds, "step_s": step_s,
            "tokens_per_s": c.global_batch * c.cfg.data.seq_len / step_s,
            "phases": {p: statistics.mean(r["phases"][p] for r in reports) for p in PHASES},
            "peak_bytes": [r["peak_bytes"] for r in reports], "device": reports[0]["device"]}


class _Measured(Exception):
    """The trial's measured steps are done: its run ends here."""


def run_trial_worker(args) -> int:
    """One rank of a trial, started by horovodrun: `hvdtrain train`'s set-up and steps up to the
    second log point, then this rank's seconds per step and phases of the interval between the
    two log points, and its peak memory, on one result line."""
    intervals = []

    def sample(setup, peak_bytes, interval):
        intervals.append(interval)
        if len(intervals) == 2:
            means, step_s = interval
            print(RESULT_TAG + json.dumps({"rank": setup.world.rank, "step_s": step_s,
                                           "phases": dict(zip(PHASES, means)), "peak_bytes": peak_bytes(),
                                           "device": setup.world.device.type}), flush=True)
            # Every rank is at the same log point, with no collective in flight: all leave here.
            raise _Measured

    try:
        train_sampling(load_config(args.config, args.overrides), sample)
    except _Measured:
        pass
    return 0


# ---------------------------------------------------------------- records, table and recipe

def read_records(path: Path, header: dict) -> list[dict]:
    """The trials recorded by an earlier run of the same tune; none when `path` does not exist."""
    if not path.is_file():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines or lines[0].get("tune") != header:
        raise UserError(f"--out: '{path}' records another tune ({lines[0].get('tune') if lines else 'empty'}); "
                        "pass another --out, or remove it to start again")
    return lines[1:]


def append_record(path: Path, record: dict):
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def format_table(records: list[dict], own: dict) -> list[str]:
    ok = sorted((r for r in records if r["status"] == "ok"), key=lambda r: -r["tokens_per_s"])
    rows = ok + [r for r in records if r["status"] != "ok"]
    lines = [f"  {'':>2} {'layout':<46} {'tokens/s':>9} {'step ms':>8} {'predicted':>9} {'compute':>7} "
             f"{'comm':>6} {'optim':>6} {'data':>5} {'peak/rank':>10}"]
    for i, r in enumerate(rows, 1):
        name = layout_name(r["layout"]) + (" (recipe)" if r["layout"] == own else "")
        predicted = f"{r['predicted_s'] * 1e3:.3g}" if r.get("predicted_s") else "-"
        if r["status"] != "ok":
            lines.append(f"  {'-':>2} {name:<46} {r['status']}: {r['error']}")
            continue
        ph = r["phases"]
        compute = ph["forward"] + ph["backward"] + ph["pipeline"]
        lines.append(f"  {i:>2} {name:<46} {r['tokens_per_s']:>9,.0f} {r['step_s'] * 1e3:>8.0f} {predicted:>9} "
                     f"{compute * 1e3:>7.0f} {ph['allreduce'] * 1e3:>6.0f} {ph['optimizer'] * 1e3:>6.0f} "
                     f"{ph['data'] * 1e3:>5.0f} {max(r['peak_bytes']) / plan.GIB:>6.2f} GiB")
    return lines


def write_recipe(path: Path, config: str, overrides: list[str], winner: dict, own: dict | None, out_dir: str,
                 gpus: int):
    """DIR/best.yaml: the config as its base, the command's overrides, the winner's keys."""
    tree: dict = {"base": os.path.relpath(Path(config).resolve(), path.parent.resolve()), "out_dir": out_dir}
    for text in [*overrides, *layout_overrides(winner["layout"])]:
        merge_override(tree, *parse_override(text))
    against = (f"; the recipe's own layout: {own['tokens_per_s']:,.0f} tokens/s "
               f"({winner['tokens_per_s'] / own['tokens_per_s']:.2f}x)" if own else "")
    comment = (f"# hvdtrain tune {config} --gpus {gpus}: the fastest of the trials, launch it with -np {gpus}\n"
               f"# measured: {winner['tokens_per_s']:,.0f} tokens/s, {winner['step_s'] * 1e3:.0f} ms per step, "
               f"peak {max(winner['peak_bytes']) / plan.GIB:.2f} GiB per rank ({winner['device']}){against}\n")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(comment + yaml.safe_dump(tree, sort_keys=False))
    tmp.replace(path)


# ---------------------------------------------------------------- the command

class TrialProgress:
    """A bar over the trials on a terminal (tqdm), one line per trial elsewhere."""

    def __init__(self, total: int, done: int):
        self.bar = None
        if on_terminal(sys.stdout):
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=done, desc="tune", unit="trial", dynamic_ncols=True, file=sys.stdout)

    def trial_done(self, text: str):
        if self.bar is None:
            print(text, flush=True)
        else:
            self.bar.write(text)
            self.bar.update(1)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def interrupted(signum, frame):
    raise KeyboardInterrupt


def run_tune(args) -> int:
    config, overrides = args.config, args.overrides
    if args.gpus < 1 or args.steps < 1 or args.threads < 1:
        raise UserError(f"--gpus, --steps and --threads: expected integers >= 1, got {args.gpus}, {args.steps} and "
                        f"{args.threads}")
    if not args.budget > 0:
        raise UserError(f"--budget: expected minutes > 0, got {args.budget}")
    if args.trial_limit is not None and not args.trial_limit > 0:
        raise UserError(f"--trial-limit: expected seconds > 0, got {args.trial_limit}")
    spec = plan.find_gpu(args.gpu)
    if spec is None and args.gpu_memory is None:
        raise UserError(f"--gpu: unknown GPU '{args.gpu}'; pass its memory with --gpu-memory GIB")
    memory_gib = args.gpu_memory if args.gpu_memory is not None else spec.memory_gib
    base = load_config(config, overrides)
    machine = Machine(args.gpus, args.gpu, plan.USABLE_FRACTION * memory_gib * plan.GIB, args.net_gbps,
                      plan.peak_tflops(args.gpu, base.train.precision)[0])
    candidates = fitting(config, overrides, machine)
    own = candidates[0]  # the recipe's layout, the yardstick, fitting or not
    if not any(c.fits for c in candidates):
        raise UserError(f"--gpus {args.gpus}: no layout of {config} fits {memory_gib:g} GiB per GPU as `hvdtrain "
                        f"plan` counts it (the recipe's own layout needs {own.largest / plan.GIB:.1f} GiB); give more --gpus or "
                        f"--gpu-memory")

    out = Path(args.out or f"{base.out_dir}-tune")
    header = {"config": str(Path(config).resolve()), "overrides": overrides, "gpus": args.gpus, "steps": args.steps,
              "gpu": args.gpu, "gpu_memory_gib": memory_gib}
    records = read_records(out / RECORDS, header)
    predictor = Predictor(machine)
    by_layout = {json.dumps(c.layout): c for c in candidates}
    for r in records:
        if r["status"] == "ok" and json.dumps(r["layout"]) in by_layout:
            predictor.learn(by_layout[json.dumps(r["layout"])], r)
    done = {json.dumps(r["layout"]) for r in records}
    budget_s = args.budget * 60
    started = time.monotonic()
    spent_before = sum(r["seconds"] for r in records)

    def expected_s(c: Candidate) -> float:
        """Start-up (measured: a trial's time less its steps) plus 2K steps as predicted now."""
        starts = [r["seconds"] - 2 * args.steps * r["step_s"] for r in records if r["status"] == "ok"]
        step = predictor.step_s(c) or 0.0
        return (statistics.median(starts) if starts else TRIAL_START_S) + 2 * args.steps * step

    if not records and budget_s < expected_s(own):
        raise UserError(f"--budget: {args.budget:g} minutes is less than one trial is expected to take "
                        f"({expected_s(own):.0f} s); give at least {math.ceil(expected_s(own) / 60)}")
    if not records:  # checked what it could: from here on the trials are recorded
        out.mkdir(parents=True, exist_ok=True)
        (out / RECORDS).write_text(json.dumps({"tune": header}) + "\n")

    print(f"tune: {config} on {args.gpus} workers: {len(candidates)} candidate layouts"
          f" that fit ({args.gpu}, {memory_gib:g} GiB per GPU, as `hvdtrain plan` counts); "
          f"{args.steps} measured steps per trial after {args.steps} warm-up; budget {args.budget:g} min"
          + (f"; continuing after the {len(records)} trials recorded in {out / RECORDS}" if records else ""),
          flush=True)
    progress = TrialProgress(len(candidates), len(done))
    stop_reason = "every candidate ran"
    signal.signal(signal.SIGTERM, interrupted)  # a scheduler's TERM ends the trial as Ctrl-C does
    try:
        while True:
            left = [c for c in candidates if json.dumps(c.layout) not in done]
            if not left:
                break
            # The yardstick first; then the fastest as the plan, scaled by the trials so far, predicts.
            c = left[0] if left[0] is own else min(left, key=lambda c: predictor.step_s(c) or math.inf)
            remaining = budget_s - spent_before - (time.monotonic() - started)
            expected = expected_s(c)
            if expected > remaining:
                stop_reason = (f"the budget is spent ({remaining:.0f} s left, the next trial is expected to take "
                               f"{expected:.0f} s)")
                break
            predicted = predictor.step_s(c)
            limit = args.trial_limit or max(3 * expected, STALL_FLOOR_S)
            record = {"layout": c.layout, "predicted_s": predicted,
                      **run_trial(config, overrides, c, args.gpus, args.steps, args.threads, min(limit, remaining),
                                  out / "runs" / f"trial-{len(done)}")}
            if record["status"] == "stalled" and remaining < limit:  # the budget's end, not the trial, cut it short
                stop_reason = "the budget ran out during a trial (not recorded: a larger --budget runs it again)"
                break
            append_record(out / RECORDS, record)
            records.append(record)
            done.add(json.dumps(c.layout))
            if record["status"] == "ok":
                predictor.learn(c, record)
                result = (f"{record['tokens_per_s']:,.0f} tokens/s, {record['step_s'] * 1e3:.0f} ms per step"
                          + (f" (predicted {predicted * 1e3:.3g})" if predicted else ""))
            else:
                result = f"{record['status']}: {record['error']}"
            progress.trial_done(f"trial {len(done)}/{len(candidates)}: {layout_name(c.layout)}: {result}")
    except KeyboardInterrupt:
        progress.close()
        print(f"hvdtrain: tune interrupted: {len(records)} trials recorded in {out / RECORDS}; the same command "
              "continues", file=sys.stderr, flush=True)
        return 130
    progress.close()

    spent = spent_before + time.monotonic() - started
    print(f"\ntune: {len(records)} of {len(candidates)} candidates run in {spent / 60:.1f} of {args.budget:g} min: "
          f"{stop_reason}. Ranked by measured tokens/s; ms per step; predicted: the plan's step, scaled by the trials "
          f"before it; peak/rank: the largest rank's peak memory")
    print("\n".join(format_table(records, own.layout)))
    ok = [r for r in records if r["status"] == "ok"]
    if not ok:
        raise UserError(f"no trial of {config} ran: see the errors above")
    winner = max(ok, key=lambda r: r["tokens_per_s"])
    own_record = next((r for r in ok if r["layout"] == own.layout), None)
    write_recipe(out / "best.yaml", config, overrides, winner, own_record, f"{base.out_dir}-tuned", args.gpus)
    print(f"\nfastest: {layout_name(winner['layout'])}, {winner['tokens_per_s']:,.0f} tokens/s"
          + (f", {winner['tokens_per_s'] / own_record['tokens_per_s']:.2f}x the recipe's own layout" if own_record
             else "")
          + f"\nrecipe: {out / 'best.yaml'} (hvdtrain launch -np {args.gpus} {out / 'best.yaml'})")
    return 0


def add_cli(sub):
    p = sub.add_parser("tune", help="run the layouts that fit for a few steps each; write the fastest as a recipe")
    p.add_argument("config", help="YAML recipe")
    p.add_argument("overrides", nargs="*", help="dotted overrides such as train.lr=1e-3 (kept in every trial)")
    p.add_argument("--gpus", type=int, required=True, help="workers of each trial, as the real run will have")
    p.add_argument("--budget", type=float, default=30.0, help="minutes for all trials (default 30)")
    p.add_argument("--steps", type=int, default=10, help="measured steps per trial, after as many warm-up steps "
                                                         "(default 10)")
    p.add_argument("--out", help="folder of the trials and best.yaml (default: the config's out_dir + '-tune')")
    p.add_argument("--gpu", default="H100", help="GPU the plan counts memory and speed for (default H100)")
    p.add_argument("--gpu-memory", type=float, help="its memory in GiB (default: the GPU's)")
    p.add_argument("--net-gbps", type=float, default=100.0, help="network bandwidth per worker for the plan (default "
                                                                 "100)")
    p.add_argument("--trial-limit", type=float, help="seconds after which a trial without a result is ended as "
                                                      "stalled (default: 3 x its expected time, at least "
                                                      f"{STALL_FLOOR_S:.0f})")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per worker (default 1)")
    p.set_defaults(func=run_tune)

    p = sub.add_parser("_tune-worker")  # internal (no help, so not listed): each worker of a trial
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=run_trial_worker)
