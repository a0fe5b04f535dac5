"""`hvdtrain report RUN_DIR`: what happened in a run, as a table and plots.

Reads RUN_DIR/metrics.jsonl (and RUN_DIR/profile/ops_rank0.txt when the run was profiled),
prints final losses, throughput, the step-time breakdown, load imbalance and the top
operators, and writes PNG plots into RUN_DIR/report/:

  loss.png         training loss per step, evaluation loss at its steps
  throughput.png   tokens/s per log interval
  breakdown.png    per rank: where a step's time goes (a stacked bar per rank)

Throughput and timings are averaged over the log intervals after the first one: the first
interval also pays for start-up (data loader workers, first allocations), which is not what
a step costs.
"""
import re
from collections import Counter
from pathlib import Path

from hvdtrain.observe.metrics import PHASES, read_metrics
from hvdtrain.paths import check_writable_folder

TOP_OPERATORS = 10


def steady(train: list[dict]) -> list[dict]:
    """The records that measure steady-state steps: all but the first, unless it is the only one."""
    return train[1:] if len(train) > 1 else train


def weight(record: dict) -> int:
    """Samples the record's interval trained on: intervals differ in length (the last one is
    often shorter) and, after a resume with another world size, in global batch."""
    return len(record["step_losses"]) * record["global_batch"]


def rate(records: list[dict], key: str) -> float:
    """Throughput over several intervals: total tokens / total time, not a mean of rates."""
    return sum(weight(r) for r in records) / sum(weight(r) / r[key] for r in records)


def time_mean(records: list[dict], get) -> float:
    """Mean seconds per step over intervals, weighted by their steps."""
    steps = [len(r["step_losses"]) for r in records]
    return sum(n * get(r) for n, r in zip(steps, records)) / sum(steps)


def summarize(run_dir: Path, train: list[dict], evals: list[dict]) -> dict:
    measured = steady(train)
    last = train[-1]
    out = {"run_dir": str(run_dir), "steps": last["step"], "world_size": last["world_size"],
           "global_batch": last["global_batch"], "loss": last["loss"], "measured_intervals": len(measured),
           "tokens_per_s": rate(measured, "tokens_per_s"),
           "tokens_per_s_per_worker": rate(measured, "tokens_per_s_per_worker")}
    if evals:
        out["eval"] = evals[-1]
    if all("mfu" in r for r in measured):
        out["mfu"] = time_mean(measured, lambda r: r["mfu"])
    # Per-rank timings of the current world size (a resume may have changed it).
    timed = [r for r in measured if "ranks" in r and r["world_size"] == last["world_size"]]
    if timed:
        # time_mean calls each lambda before the loop moves on: the loop variables it reads are current.
        out["phases"] = {p: time_mean(timed, lambda r: r[f"time_{p}"]) for p in PHASES}  # noqa: B023
        out["time_step"] = time_mean(timed, lambda r: r["time_step"])
        # Per rank and phase, averaged over the run: the stacked bars of breakdown.png.
        out["ranks"] = {p: [time_mean(timed, lambda r: r["ranks"][p][i]) for i in range(last["world_size"])]  # noqa: B023
                        for p in (*PHASES, "step")}
        worst = max(timed, key=lambda r: r["imbalance"])
        out["imbalance"] = {"max": worst["imbalance"], "at_step": worst["step"],
                            "slowest_rank_counts": dict(Counter(r["slowest_rank"] for r in timed)),
                            "warnings": sum(r["imbalance_warning"] for r in timed)}
    ops = run_dir / "profile" / "ops_rank0.txt"
    if ops.is_file():
        out["top_operators"] = top_operators(ops.read_text())
    return out


# ---------------------------------------------------------------- profiler operator table

UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def seconds(text: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)\s*(s|ms|us|ns)", text).groups()
    return float(number) * UNITS[unit]


def top_operators(table: str, count: int = TOP_OPERATORS) -> list[dict]:
    """Operators with the most self time (device time when the table has it), from the text
    table of `key_averages()` that hvdtrain.observe.profiling writes.

    Columns are found from the dashed rule under the title row, as operator names contain
    single spaces. The step phases (record_function ranges) and ProfilerStep* are left out:
    their self time is only the gaps between operators."""
    lines = table.splitlines()
    rule = next(i for i, line in enumerate(lines) if line.startswith("---"))
    spans = [m.span() for m in re.finditer(r"-+", lines[rule])]
    header = [lines[rule + 1][a:b].strip() for a, b in spans]
    # A device column (Self CUDA, ...) has a percentage column too; memory columns do not.
    key = next((h for h in header if h.startswith("Self ") and h != "Self CPU" and f"{h} %" in header), "Self CPU")
    rows = []
    for line in lines[rule + 3:]:
        if line.startswith("---"):
            break
        row = dict(zip(header, (line[a:b].strip() for a, b in spans)))
        if row["Name"] in PHASES or row["Name"].startswith("ProfilerStep"):
            continue
        rows.append({"name": row["Name"], "self_s": seconds(row[key]), "self_share": row[f"{key} %"],
                     "calls": int(row["# of Calls"]), "column": key})
    return sorted(rows, key=lambda r: r["self_s"], reverse=True)[:count]


