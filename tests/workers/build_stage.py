"""Test worker: build this rank's model as `hvdtrain train` does (train.build_model_and_optimizer:
the whole model, its pipeline stage, or with its experts split), then write OUT_DIR/build_rank{R}.json with the rise of
the process's peak resident set while building (model_build.PeakRise), the bytes of the weights
it built and of a sharded optimizer's master slices, and (unless the first argument is `--memory-only`) the built weights as
OUT_DIR/params_rank{R}.safetensors.

    build_stage.py [--memory-only] CONFIG KEY=VALUE..."""
import json
import sys
from pathlib import Path

import transformers
from safetensors.torch import save_file

from hvdtrain.parallel import distributed, expert_parallel, parallel_dims
from hvdtrain.config import load_config, resolve_batch
from hvdtrain.models.model_build import PeakRise
from hvdtrain.training.train import build_model_and_optimizer, check_data

memory_only = sys.argv[1] == "--memory-only"
args = sys.argv[2:] if memory_only else sys.argv[1:]
cfg = load_config(args[0], args[1:])
world = distributed.init(cfg)
par = cfg.parallel
grad_accum, global_batch = resolve_batch(cfg, world.size)
layout = groups = None
shards = world.size
if par.pipeline_stages > 1:
    layout = parallel_dims.layout_for(world.rank, world.size, par.pipeline_stages, par.stages_per_rank)
    groups = parallel_dims.open_groups(layout, "gloo")
    shards = layout.dp
expert_groups = (expert_parallel.open_expert_groups(expert_parallel.expert_grid(world.size, par.expert_parallel),
                                                   world.rank) if par.expert_parallel > 1 else None)
data = check_data(cfg, world, shards, global_batch, grad_accum)
transformers.GPT2LMHeadModel, transformers.BertForMaskedLM, transformers.MixtralForCausalLM  # noqa: B018 (imported now, not while measured)

with PeakRise() as peak:
    model, optimizer = build_model_and_optimizer(cfg, data, world.device, grad_accum, shards, layout, groups,
                                                 shard=layout.dp_rank if layout else world.rank,
                                                 expert_groups=expert_groups)[:2]

out = Path(cfg.out_dir)
out.mkdir(parents=True, exist_ok=True)
state = model.state_dict()
# the bytes the weights hold (a tied tensor once; none under parallel.shard=full) and the
# sharded optimizer's own fp32 master slices
weights = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state.values()}.values())
masters = sum(s.master.untyped_storage().nbytes() for s in getattr(optimizer, "slices", []) if s.master._base is None)
(out / f"build_rank{world.rank}.json").write_text(json.dumps({"peak_rise": peak.rise, "weights": weights,
                                                              "masters": masters}))
if not memory_only:  # clones: safetensors refuses the two names of one tied tensor
    save_file({k: v.detach().clone() for k, v in state.items()}, str(out / f"params_rank{world.rank}.safetensors"))
if groups is not None:
    groups.close()
if expert_groups is not None:
    expert_groups.close()
