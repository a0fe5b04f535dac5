"""parallel.layer_boundaries: auto (hvdtrain/parallel/layer_costs.py): the split that balances the
stages' measured forward + backward times, its arithmetic (pipeline_plan.balanced_bounds), and a
real 2-stage run whose last stage carries a large vocabulary: the auto split's stages, timed
whole in this test, are closer to each other than the even split's; every rank cuts the model
there; a second start reads the cached costs."""
import re
import time

import pytest
import safetensors
import torch

from helpers import TINY, hvdtrain, write_config
from hvdtrain.config import ModelConfig
from hvdtrain.models.common import Vocab, model_blueprint
from hvdtrain.parallel import parallel_dims, pipeline
from hvdtrain.parallel.pipeline_plan import _even_bounds, balanced_bounds, stage_totals
from hvdtrain.errors import UserError


def test_equal_costs_give_the_even_split():
    assert balanced_bounds([1.0] * 10, [1] * 10, 2) == [0, 4, 8] == _even_bounds(8, 2)
    assert balanced_bounds([1.0] * 10, [1] * 10, 1) == [0, 8]


def test_a_heavy_head_moves_layers_to_the_first_stage_and_a_heavy_embedding_away_from_it():
    assert balanced_bounds([1.0] + [1.0] * 8 + [5.0], [1] * 10, 2) == [0, 6, 8]  # 7 against 7
    assert balanced_bounds([5.0] + [1.0] * 8 + [1.0], [1] * 10, 2) == [0, 2, 8]  # 7 against 7


def test_middle_stages_keep_a_layer_and_the_ends_may_hold_none():
    assert balanced_bounds([0.0] + [1.0] * 6 + [3.0], [1] * 8, 3) == [0, 3, 6, 6]  # 3, 3 and the head's 3
    assert balanced_bounds([3.0] + [1.0] * 6 + [0.0], [1] * 8, 3) == [0, 0, 3, 6]  # the embeddings alone first
    bounds = balanced_bounds([0.0] + [1.0] * 6 + [100.0], [1] * 8, 4)
    assert all(b < c for b, c in zip(bounds[1:-2], bounds[2:-1])), bounds  # no middle stage empty


def test_no_stage_holds_more_parameters_than_the_limit():
    params = [4] + [1] * 8 + [4]  # the even split holds 8 on each stage
    assert balanced_bounds([1.0] + [1.0] * 8 + [5.0], params, 2, limit=8) == [0, 4, 8]
    assert balanced_bounds([1.0] + [1.0] * 8 + [5.0], params, 2, limit=9) == [0, 5, 8]


def test_auto_is_accepted_and_other_strings_are_one_line(tmp_path):
    from hvdtrain.config import load_config

    config = write_config(tmp_path / "c.yaml", TINY)
    assert load_config(str(config), ["parallel.layer_boundaries=auto"]).parallel.layer_boundaries == "auto"
    with pytest.raises(UserError, match="config key 'parallel.layer_boundaries': expected"):
        load_config(str(config), ["parallel.layer_boundaries=even"])


# A GPT whose head (a 4096 vocabulary at width 64) costs three to five of its layers on one thread: the even split
# [0, 3, 6] leaves the last stage most of the work.
MODEL = {"arch": "gpt2", "n_layer": 6, "n_head": 2, "d_model": 64, "dropout": 0.0}
SEQ, VOCAB, MICRO = 64, 4096, 4


