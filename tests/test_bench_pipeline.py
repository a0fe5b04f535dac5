"""`hvdtrain bench pipeline` (hvdtrain/tools/bench_pipeline.py): the bubble fit on numbers worked out
by hand, the one-line errors before any worker starts, and one real run at the smallest sizes."""
import json

import pytest

from helpers import hvdtrain
from hvdtrain.tools import bench_pipeline
from hvdtrain.cli import build_parser
from hvdtrain.errors import UserError


def test_fit_recovers_the_slot_time_of_an_ideal_pipeline():
    # p = 2, t = 10 ms: T(m) = (m + 1) x 10 ms; the measured bubble is then the ideal one
    ms = [2, 4, 8, 16]
    times = [(m + 1) * 0.010 for m in ms]
    slot, intercept = bench_pipeline.fit_slot_time(ms, times)
    assert slot == pytest.approx(0.010) and intercept == pytest.approx(0.010)
    for m, run_time in zip(ms, times):
        assert bench_pipeline.measured_bubble(m, slot, run_time) == pytest.approx(1 / (m + 1))


def test_fit_puts_per_run_overhead_into_the_bubble():
    # 5 ms more per run (latency of the sends, say): slope still 10 ms, T(2) = 35 ms,
    # measured bubble 1 - 2 x 10 / 35 = 3/7 where the ideal is 1/3
    ms = [2, 4, 8]
    times = [(m + 1) * 0.010 + 0.005 for m in ms]
    slot, intercept = bench_pipeline.fit_slot_time(ms, times)
    assert slot == pytest.approx(0.010) and intercept == pytest.approx(0.015)
    assert bench_pipeline.measured_bubble(2, slot, times[0]) == pytest.approx(3 / 7)


@pytest.mark.parametrize("argv, message", [
    (["--microbatches", "1,2"], "--microbatches: every value must be at least --stages 2"),
    (["--microbatches", "4,4"], r"--microbatches: the fit of T\(m\) needs at least 2 different values"),
    (["--microbatches", "2,x"], "--microbatches: expected comma-separated integers"),
    (["--stages", "1"], "--stages: expected an integer >= 2"),
    (["--micro-batch", "0"], "--micro-batch"),
    (["--steps", "5", "--log-every", "5"], r"--steps \(5\) must exceed --log-every \(5\)"),
    (["model.n_layer=1"], "parallel.pipeline_stages"),
    (["train.nope=1"], "unknown config key 'train.nope'"),
])
def test_bad_input_is_a_user_error_before_any_worker(argv, message):
    args = build_parser().parse_args(["bench", "pipeline", *argv])
    with pytest.raises(UserError, match=message):
        args.func(args)


@pytest.mark.deep
@pytest.mark.workers
def test_smallest_run(tmp_path):
    proc = hvdtrain("bench", "pipeline", "--microbatches", "2,4", "--micro-batch", "1", "--steps", "4",
                    "--log-every", "2", "--json", timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["stages"] == 2 and result["schedule"] == "1f1b"
    assert [r["microbatches"] for r in result["rows"]] == [2, 4]
    assert [r["ideal_bubble"] for r in result["rows"]] == [pytest.approx(1 / 3), pytest.approx(1 / 5)]
    ref = result["reference"]
    assert ref["stages"] == 1 and len(ref["peak_bytes"]) == 2 and ref["time_micro_batch"] > 0
    for r in result["rows"]:
        assert r["time_pipeline"] > 0 and len(r["peak_bytes"]) == 2 and all(b > 0 for b in r["peak_bytes"])
        # the measured bubble is the fit's: 1 - m·t / T(m)
        assert r["measured_bubble"] == pytest.approx(1 - r["microbatches"] * result["slot_s"] / r["time_pipeline"])
    # a stage holds half the layers: its peak is below the unsplit model's on the same worker
    assert max(result["rows"][0]["peak_bytes"]) < max(ref["peak_bytes"])


@pytest.mark.workers
@pytest.mark.deep  # 3 minutes on 2 cores: four bench runs of two stages
def test_each_stage_holds_the_micro_batches_in_flight_not_every_micro_batch_of_a_run():
    """2 stages, a received tensor (activation or gradient) of 2 MiB: from m = 4 to 12 torch's
    own PipelineStage (HVDTRAIN_STAGE=torch) keeps 8 more gradient buffers on the first stage;
    hvdtrain's keeps neither those nor, on the last stage, the activations that the run's
    losses hold through their graphs. The peak RSS moves by up to ~4.5 MiB from run to run
    (measured), so the signal is 16 MiB and the bound half of it."""
    growth = {}
    for stage_class in ("torch", "in-flight"):
        proc = hvdtrain("bench", "pipeline", "--microbatches", "4,12", "--micro-batch", "4", "--steps", "4",
                        "--log-every", "2", "--json", "data.seq_len=512", "model.d_model=256", "model.n_head=4",
                        timeout=600, env={"HVDTRAIN_STAGE": stage_class})
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        few, many = json.loads(proc.stdout.strip().splitlines()[-1])["rows"]
        growth[stage_class] = [(b - a) / 2 ** 20 for a, b in zip(few["peak_bytes"], many["peak_bytes"])]
    assert growth["torch"][0] > 12, growth  # 16 MiB of gradient buffers: the measurement sees them
    assert all(g < 8 for g in growth["in-flight"]), growth
