"""`hvdtrain report` on a real run of 2 workers: the summary table, the operator table of the
profiled steps and the plots."""
import pytest

from helpers import hvdtrain, png_size, read_metrics, train_workers
from hvdtrain.tools import report

pytestmark = pytest.mark.workers


def test_report_of_a_profiled_two_worker_run(tmp_path, tiny_config):
    # log.peak_tflops: a made-up peak, so that the CPU run logs an MFU to report.
    config = tiny_config({"train": {"max_steps": 8}, "log": {"every": 2, "step_breakdown": True, "peak_tflops": 1.0},
                          "eval": {"every": 4}, "profile": {"enabled": True}})
    run = tmp_path / "run"
    train_workers(2, config, f"out_dir={run}", timeout=240)
    proc = hvdtrain("report", run, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout

    train, evals = read_metrics(run)
    assert f"final loss       {train[-1]['loss']:.4f}" in out
    assert f"{evals[-1]['eval_loss']:.4f} (step 8" in out
    # Throughput: all tokens over all time of the intervals after the first (warm-up) one.
    steady = train[1:]
    expected = sum(len(r["step_losses"]) for r in steady) / sum(len(r["step_losses"]) / r["tokens_per_s"]
                                                               for r in steady)
    assert f"{expected:,.0f} tokens/s total, {expected / 2:,.0f} per worker (3 log intervals)" in out
    mfu = sum(r["mfu"] * len(r["step_losses"]) for r in steady) / sum(len(r["step_losses"]) for r in steady)
    assert f"MFU              {mfu:.1%}" in out
    for phase in ("data", "forward", "backward", "allreduce", "optimizer", "other"):
        assert f"\n  {phase} " in out
    assert "imbalance  max" in out and "slowest rank per interval: rank" in out

    # The profiled steps' operators, biggest self time first, without the step phase ranges.
    top = report.top_operators((run / "profile" / "ops_rank0.txt").read_text())
    assert len(top) == report.TOP_OPERATORS
    assert [op["self_s"] for op in top] == sorted((op["self_s"] for op in top), reverse=True)
    assert top[0]["self_s"] > 0 and not {op["name"] for op in top} & {"forward", "backward", "allreduce"}
    assert "top operators by self cpu time" in out and top[0]["name"][:60] in out

    summary = report.summarize(run, train, evals)
    assert all(len(values) == 2 for values in summary["ranks"].values())  # one bar per rank
    for name in ("loss.png", "throughput.png", "breakdown.png"):
        width, height = png_size(run / "report" / name)
        assert 300 <= width <= 2000 and 200 <= height <= 2000, (name, width, height)
        assert (run / "report" / name).stat().st_size > 5000  # axes, lines and labels, not an empty canvas


def test_report_needs_a_run_folder(tmp_path):
    proc = hvdtrain("report", tmp_path, timeout=60)
    assert proc.returncode == 2
    assert f"{tmp_path / 'metrics.jsonl'} does not exist" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("device", [False, True])
def test_top_operators_rank_by_device_time_when_there_is_one(device):
    """A GPU run's table has device columns: operators rank by device self time there, by CPU
    self time otherwise (memory columns, from profile.memory, are not a time)."""
    columns = {"Name": ["ProfilerStep*", "aten::mm", "aten::add"],
               "Self CPU %": ["50.00%", "10.00%", "20.00%"], "Self CPU": ["9.000ms", "1.000ms", "2.000ms"],
               "Self CPU Mem": ["0 b", "64 Mb", "1 Kb"], "# of Calls": ["1", "4", "8"]}
    if device:
        columns.update({"Self CUDA": ["9.000ms", "5.000ms", "500.000us"], "Self CUDA %": ["50.00%", "30.00%", "5.00%"]})
    rule = "  ".join("-" * 14 for _ in columns)

    def line(cells):
        return "  ".join(f"{c:>14}" for c in cells)

    table = "\n".join([rule, line(columns), rule, *(line(row) for row in zip(*columns.values())), rule,
                       "Self CPU time total: 12.000ms"])
    top = report.top_operators(table)
    assert [op["name"] for op in top] == (["aten::mm", "aten::add"] if device else ["aten::add", "aten::mm"])
    assert top[0]["column"] == ("Self CUDA" if device else "Self CPU")
