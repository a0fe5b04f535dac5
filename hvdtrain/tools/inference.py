"""Try a trained model: `hvdtrain generate` (GPT-2, Llama) and `hvdtrain fill-mask` (BERT, ModernBERT).

Both take a Hugging Face folder (from `hvdtrain export`, or OUT_DIR/hf after training).
"""
from pathlib import Path

from hvdtrain.errors import UserError


def check_model_dir(path: str):
    """A Hugging Face folder whose weights are model.safetensors (or its shards' index): a
    pickled pytorch_model.bin next to them is never loaded (unpickling can run code)."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise UserError(f"'{path}' is not a model folder (no config.json); export one with `hvdtrain export`")
    if not any((folder / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
        raise UserError(f"'{path}' has no model.safetensors; hvdtrain does not load pickled weights")


def load_model_dir(path: str, auto_class: str):
    """(model, tokenizer) of a model folder, the model by transformers' `auto_class`: weights from
    safetensors only and no Python code from the folder (trust_remote_code=False: a config's
    auto_map neither prompts nor runs)."""
    check_model_dir(path)  # before transformers loads (seconds): a wrong folder is told at once
    import transformers

    try:  # the model first: a config that needs the folder's code stops here, before the tokenizer reads it
        model = getattr(transformers, auto_class).from_pretrained(path, use_safetensors=True, trust_remote_code=False)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"'{path}': could not load the model ({first})") from None
    return model.eval(), tokenizer


def run_generate(args) -> int:
    model, tokenizer = load_model_dir(args.model, "AutoModelForCausalLM")
    import torch

    torch.manual_seed(args.seed)
    inputs = tokenizer(args.prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=True, top_k=args.top_k,
                             temperature=args.temperature, pad_token_id=tokenizer.eos_token_id)
    print(tokenizer.decode(out[0], skip_special_tokens=True))
    return 0


def run_fill_mask(args) -> int:
    model, tokenizer = load_model_dir(args.model, "AutoModelForMaskedLM")
    from transformers import pipeline

    fill = pipeline("fill-mask", model=model, tokenizer=tokenizer, trust_remote_code=False)
    if fill.tokenizer.mask_token not in args.text:
        raise UserError(f"the text must contain the mask token {fill.tokenizer.mask_token}")
    for guess in fill(args.text, top_k=args.top_k):
        # one guess a line: a byte-level tokenizer (ModernBERT's) may guess a line break
        print(f"{guess['score']:.3f}  {guess['sequence']}".replace("\n", "\\n"))
    return 0


def add_cli(sub):
    p = sub.add_parser("generate", help="sample a continuation from a causal LM folder (GPT-2, Llama)")
    p.add_argument("model")
    p.add_argument("prompt")
    p.add_argument("--max-new-tokens", type=int, default=50)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run_generate)

    p = sub.add_parser("fill-mask", help="predict the [MASK] token(s) with a masked LM folder (BERT, ModernBERT)")
    p.add_argument("model")
    p.add_argument("text")
    p.add_argument("--top-k", type=int, default=5)
    p.set_defaults(func=run_fill_mask)
