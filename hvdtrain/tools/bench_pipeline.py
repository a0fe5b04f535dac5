"""`hvdtrain bench pipeline`: the bubble of a pipeline measured against its ideal, and the peak
memory of each stage against the unsplit model.

    hvdtrain bench pipeline [CONFIG] [overrides] [--stages 2] [--microbatches 2,4,8,16]
                            [--micro-batch 2] [--steps 15] [--log-every 5] [--threads 1]
                            [--repeats 1] [--json]

Every number comes from real training runs of the real code: for each m in --microbatches, one
run of `--stages` p workers started by horovodrun as `hvdtrain launch` starts them, each worker
running hvdtrain.training.train's set_up and step loop (what `hvdtrain train` runs) with
parallel.pipeline_stages=p, parallel.microbatches=m and a global batch of m micro batches (one
run of the schedule per optimizer step, one pipeline, no data-parallel copy); and one reference
run of p workers without stages (parallel.pipeline_stages=1, p data-parallel copies of the whole
model, the same micro batch). The recipe's model trains on synthetic data (default
recipes/gpt-tiny-pipeline.yaml).

The bubble. metrics.jsonl's `time_pipeline` is the time per optimizer step in the schedule's
runs (forward and backward of the m micro batches, sends, receives and waits), averaged over
the ranks and over the log intervals after the first (start-up). If each stage takes t for one
micro batch's forward and backward, a GPipe or 1F1B run lasts T(m) = (m + p - 1)·t: m slots of
work plus p - 1 slots in which the pipeline fills and drains. So t is the slope of T against m,
fitted by least squares over the runs (whatever a run costs besides the m slots, such as
per-run latency of the sends and the fill and drain, goes into the intercept), and each stage
works m·t of T(m):

    measured bubble(m) = 1 - m·t / T(m)        ideal bubble(m) = (p - 1) / (m + p - 1)

They agree when the pipeline is the ideal one; imbalance between stages (t is the slowest
stage's time) and per-run overhead make the measured bubble larger.

The memory. Each worker reports its peak over the training steps: on a GPU
torch.cuda.max_memory_allocated (its statistics reset once set-up is done, so the peak counts the
stage's parameters and optimizer state, the activations and the pipeline's buffers); on a CPU the
peak resident set size (VmHWM, reset after set-up) less the resident size before set-up (the
libraries): what the data, the stage, its optimizer state, its activations and buffers added
(the workers run with glibc's mmap threshold fixed, see bench_common.run_workers, so that RSS follows live memory).
Set-up is left out: it is measured by `python -m hvdtrain.tools.startup_memory` (each rank
builds only its stage). The peak is read at each log point, before
the final evaluation, checkpoint and (rank 0 of a pipeline) the whole model rebuilt for the
run's Hugging Face folder.
"""
import json
import os
import statistics
import tempfile
from pathlib import Path

from hvdtrain.observe import metrics
from hvdtrain.tools import report
from hvdtrain.tools.bench_common import RESULT_TAG, add_worker_parser, parse_ints, run_workers, train_sampling
from hvdtrain.config import load_config
from hvdtrain.errors import UserError
from hvdtrain.parallel.pipeline_plan import ideal_bubble

DEFAULT_RECIPE = "recipes/gpt-tiny-pipeline.yaml"
MIB = 2 ** 20


def default_recipe() -> str:
    """The default recipe, from the working directory or else next to this package."""
    if Path(DEFAULT_RECIPE).is_file():
        return DEFAULT_RECIPE
    return str(Path(__file__).resolve().parent.parent / DEFAULT_RECIPE)


# ---------------------------------------------------------------- the fit

def fit_slot_time(microbatches: list[int], times: list[float]) -> tuple[float, float]:
    """Least-squares line T = intercept + t·m through the runs' (m, T(m)): (t, intercept)."""
    mean_m, mean_t = statistics.fmean(microbatches), statistics.fmean(times)
    var = sum((m - mean_m) ** 2 for m in microbatches)
    slope = sum((m - mean_m) * (t - mean_t) for m, t in zip(microbatches, times)) / var
    return slope, mean_t - slope * mean_m


def measured_bubble(m: int, slot: float, run_time: float) -> float:
    """The share of a run of m micro batches that a stage did not work: 1 - m·t / T(m)."""
    return 1 - m * slot / run_time


# ---------------------------------------------------------------- runs

def run_overrides(args, stages: int, m: int, out_dir: Path) -> list[str]:
    """The overrides of one run after the user's: a pipeline of `stages` (1: the reference, as
    many copies as the pipeline has stages) with m micro batches of --micro-batch per step."""
    copies = args.stages // stages
    fixed = [f"train.micro_batch_size={args.micro_batch}", f"train.global_batch_size={args.micro_batch * m * copies}",
             f"parallel.pipeline_stages={stages}", f"train.max_steps={args.steps}", f"log.every={args.log_every}",
             "log.step_breakdown=true", "log.progress=false", "log.tensorboard=false", "checkpoint.every=0",
             "checkpoint.resume=false", "eval.every=0", "eval.batches=1", f"out_dir={out_dir}"]
    if stages > 1:
        fixed.append(f"parallel.microbatches={m}")
    return fixed


