"""The model families hvdtrain trains, one folder each, and the registry that names them.

A family folder holds everything that differs between, say, GPT-2 and BERT (the families:
GPT-2, BERT, Llama, ModernBERT, Mixtral):
  * `<family>/__init__.py` (no torch import, so `hvdtrain plan` and config checks start fast):
    a `Family` with the training objective, the tokenizer it trains, and its parameter counts
    for FLOPs, MFU and the planner;
  * `<family>/modeling.py` (torch): what builds the `transformers` model (`model_maker`) and
    its `PARTS` (ModelParts): where its body, layers and masked-LM head are, and the steps a
    pipeline stage is cut from.
Beside the families: `common` (building a model of any family, the loss), `model_build` (the
meta-device build and per-module initialisation), `ties` (tied parameter names), `flops`.

Adding a family means adding a folder and one line to FAMILIES. Code elsewhere asks
`family(cfg.model.arch)` (or `family_of_model_type(config.model_type)` for a model that exists)
instead of testing names.
"""
import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable, Optional

# model.arch -> the package of that family
FAMILIES = {
    "gpt2": "hvdtrain.models.gpt2",
    "bert": "hvdtrain.models.bert",
    "llama": "hvdtrain.models.llama",
    "modernbert": "hvdtrain.models.modernbert",
    "mixtral": "hvdtrain.models.mixtral",
}
NAMES = tuple(FAMILIES)


def transformer_layer(d: int, f: int) -> int:
    """The parameters of a GPT-2 / BERT layer: Q, K, V and output projections with biases
    (4d^2 + 4d), two MLP linears with biases (2·d·f + f + d), two LayerNorms (4d)."""
    return (4 * d * d + 4 * d) + (2 * d * f + f + d) + 2 * (2 * d)


@dataclass(frozen=True)
class ParameterCounts:
    """A family's parameters by part, for a model of width d, MLP width f, vocabulary v,
    max_position positions and key/value projections kv_width wide (d, but smaller with
    grouped-query attention), as `sum(p.numel() for p in model.parameters())` counts them."""
    layer: int           # one transformer layer
    embeddings: int      # everything before the first layer (tables and their norms)
    lookups: int         # the tables among `embeddings` (no matmul: they do not count as FLOPs)
    head: int            # the head after the last layer, without the output matrix (v x d)
    untied_output: int   # what an output matrix not tied to the token embedding adds
    # those of `layer` that a token does not multiply with (a mixture's experts it is not
    # routed to): FLOPs and MFU count the active parameters, layer - unused
    unused: int = 0
    # those of `layer` in a mixture's experts: what parallel.expert_parallel splits
    experts: int = 0


@dataclass(frozen=True)
class Family:
    name: str                   # the model.arch value
    causal: bool                # causal LM (next token); else masked LM
    model_types: tuple          # transformers `config.model_type` values this family loads
    auto_class: str             # the transformers Auto class of a pretrained model
    special_tokens: dict        # a trained tokenizer's special tokens (transformers names)
    tokenizer: str              # the kind of tokenizer trained for it: "byte-level-bpe" or "wordpiece"
    # parameter_counts(d_model, d_ff, vocab_size, max_position, kv_width, **family_shape's keys)
    parameter_counts: Callable[..., ParameterCounts]
    # (n_layer, d_model, d_ff, vocab_size, max_position, tied_embeddings[, kv_width][, the
    # family's own shape keys, as family_shape's]) of a transformers config
    shape_of: Callable[[object], dict]
    tensors_per_layer: int      # parameter tensors per layer: the allreduce count with tensor fusion off
    other_tensors: int          # parameter tensors outside the layers (embeddings, head)
    # The family's own model.* keys (e.g. Llama's n_kv_head); another family's knob set for
    # this family is a config error.
    knobs: tuple = ()
    # attended_keys(seq_len, **shape_of's dict): the keys each query attends to, summed over
    # the layers (the attention term of the FLOPs); every key in every layer by default
    attended_keys: Callable[..., int] = lambda seq_len, n_layer, **shape: n_layer * seq_len
    # family_shape(model config section): those of shape_of's keys that only this family has
    # (ModernBERT's attention layout, a mixture's experts), for a model described by the config
    family_shape: Callable[[object], dict] = lambda model: {}
    # The default of model.tie_embeddings: the output matrix is the token embedding (every
    # family's but Mixtral's; a knob only where the family has it)
    tie_embeddings: bool = True
    # Rotary position embeddings (Llama, ModernBERT): they turn pairs of each head's dimensions,
    # so the head dimension d_model / n_head must be even.
    rotary: bool = False
    # parallel.tensor_parallel can split its layers (its ModelParts.tensor_plan, which the
    # config check cannot read without importing torch)
    splits_layers: bool = True

    @property
    def objective(self) -> str:
        return "causal" if self.causal else "masked"

    def modeling(self) -> ModuleType:
        """The family's torch module (`<family>/modeling.py`)."""
        return importlib.import_module(FAMILIES[self.name] + ".modeling")


