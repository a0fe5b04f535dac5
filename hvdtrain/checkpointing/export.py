"""Export a checkpoint as a Hugging Face folder that transformers loads without hvdtrain.

    hvdtrain export RUN_DIR_OR_CHECKPOINT OUT

OUT gets the layout of a hub model: config.json, generation_config.json (generative families),
the weights in safetensors files of at most MAX_SHARD_BYTES each (model.safetensors, or
model-00001-of-0000N.safetensors ... with model.safetensors.index.json), and the tokenizer, so
AutoModelForCausalLM / AutoModelForMaskedLM and AutoTokenizer load it directly.

The folder is written from the checkpoint's files, one output file at a time (`export_checkpoint`):
the model is built on the meta device (names and shapes, no memory) to know which tensors
transformers expects and how save_pretrained would shard them, then each file's tensors are read
from the checkpoint's parts (whole tensors, a stage's part or a sharded copy's slices, put back
together) and written. No more than one output file's worth of weights is ever held, so a
run's end (training.train) and `hvdtrain export` need no host that can hold the whole model.
The weights are the run's fp32 masters; config.json says the dtype the files hold.
"""
import json
import os
import shutil
from pathlib import Path

from hvdtrain.errors import UserError
from hvdtrain.models import family_of_model_type
from hvdtrain.paths import check_writable_folder, written_whole

# The largest safetensors file of an export, as hub models are cut (transformers' save_pretrained
# and the Hub's own uploads use 5 GB for the big models); a tensor larger than this is a file alone.
MAX_SHARD_BYTES = 5 * 10 ** 9


def checkpoint_config(ckpt: Path):
    """The transformers config of a checkpoint folder (its config.json), and the auto class that
    builds its model. No Python code from the folder: a config.json with auto_map is data only."""
    import transformers
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(ckpt, trust_remote_code=False)
    except ValueError as e:  # e.g. a model type only the folder's own code would build
        raise UserError(f"'{ckpt}': could not read config.json ({' '.join(str(e).split())})") from None
    found = family_of_model_type(config.model_type)
    return config, getattr(transformers, found.auto_class if found else "AutoModelForCausalLM")


def export_checkpoint(ckpt: Path, tokenizer_dir: Path | None, out: Path, max_shard_bytes: int = MAX_SHARD_BYTES):
    """Write the Hugging Face folder `out` from checkpoint `ckpt`, one safetensors file at a time.
    Written into a temporary folder first, then moved in file by file: a failed write (a full
    disk) leaves `out` as it was, not a folder that looks complete."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    from hvdtrain.checkpointing import checkpoint
    from hvdtrain.models.model_build import parameters_on_meta
    from hvdtrain.models.ties import tie_aliases

    config, auto = checkpoint_config(ckpt)
    with parameters_on_meta():
        model = auto.from_config(config, trust_remote_code=False)
    # The tensors save_pretrained would write (a tied output matrix left to the embedding), and
    # its way of cutting them into files
    meta = remove_tied_weights_from_state_dict(model.state_dict(), model)
    split = split_torch_state_dict_into_shards(meta, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_bytes)
    aliases = tie_aliases(model)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with written_whole(f"the Hugging Face folder {out}", tmp):
        tmp.mkdir(parents=True)
        dtypes = set()
        for filename, names in split.filename_to_tensors.items():
            tensors = {name: t.contiguous() for name, t in checkpoint.read_weights(ckpt, names, aliases).items()}
            dtypes.update(t.dtype for t in tensors.values())
            save_file(tensors, str(tmp / filename), metadata={"format": "pt"})
            del tensors  # one file's worth at a time
        if split.is_sharded:
            index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in meta.values())},
                     "weight_map": split.tensor_to_filename}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        if len(dtypes) == 1:  # what the files hold (the fp32 masters), as save_pretrained records it
            config.dtype = str(dtypes.pop()).removeprefix("torch.")
        config.architectures = [type(model).__name__]
        config.save_pretrained(tmp)
        if model.can_generate():
            model.generation_config.save_pretrained(tmp)
        # The tokenizer's files last: a generation_config.json kept from model.pretrained (in the
        # run's tokenizer folder) replaces the default one made from config.json
        if tokenizer_dir is not None and tokenizer_dir.is_dir():
            for f in tokenizer_dir.iterdir():
                shutil.copy2(f, tmp / f.name)
        out.mkdir(parents=True, exist_ok=True)
        for stale in [*out.glob("model*.safetensors"), *out.glob("model.safetensors.index.json")]:
            stale.unlink()  # an earlier export cut into other files (--force): never a mix of two
        for f in tmp.iterdir():
            os.replace(f, out / f.name)
        tmp.rmdir()


def run_export(args) -> int:
    from hvdtrain.checkpointing import checkpoint

    out = Path(args.out)
    check_writable_folder(out, "export folder")
    ckpt = checkpoint.resolve_checkpoint(args.source)
    if out.exists() and any(out.iterdir()) and not args.force:
        raise UserError(f"export folder '{out}' is not empty (use --force to overwrite)")
    if args.max_shard_mb < 1:
        raise UserError(f"--max-shard-mb: expected an integer >= 1, got {args.max_shard_mb}")
    export_checkpoint(ckpt, checkpoint.run_dir_of(ckpt) / "tokenizer", out, args.max_shard_mb * 10 ** 6)
    print(f"exported {ckpt} -> {out}")
    return 0


def add_cli(sub):
    p = sub.add_parser("export", help="write a Hugging Face folder from a run or checkpoint")
    p.add_argument("source", help="run folder (its newest checkpoint) or a checkpoint folder")
    p.add_argument("out", help="output folder")
    p.add_argument("--force", action="store_true", help="write into a non-empty folder")
    p.add_argument("--max-shard-mb", type=int, default=MAX_SHARD_BYTES // 10 ** 6,
                   help="the largest safetensors file in MB (default 5000: 5 GB, as hub models are cut)")
    p.set_defaults(func=run_export)
