"""Export a checkpoint as a Hugging Face folder that transformers loads without hvdtrain.

    hvdtrain export RUN_DIR_OR_CHECKPOINT OUT

OUT gets config.json + model.safetensors (save_pretrained) and the tokenizer, so
AutoModelForCausalLM / AutoModelForMaskedLM and AutoTokenizer load it directly.
"""
import os
import shutil
from pathlib import Path

from hvdtrain.errors import UserError
from hvdtrain.models import family_of_model_type
from hvdtrain.paths import check_writable_folder, written_whole


def save_hf(model, tokenizer_dir: Path | None, out: Path):
    """Written into a temporary folder first, then moved in file by file: a failed write (a
    full disk) leaves `out` as it was, not a folder that looks complete."""
    from transformers.utils import logging as hf_logging

    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Writing model shards" would stand between the run's lines or before an error
    with written_whole(f"the Hugging Face folder {out}", tmp):
        try:
            model.save_pretrained(tmp, safe_serialization=True)
        finally:
            if bar:
                hf_logging.enable_progress_bar()
        if tokenizer_dir is not None and tokenizer_dir.is_dir():
            for f in tokenizer_dir.iterdir():
                shutil.copy2(f, tmp / f.name)
        out.mkdir(parents=True, exist_ok=True)
        for f in tmp.iterdir():
            os.replace(f, out / f.name)
        tmp.rmdir()


def load_checkpoint_model(ckpt: Path):
    """The model of a checkpoint folder, rebuilt from its config.json and weights."""
    import transformers
    from transformers import AutoConfig

    from hvdtrain.checkpointing import checkpoint

    # No Python code from the folder: a config.json with auto_map is read as data only.
    try:
        config = AutoConfig.from_pretrained(ckpt, trust_remote_code=False)
    except ValueError as e:  # e.g. a model type only the folder's own code would build
        raise UserError(f"'{ckpt}': could not read config.json ({' '.join(str(e).split())})") from None
    found = family_of_model_type(config.model_type)
    auto = getattr(transformers, found.auto_class if found else "AutoModelForCausalLM")
    model = auto.from_config(config, trust_remote_code=False)
    checkpoint.load_weights(model, ckpt)
    return model


def run_export(args) -> int:
    from hvdtrain.checkpointing import checkpoint

    out = Path(args.out)
    check_writable_folder(out, "export folder")
    ckpt = checkpoint.resolve_checkpoint(args.source)
    if out.exists() and any(out.iterdir()) and not args.force:
        raise UserError(f"export folder '{out}' is not empty (use --force to overwrite)")
    model = load_checkpoint_model(ckpt)
    save_hf(model, checkpoint.run_dir_of(ckpt) / "tokenizer", out)
    print(f"exported {ckpt} -> {out}")
    return 0


def add_cli(sub):
    p = sub.add_parser("export", help="write a Hugging Face folder from a run or checkpoint")
    p.add_argument("source", help="run folder (its newest checkpoint) or a checkpoint folder")
    p.add_argument("out", help="output folder")
    p.add_argument("--force", action="store_true", help="write into a non-empty folder")
    p.set_defaults(func=run_export)
