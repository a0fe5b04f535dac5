"""Mixture-of-experts decoders (causal LM, Mixtral): what hvdtrain needs to know of them
without importing torch.

Mixtral is a Llama-style decoder (rotary positions, RMSNorm, grouped-query attention, no
biases) whose SwiGLU MLP is replaced by `model.experts` SwiGLU MLPs and a router: each token
goes to the `model.experts_per_token` experts its router scores highest, and their outputs
are summed with the router's renormalised weights (dropless by default: every token reaches
its k experts; model.capacity_factor caps each expert's share). Switch Transformer's load-balancing loss, scaled by `model.router_aux_loss_coef`,
is added to the training loss so that the router spreads the tokens; optionally ST-MoE's
router z-loss (`model.router_z_loss_coef`), which keeps the router logits small.
"""
from hvdtrain.models import Family, ParameterCounts

# Defaults of the family's knobs (hvdtrain.config.ModelConfig): Mixtral 8x7B's 8 experts,
# top-2, and its router auxiliary loss coefficient 0.02; an untied output matrix as Mixtral's.
EXPERTS = 8
EXPERTS_PER_TOKEN = 2
ROUTER_AUX_LOSS_COEF = 0.02
ROUTER_Z_LOSS_COEF = 0.0
TIE_EMBEDDINGS = False


def parameter_counts(d: int, f: int, v: int, max_position: int, kv_width: int, experts: int = EXPERTS,
                     experts_per_token: int = EXPERTS_PER_TOKEN, **shape) -> ParameterCounts:
    expert = 3 * d * f  # gate, up and down matrices of one SwiGLU expert
    return ParameterCounts(
        # q and o (d x d), k and v (kv_width x d), the experts, the router (experts x d), two
        # RMSNorm weights; no biases
        layer=2 * d * d + 2 * d * kv_width + experts * expert + experts * d + 2 * d,
        embeddings=v * d, lookups=v * d, head=d, untied_output=v * d,
        # a token multiplies with its k experts only
        unused=(experts - experts_per_token) * expert, experts=experts * expert)


def shape_of(config) -> dict:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return dict(n_layer=config.num_hidden_layers, d_model=config.hidden_size, d_ff=config.intermediate_size,
                vocab_size=config.vocab_size, max_position=config.max_position_embeddings,
                tied_embeddings=config.tie_word_embeddings,
                kv_width=(config.num_key_value_heads or config.num_attention_heads) * head_dim,
                experts=config.num_local_experts, experts_per_token=config.num_experts_per_tok)


def family_shape(model) -> dict:
    return dict(experts=model.experts or EXPERTS, experts_per_token=model.experts_per_token or EXPERTS_PER_TOKEN)


FAMILY = Family(
    name="mixtral", causal=True, model_types=("mixtral",), auto_class="AutoModelForCausalLM",
    # Llama 3's special tokens, as the Llama family (hvdtrain trains its own tokenizer)
    special_tokens={"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
    tokenizer="byte-level-bpe", parameter_counts=parameter_counts, shape_of=shape_of,
    # q, k, v, o, the router, the experts' gate_up and down tensors (one 3D tensor each for all
    # experts), two RMSNorms; outside: embed_tokens and the final norm
    tensors_per_layer=9, other_tensors=2,
    knobs=("n_kv_head", "rope_theta", "tie_embeddings", "experts", "experts_per_token", "router_aux_loss_coef",
           "router_z_loss_coef", "capacity_factor"),
    family_shape=family_shape, tie_embeddings=TIE_EMBEDDINGS, rotary=True,
    splits_layers=False)  # split experts' layers: not yet