def stage_times(splits: list[list[int]], repeats: int = 5) -> dict[tuple, list[float]]:
    """Each split's two stages timed whole (forward, loss on the last, backward), the fastest
    of `repeats`, the splits interleaved so that the machine's load falls on both alike, on one
    thread as the workers measured them (helpers.OFFLINE's OMP_NUM_THREADS=1): more threads
    speed up the head's wide matmul more than the narrow layers', and the best split with them
    is another (here all six layers on the first stage was 1.1x the mean on one thread, 1.3x on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _stage_times(splits, repeats)
    finally:
        torch.set_num_threads(threads)


def _stage_times(splits: list[list[int]], repeats: int) -> dict[tuple, list[float]]:
    cfg = ModelConfig(**MODEL)
    stages = {}
    for bounds in splits:
        for s in range(2):
            torch.manual_seed(0)
            blueprint = model_blueprint(cfg, Vocab(size=VOCAB, pad_id=0), SEQ)
            layout = parallel_dims.Layout(stages=2, dp=1, stage=s, dp_rank=0)
            stages[tuple(bounds), s] = blueprint.materialise(pipeline.split_model(blueprint.model, layout, bounds))
    ids = torch.randint(0, VOCAB, (MICRO, SEQ))
    best = {key: float("inf") for key in stages}
    for _ in range(repeats + 1):
        for (bounds, s), stage in stages.items():
            x = ids if s == 0 else torch.randn(MICRO, SEQ, MODEL["d_model"], requires_grad=True)
            start = time.perf_counter()
            out = stage.chunks[0](x)
            (pipeline.TokenLoss(stage, 1.0)(out, ids) if s == 1 else out.square().mean()).backward()
            best[bounds, s] = min(best[bounds, s], time.perf_counter() - start)
            stage.zero_grad(set_to_none=True)
    return {tuple(b): [best[tuple(b), s] for s in range(2)] for b in splits}


def imbalance(times: list[float]) -> float:
    return max(times) / (sum(times) / len(times))


def layers_of_each_part(checkpoint) -> list[set[int]]:
    parts = []
    for path in sorted(checkpoint.glob("model-*.safetensors")):
        with safetensors.safe_open(str(path), "pt") as f:
            parts.append({int(m[1]) for m in (re.match(r"transformer\.h\.(\d+)\.", k) for k in f.keys()) if m})
    return parts


@pytest.mark.workers
def test_the_auto_split_of_a_heavy_head_balances_the_stages_on_every_rank_and_is_cached(tmp_path):
    config = write_config(tmp_path / "c.yaml", {
        "model": MODEL, "data": {"seq_len": SEQ, "vocab_size": VOCAB},
        "train": {"micro_batch_size": MICRO, "grad_accum": 2, "max_steps": 1},
        "parallel": {"pipeline_stages": 2, "layer_boundaries": "auto"}})
    said = []
    for run in ("first", "second"):
        proc = hvdtrain("launch", "-np", "2", config, f"out_dir={tmp_path / run}",
                        f"data.cache_dir={tmp_path / 'cache'}", timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        said.append(re.search(r"parallel.layer_boundaries auto: \[([\d, ]+)\] from the layers' costs, (\w+)",
                              proc.stdout))
        assert said[-1], proc.stdout[-3000:]
    bounds = [int(b) for b in said[0][1].split(", ")]
    assert said[0][2] == "measured" and said[1][2] == "cached" and said[1][1] == said[0][1]
    even = _even_bounds(6, 2)
    assert bounds != even and bounds[1] > even[1], bounds  # layers moved off the heavy last stage
    # every rank cut the model there: each checkpoint part holds its stage's layers
    assert layers_of_each_part(tmp_path / "first" / "checkpoints" / "step_00000001") == [
        set(range(0, bounds[1])), set(range(bounds[1], 6))]
    times = stage_times([even, bounds])
    assert imbalance(times[tuple(bounds)]) < imbalance(times[tuple(even)]), times


def test_stage_totals_count_the_embeddings_first_and_the_head_last():
    assert stage_totals([0, 2, 4], [10, 1, 1, 1, 1, 20]) == [12, 22]
    assert stage_totals([0, 0, 4, 4], [10, 1, 1, 1, 1, 20]) == [10, 4, 20]


def test_a_cache_file_that_is_not_the_costs_is_measured_again(tmp_path):
    from hvdtrain.parallel.layer_costs import _read_cache

    path = tmp_path / "costs.json"
    assert _read_cache(path) is None  # none yet
    for text in ("{not json", "[1, 2]", '{"costs": [1.0]}'):
        path.write_text(text)
        assert _read_cache(path) is None, text
    path.write_text('{"costs": [1.0], "params": [1]}')
    assert _read_cache(path) == {"costs": [1.0], "params": [1]}
