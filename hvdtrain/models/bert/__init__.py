"""BERT (masked LM): what hvdtrain needs to know of it without importing torch."""
from hvdtrain.models import Family, ParameterCounts, transformer_layer

# BertConfig.type_vocab_size: the segment A / segment B embedding rows.
TOKEN_TYPES = 2


def parameter_counts(d: int, f: int, v: int, max_position: int, kv_width: int, **shape) -> ParameterCounts:
    # kv_width is d: multi-head attention, its key and value projections as wide as the queries
    return ParameterCounts(
        layer=transformer_layer(d, f),  # the same layer as GPT-2's
        # word, position, token-type embeddings and their LayerNorm
        embeddings=v * d + max_position * d + TOKEN_TYPES * d + 2 * d,
        lookups=v * d + max_position * d + TOKEN_TYPES * d,
        # MLM head: transform dense + LayerNorm, then the decoder (wte when tied) with its own
        # bias. BertForMaskedLM builds BertModel(add_pooling_layer=False): no pooler.
        head=(d * d + d) + 2 * d + v,
        # transformers 5 ties the decoder's bias to cls.predictions.bias only together with the
        # weight: untied, the decoder keeps its own bias (4.x always shared it).
        untied_output=v * d + v)


def shape_of(config) -> dict:
    return dict(n_layer=config.num_hidden_layers, d_model=config.hidden_size, d_ff=config.intermediate_size,
                vocab_size=config.vocab_size, max_position=config.max_position_embeddings,
                tied_embeddings=config.tie_word_embeddings)


FAMILY = Family(
    name="bert", causal=False, model_types=("bert",), auto_class="AutoModelForMaskedLM",
    special_tokens={"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
                    "mask_token": "[MASK]"},
    tokenizer="wordpiece", parameter_counts=parameter_counts, shape_of=shape_of,
    # query, key, value, output dense, 2 LayerNorms, 2 MLP linears: a weight and a bias each;
    # outside: 3 embeddings + their LayerNorm (2); the head's bias, dense (2) and LayerNorm (2)
    tensors_per_layer=16, other_tensors=10)
