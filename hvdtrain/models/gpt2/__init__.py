"""GPT-2 (causal LM): what hvdtrain needs to know of it without importing torch."""
from hvdtrain.models import Family, ParameterCounts, transformer_layer


def parameter_counts(d: int, f: int, v: int, max_position: int, kv_width: int, **shape) -> ParameterCounts:
    # kv_width is d: multi-head attention, its key and value projections as wide as the queries
    return ParameterCounts(
        layer=transformer_layer(d, f),
        embeddings=v * d + max_position * d,  # wte, wpe
        lookups=v * d + max_position * d,
        head=2 * d,  # the final LayerNorm ln_f; lm_head is wte itself (no bias) when tied
        untied_output=v * d)


def shape_of(config) -> dict:
    return dict(n_layer=config.n_layer, d_model=config.n_embd, d_ff=config.n_inner or 4 * config.n_embd,
                vocab_size=config.vocab_size, max_position=config.n_positions,
                tied_embeddings=config.tie_word_embeddings)


FAMILY = Family(
    name="gpt2", causal=True, model_types=("gpt2",), auto_class="AutoModelForCausalLM",
    special_tokens={"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"},
    tokenizer="byte-level-bpe", parameter_counts=parameter_counts, shape_of=shape_of,
    # ln_1, fused QKV c_attn, c_proj, ln_2, c_fc, mlp c_proj: a weight and a bias each;
    # outside: wte, wpe, ln_f's weight and bias
    tensors_per_layer=12, other_tensors=4)