# ---------------------------------------------------------------- table

def ms(seconds_: float) -> str:
    return f"{seconds_ * 1e3:.1f} ms"


def print_summary(s: dict):
    rows = [("run", s["run_dir"]),
            ("steps", f"{s['steps']} ({s['world_size']} workers, global batch {s['global_batch']})"),
            ("final loss", f"{s['loss']:.4f}")]
    if "eval" in s:
        e = s["eval"]
        extra = f", accuracy {e['eval_accuracy']:.3f}" if "eval_accuracy" in e else ""
        rows.append(("final eval loss",
                     f"{e['eval_loss']:.4f} (step {e['step']}, perplexity {e['eval_ppl']:.2f}{extra})"))
    rows.append(("throughput", f"{s['tokens_per_s']:,.0f} tokens/s total, {s['tokens_per_s_per_worker']:,.0f} per "
                               f"worker ({s['measured_intervals']} log intervals)"))
    if "mfu" in s:
        rows.append(("MFU", f"{s['mfu']:.1%}"))
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")

    if "phases" in s:
        step = s["time_step"]
        print(f"\nstep time {ms(step)} (mean over ranks)")
        # What the five phases do not cover: loop bookkeeping, logging, the lr update.
        other = step - sum(s["phases"].values())
        for name, value in [*s["phases"].items(), ("other", other)]:
            print(f"  {name:<10} {ms(value):>11}  {value / step:6.1%}")
        im = s["imbalance"]
        counts = ", ".join(f"rank {r}: {n}" for r, n in sorted(im["slowest_rank_counts"].items()))
        print(f"imbalance  max {im['max']:.1%} (step {im['at_step']}), {im['warnings']} warnings; "
              f"slowest rank per interval: {counts}")
    else:
        print("\n(no step-time breakdown: the run had log.step_breakdown=false)")

    if "top_operators" in s:
        ops = s["top_operators"]
        print(f"\ntop operators by {ops[0]['column'].lower()} time (profile/ops_rank0.txt, profiled steps)")
        for op in ops:
            print(f"  {op['name'][:60]:<60} {ms(op['self_s']):>11} {op['self_share']:>8} {op['calls']:>6} calls")


# ---------------------------------------------------------------- plots

def plot(run_dir: Path, train: list[dict], evals: list[dict], s: dict) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed, safe on headless nodes
    import matplotlib.pyplot as plt

    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    written = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append(out / name)

    fig, ax = plt.subplots(figsize=(7, 4))
    steps, losses = [], []
    for r in train:  # a record holds the loss of every step of its interval
        first = r["step"] - len(r["step_losses"]) + 1
        steps += range(first, r["step"] + 1)
        losses += r["step_losses"]
    ax.plot(steps, losses, label="train loss")
    if evals:
        ax.plot([e["step"] for e in evals], [e["eval_loss"] for e in evals], "o-", label="eval loss")
    ax.set(xlabel="step", ylabel="loss", title="loss")
    ax.legend()
    save(fig, "loss.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train], [r["tokens_per_s"] for r in train], "o-", label="total")
    ax.plot([r["step"] for r in train], [r["tokens_per_s_per_worker"] for r in train], "s--", label="per worker")
    ax.set(xlabel="step", ylabel="tokens/s", title="throughput (per log interval)", ylim=(0, None))
    ax.legend()
    save(fig, "throughput.png")

    if "ranks" in s:
        ranks = s["ranks"]
        n = len(ranks["step"])
        other = [ranks["step"][i] - sum(ranks[p][i] for p in PHASES) for i in range(n)]
        fig, ax = plt.subplots(figsize=(max(5, 2.5 + 0.8 * n), 4))
        bottom = [0.0] * n
        for name, values in [*((p, ranks[p]) for p in PHASES), ("other", other)]:
            ms_values = [v * 1e3 for v in values]
            ax.bar(range(n), ms_values, bottom=bottom, label=name)
            bottom = [b + v for b, v in zip(bottom, ms_values)]
        ax.set(xlabel="rank", ylabel="ms per step", title="step time by phase", xticks=range(n))
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1, 1))  # beside the bars, not over them
        save(fig, "breakdown.png")
    return written


def run_report(args) -> int:
    run_dir = Path(args.run_dir)
    train, evals = read_metrics(run_dir)
    check_writable_folder(run_dir / "report", "report folder")  # before the summary: nothing half done
    summary = summarize(run_dir, train, evals)
    print_summary(summary)
    written = plot(run_dir, train, evals, summary)
    print(f"\nplots: {', '.join(str(p) for p in written)}")
    return 0


def add_cli(sub):
    p = sub.add_parser("report", help="summary table and plots of a run folder")
    p.add_argument("run_dir", help="a run folder (the out_dir of a run)")
    p.set_defaults(func=run_report)
