"""Start-up host memory of pipeline ranks: what building its part of the model costs a rank.

For `hvdtrain bench memory` (`startup_peaks`), or alone:

    python -m hvdtrain.tools.startup_memory RECIPE [--stages 1,2,4] [KEY=VALUE ...]

Each pipeline position's part is built as `hvdtrain train` builds it (hvdtrain.models.model_build:
parameters on the meta device, the stage kept, only its weights made real and initialised,
or read from model.pretrained), each in a fresh process whose peak resident set is measured
(model_build.startup_peak_bytes). Building needs no collective, so no Horovod: the copies of a
stage build the same thing as its first copy.
"""
import argparse
import sys
from functools import partial

from hvdtrain.config import Config, ModelConfig, load_config
from hvdtrain.errors import UserError


def build_rank_part(model: ModelConfig, vocab_size: int, seq_len: int, stages: int, stage: int,
                    boundaries: list[int] | None, seed: int):
    """Pipeline position `stage` of `stages` (the whole model when stages = 1), as
    train.build_model_and_optimizer builds it."""
    import torch

    from hvdtrain.parallel import parallel_dims, pipeline
    from hvdtrain.models.common import Vocab, model_blueprint

    torch.manual_seed(seed)
    blueprint = model_blueprint(model, Vocab(size=vocab_size, pad_id=0), seq_len)
    part = blueprint.model
    if stages > 1:
        bounds = pipeline.stage_bounds(part.config.num_hidden_layers, stages, 1, boundaries)
        part = pipeline.split_model(part, parallel_dims.Layout(stages, 1, stage, 0), bounds)
    return blueprint.materialise(part)


def startup_peaks(cfg: Config, stages: int) -> list[dict]:
    """Per pipeline position of a `stages`-stage layout: {"stage", "peak_bytes": the rise of the
    host's peak resident set while building, "weight_bytes": the state it built}. The recipe's
    parallel.layer_boundaries are used when they are for this many stages."""
    from hvdtrain.models.model_build import startup_peak_bytes

    boundaries = cfg.parallel.layer_boundaries if cfg.parallel.pipeline_stages == stages else None
    rows = []
    for stage in range(stages):
        build = partial(build_rank_part, cfg.model, cfg.data.vocab_size, cfg.data.seq_len, stages, stage,
                        boundaries, cfg.train.seed)
        peak, weights = startup_peak_bytes(build)
        rows.append({"stage": stage, "peak_bytes": peak, "weight_bytes": weights})
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvdtrain.tools.startup_memory", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="recipe")
    parser.add_argument("--stages", default="1,2,4", help="pipeline stage counts, comma-separated")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE config overrides")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if not all(s.strip().isdigit() and int(s) > 0 for s in args.stages.split(",")):
            raise UserError(f"--stages '{args.stages}': expected stage counts separated by commas, e.g. 1,2,4")
        stage_counts = [int(s) for s in args.stages.split(",")]
        print(f"{'stages':>6} {'stage':>5} {'peak host MB':>12} {'weights MB':>10}")
        for stages in stage_counts:
            for row in startup_peaks(cfg, stages):
                print(f"{stages:>6} {row['stage']:>5} {row['peak_bytes'] / 1e6:>12,.0f} "
                      f"{row['weight_bytes'] / 1e6:>10,.0f}")
    except UserError as e:
        print(f"hvdtrain: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
