"""Try a trained model: `hvdtrain generate` (GPT) and `hvdtrain fill-mask` (BERT).

Both take a Hugging Face folder (from `hvdtrain export`, or OUT_DIR/hf after training).
"""
from pathlib import Path

from hvdtrain.errors import UserError


def check_model_dir(path: str):
    """A Hugging Face folder with safetensors weights: a pickled pytorch_model.bin is never loaded
    (unpickling can run code)."""
    if not (Path(path) / "config.json").is_file():
        raise UserError(f"'{path}' is not a model folder (no config.json); export one with `hvdtrain export`")
    if not list(Path(path).glob("*.safetensors")):
        raise UserError(f"'{path}' has no .safetensors weights; hvdtrain does not load pickled weights")


def run_generate(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_model_dir(args.model)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, use_safetensors=True).eval()
    inputs = tokenizer(args.prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=True, top_k=args.top_k,
                             temperature=args.temperature, pad_token_id=tokenizer.eos_token_id)
    print(tokenizer.decode(out[0], skip_special_tokens=True))
    return 0


def run_fill_mask(args) -> int:
    from transformers import pipeline

    check_model_dir(args.model)
    fill = pipeline("fill-mask", model=args.model, tokenizer=args.model)
    if fill.tokenizer.mask_token not in args.text:
        raise UserError(f"the text must contain the mask token {fill.tokenizer.mask_token}")
    for guess in fill(args.text, top_k=args.top_k):
        print(f"{guess['score']:.3f}  {guess['sequence']}")
    return 0


def add_cli(sub):
    p = sub.add_parser("generate", help="sample a continuation from a GPT model folder")
    p.add_argument("model")
    p.add_argument("prompt")
    p.add_argument("--max-new-tokens", type=int, default=50)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run_generate)

    p = sub.add_parser("fill-mask", help="predict the [MASK] token(s) with a BERT model folder")
    p.add_argument("model")
    p.add_argument("text")
    p.add_argument("--top-k", type=int, default=5)
    p.set_defaults(func=run_fill_mask)
