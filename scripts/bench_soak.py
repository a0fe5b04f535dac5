"""Soak benchmark: does a long run leak? gpt-tiny on 2 local workers for thousands of steps.

    .venv/bin/python scripts/bench_soak.py [--steps 3000] [--every 250] [--json]

It runs `hvdtrain launch -np 2 recipes/gpt-tiny.yaml` with an evaluation and a checkpoint every
--every steps (the default recipe's other settings), samples each worker's RSS, open file
descriptors and threads every second, and reads the step reached from metrics.jsonl. It
prints, per worker, those figures at the end of warm-up (the first --every steps: the first
evaluation and checkpoint have run, every buffer has been allocated once) and at the end of
the run, each over a window of 10% of the steps: the largest RSS, so that the collector's
swings do not count as growth, and the fewest files and threads, what stays open. After the
run it lists what was left behind: worker processes still alive, new entries in the temporary
folder and in /dev/shm, and `.tmp-` or `.old-` folders in the run folder. Target: RSS growth
under 5% after warm-up, nothing left.
"""
import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "gpt-tiny.yaml"
WINDOW = 0.1  # of the steps: RSS is the largest sample in such a window


def worker_processes(launcher: psutil.Process) -> dict[int, psutil.Process]:
    """The training workers among the launcher's descendants (not horovodrun or shells), by rank."""
    found = {}
    for p in launcher.children(recursive=True):
        try:
            if "hvdtrain.cli" in p.cmdline():
                env = p.environ()  # horovodrun's Gloo or Open MPI tells each its rank
                found[int(env.get("HOROVOD_RANK", env.get("OMPI_COMM_WORLD_RANK")))] = p
        except (psutil.NoSuchProcess, TypeError):
            pass  # ended, or not yet told its rank
    return found


def current_step(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    lines = [line for line in metrics.read_text().splitlines() if line.strip()]
    steps = [json.loads(line).get("step", 0) for line in lines[-3:] if line.endswith("}")]
    return max(steps, default=0)


def sample(workers: dict[int, psutil.Process], step: int) -> list[dict]:
    rows = []
    for rank, p in workers.items():
        try:
            rows.append({"worker": rank, "pid": p.pid, "step": step, "rss_mb": p.memory_info().rss / 1e6,
                         "fds": p.num_fds(), "threads": p.num_threads()})
        except psutil.NoSuchProcess:
            pass
    return rows


def folder_entries() -> set[Path]:
    return {*Path(tempfile.gettempdir()).iterdir(), *(Path("/dev/shm").iterdir() if Path("/dev/shm").is_dir() else ())}


def soak(steps: int, every: int, folder: Path) -> dict:
    out = folder / "run"
    before = folder_entries()
    cmd = [str(Path(sys.executable).parent / "hvdtrain"), "launch", "-np", "2", str(RECIPE), f"out_dir={out}",
           f"train.max_steps={steps}", f"eval.every={every}", f"checkpoint.every={every}", "log.every=10",
           "log.progress=false"]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO)
    launcher, workers, samples, seen = psutil.Process(proc.pid), {}, [], set()
    while proc.poll() is None:
        if len(workers) < 2:
            workers = worker_processes(launcher)
            seen |= {(p.pid, p.create_time()) for p in workers.values()}
        samples += sample(workers, current_step(out / "metrics.jsonl"))
        time.sleep(1.0)
    stderr = proc.stderr.read()
    if proc.returncode:
        raise SystemExit(f"the soak run failed ({proc.returncode}):\n{stderr[-3000:]}")
    time.sleep(2.0)  # what the launcher's children still had to do is done
    alive = [pid for pid, created in seen if psutil.pid_exists(pid) and psutil.Process(pid).create_time() == created]
    leftovers = sorted(str(p) for p in folder_entries() - before if not str(p).startswith(str(folder)))
    in_run = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.name.startswith((".tmp-", ".old-")))
    return {"steps": steps, "every": every, "wall_s": time.perf_counter() - started, "samples": samples,
            "workers_alive_after": alive, "temporary_entries_left": leftovers, "run_folder_leftovers": in_run}


def summarize(result: dict) -> list[dict]:
    """Per worker: RSS after warm-up and at the end, the largest in each window; open files and
    threads, the fewest in each window (what stays open, not a checkpoint's file being written).
    The end window stops before the last step: then the run writes its last checkpoint and exits."""
    steps, window = result["steps"], int(result["steps"] * WINDOW)
    warm_from = result["every"] + 1  # the first evaluation and checkpoint are done
    rows = []
    if not result["samples"]:
        raise SystemExit("no worker was found to measure")
    for worker in sorted({s["worker"] for s in result["samples"]}):
        mine = [s for s in result["samples"] if s["worker"] == worker]
        warm = [s for s in mine if warm_from <= s["step"] <= warm_from + window]
        end = [s for s in mine if steps - window <= s["step"] < steps]
        if not warm or not end:
            raise SystemExit(f"worker {worker}: no samples after warm-up or at the end (steps seen: "
                             f"{sorted({s['step'] for s in mine})}); a run this short measures nothing")
        row = {"worker": worker}
        for key, pick in (("rss_mb", max), ("fds", min), ("threads", min)):
            row[f"{key}_warm"], row[f"{key}_end"] = pick(s[key] for s in warm), pick(s[key] for s in end)
        row["rss_growth"] = row["rss_mb_end"] / row["rss_mb_warm"] - 1
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--every", type=int, default=250, help="evaluate and checkpoint every N steps")
    parser.add_argument("--json", action="store_true", help="print every sample as JSON too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hvdtrain-soak-") as folder:
        result = soak(args.steps, args.every, Path(folder))
    rows = summarize(result)
    print(f"gpt-tiny, 2 workers, {args.steps} steps, evaluation and checkpoint every {args.every}: "
          f"{result['wall_s']:.0f} s")
    print(f"{'worker':>6} {'RSS warm':>9} {'RSS end':>9} {'growth':>7} {'fds':>9} {'threads':>9}")
    for r in rows:
        print(f"{r['worker']:>6} {r['rss_mb_warm']:>6.0f} MB {r['rss_mb_end']:>6.0f} MB {r['rss_growth']:>+7.1%} "
              f"{r['fds_warm']:>4}->{r['fds_end']:<4} {r['threads_warm']:>4}->{r['threads_end']:<4}")
    for key, what in (("workers_alive_after", "worker processes alive after the run"),
                      ("temporary_entries_left", "new entries in the temporary folder or /dev/shm"),
                      ("run_folder_leftovers", ".tmp-/.old- folders in the run folder")):
        print(f"{what}: {result[key] or 'none'}")
    if args.json:
        print(json.dumps({**result, "summary": rows}))


if __name__ == "__main__":
    main()