def family(arch: str) -> Family:
    """The family `model.arch` names (the config has checked it is one of NAMES)."""
    return importlib.import_module(FAMILIES[arch]).FAMILY


def knob_owners() -> dict[str, tuple]:
    """The model.* keys that only some families have (Family.knobs) -> those families."""
    owners = {}
    for arch in FAMILIES:
        for knob in family(arch).knobs:
            owners[knob] = owners.get(knob, ()) + (arch,)
    return owners


def family_of_model_type(model_type: str) -> Optional[Family]:
    """The family that loads a transformers model of `model_type`; None for another one."""
    for arch in FAMILIES:
        if model_type in family(arch).model_types:
            return family(arch)
    return None


def family_of(model) -> Family:
    """The family of a built model (a transformers model or a pipeline stage of one)."""
    found = family_of_model_type(model.config.model_type)
    if found is None:
        raise ValueError(f"no hvdtrain family for model type {model.config.model_type!r}")
    return found


def no_layer_inputs(stage, hidden) -> Callable:
    """ModelParts.layer_inputs of a family whose layers take the hidden states alone."""
    return lambda layer: {}


@dataclass(frozen=True)
class TensorPlan:
    """How parallel.tensor_parallel splits one layer of a family (hvdtrain.parallel.tensor_parallel);
    paths are within the layer."""
    # each split linear layer: "colwise" (its outputs split: query, key, value, up projections)
    # or "rowwise" (its inputs: the projections back to d_model)
    styles: dict
    # a colwise layer whose outputs join several blocks (GPT-2's c_attn: query, key, value: 3):
    # its rows are reordered so that each rank's slice holds its part of every block
    fused: dict = field(default_factory=dict)
    # transformers' Conv1D layers (GPT-2: weights stored [in, out]), made nn.Linear to be split
    conv1d: tuple = ()
    # attributes ("path.name") that count a layer's outputs, divided by t on each rank (GPT-2's
    # attn.split_size: where c_attn's outputs are cut into query, key and value)
    per_rank: tuple = ()


@dataclass(frozen=True)
class ModelParts:
    """Where a family's model keeps its parts, and how a pipeline stage
    (hvdtrain.parallel.pipeline.StageModule) is cut from it: the module paths it keeps or drops
    and the steps around the layers. `embed(stage, input_ids)`, `final_norm(stage, hidden)`
    and `layer_inputs(stage, hidden)` get the stage, which holds the model's own top-level
    modules; the stage's head is the model's output embeddings (after `masked_head`)."""
    body: str                 # path of everything before the output head (e.g. GPT2Model)
    layers: str               # path of the layer ModuleList
    first_only: tuple         # modules only the first stage keeps
    last_only: tuple          # modules only the last stage keeps
    embed: Callable           # input_ids -> hidden states before the first layer
    final_norm: Callable      # hidden states after the last layer -> the head's inputs
    # -> a function from a layer to the keyword arguments it gets besides the hidden states,
    # computed once per stage from the stage's input (e.g. Llama's rotary position embeddings;
    # ModernBERT's masks and rotary embeddings, which depend on the kind of layer)
    layer_inputs: Callable = no_layer_inputs
    # a masked LM: path of the module its masked positions go through before the vocabulary
    # projection (BERT's MLM transform); None: a causal LM, every position goes to the projection
    masked_head: Optional[str] = None
    # keyword arguments of the body's forward in training (a mixture's output_router_logits)
    body_options: dict = field(default_factory=dict)
    # An auxiliary loss of training (a mixture's load balancing), None: the token losses alone.
    # auxiliary_loss(model, body output, targets) -> (what the micro batch adds to its loss sum,
    # a vector of statistics of it to log); statistics_record(the model's transformers config,
    # those summed over a log interval's steps and the ranks, the interval's targets) -> the
    # train record's entries.
    auxiliary_loss: Optional[Callable] = None
    statistics_record: Optional[Callable] = None
    # A mixture: module -> whether it holds one layer's experts (what parallel.expert_parallel
    # splits, hvdtrain.parallel.expert_parallel); None: the family has none.
    is_experts: Optional[Callable] = None
    # A pipeline stage of a family with an auxiliary loss passes on more than the hidden states
    # (a mixture: its routers' sums, which the loss needs from every layer):
    # stage_carry(stage, layer ids, what the stage before sent or None, run_layers) -> (hidden
    # states, what this stage sends on), run_layers() running the stage's layers; the last
    # stage's carried_loss(config, what it sends on, tokens, targets) -> (what the micro batch
    # adds to its loss sum, statistics: as auxiliary_loss's), statistics_size(config) of them.
    stage_carry: Optional[Callable] = None
    carried_loss: Optional[Callable] = None
    statistics_size: Callable = lambda config: 0
    # How parallel.tensor_parallel splits each layer (TensorPlan); None: the family is not split yet.
    tensor_plan: Optional["TensorPlan"] = None