def measure(args, config: str, overrides: list[str], stages: int, m: int, out_dir: Path) -> dict:
    own = run_overrides(args, stages, m, out_dir)
    reports = run_workers(args.stages, "pipeline", config, [*overrides, *own], args.threads)
    measured = report.steady(metrics.read_metrics(out_dir)[0])
    row = {"stages": stages, "microbatches": m, "peak_bytes": [r["peak_bytes"] for r in reports],
           "peaks": [r["peaks"] for r in reports], "device": reports[0]["device"],
           "load_average": os.getloadavg()[0]}
    if stages > 1:
        row["time_pipeline"] = report.time_mean(measured, lambda r: r["time_pipeline"])
    else:  # the whole model's forward and backward of one micro batch, on one worker
        row["time_micro_batch"] = report.time_mean(measured, lambda r: r["time_forward"] + r["time_backward"]) / m
    return row


def median_run(runs: list[dict]) -> dict:
    """One layout's repeats: the median of each time and of each rank's peak, and every run's times."""
    row = dict(runs[0])
    for key in ("time_pipeline", "time_micro_batch"):
        if key in row:
            row[key] = statistics.median(r[key] for r in runs)
            row[key + "_runs"] = [r[key] for r in runs]
    row["peak_bytes"] = [statistics.median(peaks) for peaks in zip(*(r["peak_bytes"] for r in runs))]
    row["load_average"] = max(r["load_average"] for r in runs)
    return row


def run_pipeline_bench(args) -> int:
    config, overrides = args.config, args.overrides
    if config is not None and "=" in config and not Path(config).is_file():
        config, overrides = None, [config, *overrides]  # no CONFIG given, only overrides
    config = config or default_recipe()
    overrides = ["data.source=synthetic", *overrides]  # the recipe's model on synthetic data
    p = args.stages
    ms = parse_ints(args.microbatches, "--microbatches")
    if p < 2:
        raise UserError(f"--stages: expected an integer >= 2, got {p}")
    if min(ms) < p:
        raise UserError(f"--microbatches: every value must be at least --stages {p} (the schedule needs m >= p), "
                        f"got '{args.microbatches}'")
    if len(set(ms)) < 2:
        raise UserError(f"--microbatches: the fit of T(m) needs at least 2 different values, got '{args.microbatches}'")
    if args.micro_batch < 1:
        raise UserError(f"--micro-batch: expected an integer >= 1, got {args.micro_batch}")
    if args.steps <= args.log_every or args.log_every < 1 or args.threads < 1 or args.repeats < 1:
        raise UserError(f"--steps ({args.steps}) must exceed --log-every ({args.log_every}), as the first log "
                        f"interval is start-up and not measured; --log-every, --threads and --repeats must be >= 1")
    ms = sorted(set(ms))
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-pipeline-") as tmp:
        for stages, m in [(1, ms[0])] + [(p, m) for m in ms]:  # every run's config checked before any starts
            cfg = load_config(config, [*overrides, *run_overrides(args, stages, m, Path(tmp))])
        schedule = cfg.parallel.schedule
        # Repeats go round the layouts (p=1, m=2, 4, ... then again) so that load from other
        # processes on a shared machine hits every layout alike; each reports its median.
        runs = [[measure(args, config, overrides, stages, m, Path(tmp) / f"p{stages}-m{m}-{repeat}")
                 for stages, m in [(1, ms[0])] + [(p, m) for m in ms]] for repeat in range(args.repeats)]
        reference, *rows = [median_run(list(same)) for same in zip(*runs)]
    slot, intercept = fit_slot_time(ms, [r["time_pipeline"] for r in rows])
    for r in rows:
        m = r["microbatches"]
        r["ideal_bubble"] = ideal_bubble(p, m, cfg.parallel.stages_per_rank)
        r["measured_bubble"] = measured_bubble(m, slot, r["time_pipeline"])
        r["peak_vs_unsplit"] = [peak / max(reference["peak_bytes"]) for peak in r["peak_bytes"]]
    result = {"config": config, "overrides": overrides, "stages": p, "schedule": schedule,
              "micro_batch": args.micro_batch, "seq_len": cfg.data.seq_len, "threads": args.threads,
              "steps": args.steps, "log_every": args.log_every, "repeats": args.repeats, "device": reference["device"],
              "slot_s": slot, "intercept_s": intercept, "reference": reference, "rows": rows}
    if args.json:
        print(json.dumps(result))
        return 0
    print_result(result)
    return 0


