"""Config loading: YAML, inheritance, overrides and their types."""
import pytest

from hvdtrain.config import load_config
from hvdtrain.errors import UserError


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
