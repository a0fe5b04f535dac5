"""Config loading: YAML, inheritance, overrides and their types; checks that combine keys;
the step a run ends after."""
import pytest

from hvdtrain.config import last_step_of_run, load_config
from hvdtrain.errors import UserError
from hvdtrain.models import NAMES, family


def test_overrides_are_typed_and_exponents_without_a_dot_are_numbers(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 3e-4\n")  # YAML 1.1 reads this as a string
    cfg = load_config(str(path), ["train.max_steps=7", "train.weight_decay=1e-2", "train.betas=[0.9, 0.95]",
                                  "model.compile=true", "train.global_batch_size=null"])
    assert cfg.train.lr == 3e-4 and cfg.train.weight_decay == 0.01
    assert cfg.train.max_steps == 7 and cfg.train.betas == [0.9, 0.95] and cfg.model.compile is True
    assert cfg.train.global_batch_size is None
    with pytest.raises(UserError, match="'train.lr'"):
        load_config(str(path), ["train.lr=nan"])


def test_base_recipe_is_inherited_and_overridden(tmp_path):
    (tmp_path / "base.yaml").write_text("model:\n  n_layer: 12\n  d_model: 768\ntrain:\n  lr: 1.0e-3\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\nmodel:\n  n_layer: 24\n")
    cfg = load_config(str(tmp_path / "child.yaml"))
    assert (cfg.model.n_layer, cfg.model.d_model, cfg.train.lr) == (24, 768, 1e-3)
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(UserError, match="loops back"):
        load_config(str(tmp_path / "loop.yaml"))


def test_every_shipped_recipe_loads():
    from pathlib import Path
    recipes = sorted((Path(__file__).resolve().parent.parent / "recipes").glob("*.yaml"))
    assert len(recipes) >= 8
    for recipe in recipes:
        load_config(str(recipe))


def test_lr_scaling_needs_a_batch_that_grows_with_the_workers(tmp_path):
    """With train.global_batch_size fixed the batch is the same at every world size: scaling
    the rate by the workers would only make it jump when a resume changes their number."""
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  global_batch_size: 64\n")
    for rule in ("linear", "sqrt"):
        with pytest.raises(UserError, match=r"'train.lr_scaling'.*train.global_batch_size is fixed \(64\)"):
            load_config(str(path), [f"train.lr_scaling={rule}"])
    assert load_config(str(path), ["train.lr_scaling=none"]).train.lr_scaling == "none"
    scaled = load_config(str(path), ["train.lr_scaling=linear", "train.global_batch_size=null"])
    assert scaled.train.lr_scaling == "linear"


def test_lamb_needs_weight_decay():
    """LAMB's trust ratio applies to the parameters with weight decay only (hvdtrain.optim.lamb)."""
    with pytest.raises(UserError, match=r"'train.weight_decay'.*'lamb'"):
        load_config(None, ["train.optimizer=lamb", "train.weight_decay=0"])
    assert load_config(None, ["train.optimizer=lamb", "train.weight_decay=0.01"]).train.optimizer == "lamb"
    assert load_config(None, ["train.weight_decay=0"]).train.weight_decay == 0.0  # AdamW: fine


@pytest.mark.parametrize("stop_at_step, start_step, expected", [
    (None, 0, 10),  # no pause
    (4, 0, 4),      # a fresh run pauses there
    (4, 2, 4),      # so does one resumed before it
    (4, 4, 10),     # the same command after the pause continues to max_steps
    (4, 6, 10),
])
def test_stop_at_step_is_a_pause(stop_at_step, start_step, expected):
    cfg = load_config(None, ["train.max_steps=10"])
    cfg.train.stop_at_step = stop_at_step
    assert last_step_of_run(cfg.train, start_step) == expected


@pytest.mark.parametrize("overrides,words", [
    (["train.seed=-1"], "'train.seed': expected an integer in [0, 2^32 - 1], got -1"),
    (["train.seed=4294967296"], "'train.seed'"),
    (["train.slow_ranks=[0, -1]"], "'train.slow_ranks'"),
    (["train.slow_seconds=-1"], "'train.slow_seconds'"),
    (["model.d_model=0"], "'model.d_model': expected an integer >= 1"),
    (["model.d_ff=0"], "'model.d_ff'"),
    (["model.arch=modernbert", "model.d_model=36", "model.n_head=4"], "'model.n_head'"),
    (["model.arch=llama", "model.d_model=6", "model.n_head=2"], "even head dimension"),
    (["horovod.fusion_threshold_mb=-1"], "'horovod.fusion_threshold_mb'"),
    (["horovod.cycle_time_ms=0"], "'horovod.cycle_time_ms'"),
    (["log.imbalance_threshold=-0.1"], "'log.imbalance_threshold'"),
    (["log.peak_tflops=0"], "'log.peak_tflops'"),
    (["profile.ranks=[-1]"], "'profile.ranks'"),
    (["profile.wait=-1"], "'profile.wait'"),
    (["profile.warmup=-1"], "'profile.warmup'"),
], ids=lambda v: v[0] if isinstance(v, list) else "")
def test_every_number_is_checked_for_the_range_the_code_needs(overrides, words):
    """One line naming the key, before anything runs (the other keys' bounds: test_errors.py)."""
    with pytest.raises(UserError) as error:
        load_config(None, overrides)
    assert words in str(error.value) and "\n" not in str(error.value)


def test_the_ends_of_the_ranges_are_accepted():
    cfg = load_config(None, ["train.seed=0", "model.arch=llama", "model.d_model=8", "model.n_head=4",
                             "horovod.fusion_threshold_mb=0", "profile.wait=0", "profile.warmup=0"])
    assert (cfg.train.seed, cfg.model.d_model // cfg.model.n_head) == (0, 2)
    assert load_config(None, ["train.seed=4294967295", "model.d_model=36", "model.n_head=4"]).train.seed == 2 ** 32 - 1


@pytest.mark.parametrize("arch", NAMES)
def test_a_family_splits_its_layers_where_it_has_a_tensor_plan(arch):
    """The config check reads Family.splits_layers (no torch import); training reads the plan."""
    assert family(arch).splits_layers == (family(arch).modeling().PARTS.tensor_plan is not None)
