"""ModernBERT (masked LM): what hvdtrain needs to know of it without importing torch.

An encoder of 2024 (Warner et al.): rotary positions, a GeGLU MLP (one input matrix of twice
the intermediate size, then the output matrix), LayerNorms without biases, no biases in the
linears, and attention that alternates: every `model.global_attn_every`-th layer (the first,
then every N-th) attends to the whole block, the others to a local window of
`model.local_attention` tokens around each position.
"""
from hvdtrain.models import Family, ParameterCounts

# Defaults of the family's knobs (hvdtrain.config.ModelConfig), ModernBERT-base's.
LOCAL_ATTENTION = 128     # tokens in a local layer's window (64 on each side)
GLOBAL_ATTN_EVERY = 3     # layers 0, 3, 6, ... attend globally
GLOBAL_ROPE_THETA = 160_000.0
LOCAL_ROPE_THETA = 10_000.0


def parameter_counts(d: int, f: int, v: int, max_position: int, kv_width: int, **shape) -> ParameterCounts:
    # kv_width is d: multi-head attention
    return ParameterCounts(
        # fused Wqkv (3d x d), Wo, GeGLU's Wi (2f x d) and Wo (d x f), attention and MLP norms
        # (weights only)
        layer=4 * d * d + 3 * d * f + 2 * d,
        # tok_embeddings and their norm, and the final norm, less the first layer's attention
        # norm, which ModernBERT leaves out (the embeddings' norm precedes it)
        embeddings=v * d + d,
        lookups=v * d,
        # the MLM head: dense (no bias) and norm, then the decoder (tok_embeddings when tied)
        # with its own bias
        head=d * d + d + v,
        untied_output=v * d)


def layer_kinds(n_layer: int, global_every: int) -> list[bool]:
    """For each layer, whether it attends globally (ModernBertConfig's layer_types)."""
    return [i % global_every == 0 for i in range(n_layer)]


def attended_keys(seq_len: int, n_layer: int, local_attention: int, global_every: int, **shape) -> int:
    """Keys each query attends to, summed over the layers: seq_len in a global layer, the
    window (local_attention + 1 tokens: the position and local_attention / 2 each side) in a
    local one, or the whole block when it is shorter."""
    local = min(seq_len, local_attention + 1)
    return sum(seq_len if g else local for g in layer_kinds(n_layer, global_every))


def shape_of(config) -> dict:
    types = config.layer_types
    return dict(n_layer=config.num_hidden_layers, d_model=config.hidden_size, d_ff=config.intermediate_size,
                vocab_size=config.vocab_size, max_position=config.max_position_embeddings,
                tied_embeddings=config.tie_word_embeddings, local_attention=config.local_attention,
                # the period of the pattern of layer types (ModernBertConfig's former key)
                global_every=next((i for i, t in enumerate(types) if i and t == "full_attention"), len(types)))


def family_shape(model) -> dict:
    return dict(local_attention=model.local_attention or LOCAL_ATTENTION,
                global_every=model.global_attn_every or GLOBAL_ATTN_EVERY)


FAMILY = Family(
    name="modernbert", causal=False, model_types=("modernbert",), auto_class="AutoModelForMaskedLM",
    # ModernBERT's own names; [MASK] takes the space before it, so "the [MASK] fox" asks for a word
    special_tokens={"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
                    "mask_token": "[MASK]"},
    tokenizer="byte-level-bpe", parameter_counts=parameter_counts, shape_of=shape_of,
    # Wqkv, Wo, attn_norm, mlp_norm, Wi, Wo; outside: tok_embeddings, their norm, final_norm, the
    # head's dense and norm, the decoder's bias, less the first layer's missing attn_norm
    tensors_per_layer=6, other_tensors=5,
    knobs=("local_attention", "global_attn_every"), attended_keys=attended_keys,
    family_shape=family_shape, rotary=True)
