"""Llama-style decoders (causal LM): what hvdtrain needs to know of them without importing torch.

The Llama 3 design that Mistral- and Qwen2-class models share: rotary positions (no position
table), RMSNorm (a weight, no bias), a SwiGLU MLP (gate, up and down matrices), grouped-query
attention (`model.n_kv_head` key/value heads shared by the query heads), no biases anywhere,
and an output matrix tied to the token embedding or not (`model.tie_embeddings`).
"""
from hvdtrain.models import Family, ParameterCounts

# Defaults of the family's knobs (hvdtrain.config.ModelConfig), those of Llama 3.2 1B: a
# tied output matrix and rope theta 500,000; RMSNorm's epsilon is Llama 3's 1e-5.
TIE_EMBEDDINGS = True
ROPE_THETA = 500_000.0
RMS_NORM_EPS = 1e-5


def parameter_counts(d: int, f: int, v: int, max_position: int, kv_width: int, **shape) -> ParameterCounts:
    return ParameterCounts(
        # q and o projections (d x d), k and v (kv_width x d: GQA's smaller ones), the three
        # SwiGLU matrices, two RMSNorm weights; no biases
        layer=2 * d * d + 2 * d * kv_width + 3 * d * f + 2 * d,
        embeddings=v * d,  # embed_tokens; rotary positions have no parameters
        lookups=v * d,
        head=d,  # the final RMSNorm; lm_head is embed_tokens itself when tied
        untied_output=v * d)


def shape_of(config) -> dict:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return dict(n_layer=config.num_hidden_layers, d_model=config.hidden_size, d_ff=config.intermediate_size,
                vocab_size=config.vocab_size, max_position=config.max_position_embeddings,
                tied_embeddings=config.tie_word_embeddings,
                kv_width=(config.num_key_value_heads or config.num_attention_heads) * head_dim)


FAMILY = Family(
    name="llama", causal=True, model_types=("llama",), auto_class="AutoModelForCausalLM",
    # Llama 3's: distinct begin and end of text; documents are joined by the end token, and the
    # tokenizer puts the begin token before a prompt, as Llama 3's does.
    special_tokens={"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
    tokenizer="byte-level-bpe", parameter_counts=parameter_counts, shape_of=shape_of,
    # q, k, v, o, gate, up, down, two RMSNorms: one weight each; outside: embed_tokens and the
    # final norm (plus lm_head when untied, which the planner's count leaves out)
    tensors_per_layer=9, other_tensors=2,
    knobs=("n_kv_head", "rope_theta", "tie_embeddings"), tie_embeddings=TIE_EMBEDDINGS, rotary=True)
