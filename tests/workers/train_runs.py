"""Test worker: several `hvdtrain train` runs one after the other in one process (hvdtrain.cli's
main, as the command runs them), so that torch and transformers are imported once for all:

    train_runs.py RESULTS CONFIG KEY=VALUE ... [-- KEY=VALUE ...] ...

one run per group of overrides (each with its own out_dir). Rank 0 writes RESULTS, a JSON list
with each run's overrides, exit code and what it wrote to stderr (a traceback: exit code null)."""
import contextlib
import io
import json
import sys
import traceback

from hvdtrain import cli

results_file, config, *rest = sys.argv[1:]
runs = [[]]
for arg in rest:
    if arg == "--":
        runs.append([])
    else:
        runs[-1].append(arg)
results = []
for overrides in runs:
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            code = cli.main(["train", config, *overrides])
    except Exception:
        code = None
        stderr.write(traceback.format_exc())
    sys.stderr.write(stderr.getvalue())
    results.append({"overrides": overrides, "exit": code, "stderr": stderr.getvalue()})
if cli.process_rank() == 0:
    with open(results_file, "w") as f:
        json.dump(results, f, indent=1)