def print_result(result: dict):
    p, ref = result["stages"], result["reference"]
    memory = ("peak GPU memory (torch.cuda.max_memory_allocated)" if result["device"] == "cuda"
              else "peak RSS over the RSS before set-up")
    print(f"pipeline: {result['config']} {' '.join(result['overrides'])}\n"
          f"  {p} stages on {p} workers ({result['device']}, OMP_NUM_THREADS={result['threads']}), "
          f"{result['schedule']}, micro batch {result['micro_batch']} x {result['seq_len']} tokens, m micro batches "
          f"per step in one schedule run; steps {result['log_every'] + 1}-{result['steps']} measured, median of "
          f"{result['repeats']} run(s)\n"
          f"  T(m): the pipeline phase per step; fit T(m) = intercept + m·t: t = {result['slot_s'] * 1e3:.2f} ms per "
          f"micro batch and stage, intercept {result['intercept_s'] * 1e3:.2f} ms = "
          f"{result['intercept_s'] / result['slot_s']:.2f}·t (ideal: (p-1)·t = {p - 1}·t); "
          f"measured bubble = 1 - m·t/T(m)\n"
          f"  unsplit model (p=1, {p} data-parallel copies): forward+backward {ref['time_micro_batch'] * 1e3:.2f} ms "
          f"per micro batch ({ref['time_micro_batch'] / p * 1e3:.2f} ms / {p} stages); memory: {memory}")
    peaks = " ".join(f"{'stage ' + str(i):>11}" for i in range(p))
    print(f"{'':>9}{'m':>4}{'T(m) ms':>10}{'ideal bubble':>14}{'measured':>10}  {peaks}   {'vs p=1':<{5 * p}} load avg")
    print(f"{'p=1':>9}{ref['microbatches']:>4}{'-':>10}{'-':>14}{'-':>10}  "
          + " ".join(f"{b / MIB:>7.1f} MiB" for b in ref["peak_bytes"]) + f"   {'1.00':<{5 * p}}"
          + f" {ref['load_average']:>8.2f}")
    for r in result["rows"]:
        print(f"{'p=' + str(p):>9}{r['microbatches']:>4}{r['time_pipeline'] * 1e3:>10.1f}{r['ideal_bubble']:>14.1%}"
              f"{r['measured_bubble']:>10.1%}  " + " ".join(f"{b / MIB:>7.1f} MiB" for b in r["peak_bytes"])
              + "   " + " ".join(f"{x:.2f}" for x in r["peak_vs_unsplit"]) + f" {r['load_average']:>8.2f}")
    busiest = max(r["load_average"] for r in [ref, *result["rows"]])
    if busiest > p:
        print(f"warning: the host's 1-minute load average reached {busiest:.1f} after a run, above the {p} workers: "
              "other processes competed for the cores, and the times (so the measured bubble) are not reliable")


# ---------------------------------------------------------------- the worker

def run_pipeline_worker(args) -> int:
    """One rank of `bench pipeline`, started by horovodrun: the training loop of `hvdtrain
    train` (set_up, then run_steps), and this rank's peak memory over the training steps."""
    peaks = []
    setup, peak_bytes = train_sampling(load_config(args.config, args.overrides),
                                       lambda setup, peak_bytes, interval: peaks.append(peak_bytes()))
    device = setup.world.device
    print(RESULT_TAG + json.dumps({"rank": setup.world.rank, "stage": setup.layout.stage if setup.layout else None,
                                   "peak_bytes": max(peaks) if peaks else peak_bytes(), "peaks": peaks,
                                   "device": device.type}), flush=True)
    return 0


# ---------------------------------------------------------------- command line

def add_cli(kinds):
    """Register `bench pipeline` (and its internal worker) on the `bench` subparsers."""
    p = kinds.add_parser("pipeline", help="pipeline bubble for several micro batch counts against (p-1)/(m+p-1), "
                                          "and peak memory per stage against the unsplit model")
    p.add_argument("config", nargs="?", help=f"YAML recipe (default: {DEFAULT_RECIPE}); its data is replaced by "
                                             "synthetic data")
    p.add_argument("overrides", nargs="*", help="dotted overrides such as model.d_model=256")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages p, one worker each (default 2)")
    p.add_argument("--microbatches", default="2,4,8,16", help="micro batches per step m, one run each "
                                                              "(default 2,4,8,16)")
    p.add_argument("--micro-batch", type=int, default=2, help="samples per micro batch (default 2)")
    p.add_argument("--steps", type=int, default=15, help="steps per run (default 15)")
    p.add_argument("--log-every", type=int, default=5, help="log interval; the first one is not measured (default 5)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per worker (default 1)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each layout, alternated (default 1)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run_pipeline_bench)
    add_worker_parser(kinds, "pipeline", run_pipeline_worker)
