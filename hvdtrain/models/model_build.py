"""Building a model part by part: parameters on the meta device, then only the kept part made real.

A pipeline rank must not hold the layers it does not own, not even for a moment while the
model is built. So a model is built in three steps (`Blueprint`):

    blueprint = Blueprint(lambda: GPT2LMHeadModel(config))   # parameters on the meta device
    part = pipeline.split_model(blueprint.model, layout, bounds)  # or blueprint.model itself
    blueprint.materialise(part)                               # real, initialised tensors

1. The constructor runs with every parameter moved to the meta device as it is registered
   (`parameters_on_meta`): shapes and dtypes, no memory. Buffers stay real: the modules' own
   constructors compute them (position ids, attention masks, rotary tables), so there is
   nothing to recompute later and no buffer ever holds the garbage of an empty tensor. They are
   small; the unowned ones go when the split drops their modules.
2. The caller keeps what it wants of `blueprint.model` (the split takes it apart in place).
3. `materialise` gives the kept parameters empty CPU storage (what `to_empty` does, restricted
   to them, and keeping tied parameters one tensor), then fills them: from a folder's
   safetensors files, reading only the kept tensors (`load_part`), or with
   transformers' own per-module initialisation (`model._init_weights(module)`, children before
   parents as transformers applies it; a tied parameter initialised by the tie's source alone,
   as transformers ties after initialising: `_untied`), each module under torch's generator
   seeded by (seed, the module's qualified name) on the CPU, where the part is made. A weight's
   initial value then depends only on its name and the seed, not on which other layers the
   rank holds: every pipeline layout starts from the unsplit model's weights, bit for bit, and
   every parameter has the distribution its transformers class gives it. With groups of
   parameters (a sharded model's units, hvdtrain.parallel.sharded_weights.materialise_slices)
   one group at a time is made real, filled and handed over, the others on meta meanwhile:
   the same values, one group's memory.

`startup_peak_bytes` measures what building one rank's part costs in host memory (for
`hvdtrain bench memory`).
"""
import contextlib
import hashlib
import json
import multiprocessing
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from hvdtrain.models.ties import tie_aliases
from hvdtrain.errors import UserError


@contextlib.contextmanager
def parameters_on_meta():
    """Inside, every parameter a module registers is moved to the meta device; buffers and
    other tensors are made as usual. (accelerate's init_empty_weights(include_buffers=False)
    does the same; transformers 5 no longer ships it.) A parameter already on meta (a tied
    weight assigned again) keeps its identity."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def module_seed(seed: int, name: str) -> int:
    """The generator seed of the module called `name` (its qualified name in the whole model)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


class Blueprint:
    """A model whose parameters are on the meta device, and how to make a part of it real.

    `seed`: the base of the per-module seeds; by default one draw of torch's global generator,
    so `torch.manual_seed(s)` before building still decides the weights.
    `weights`: a folder of safetensors files to fill the part from instead (model.pretrained);
    `saved_rows`: the embedding rows of its files, where the model has more
    (model.resize_embeddings, see load_part); `pieces`: the tensors its files hold in pieces
    (load_part)."""

    def __init__(self, make: Callable[[], nn.Module], seed: int | None = None, weights: Path | None = None,
                 saved_rows: int | None = None, pieces: Callable | None = None):
        with parameters_on_meta():
            self.model = make()
        self.seed = int(torch.randint(2 ** 62, ())) if seed is None else seed
        self.weights, self.saved_rows, self.pieces = weights, saved_rows, pieces
        self.aliases = tie_aliases(self.model)  # a stage's tied half may be saved under the other name
        # The whole model's modules in initialisation order, recorded before any split takes
        # modules out of the tree: a tied weight is initialised as in the whole model also
        # where only one of its modules is kept.
        self.modules = list(_init_order(self.model, "", self.model._init_weights))
        self.children = {id(m): dict(m._modules) for _, m, _ in self.modules}  # before a split
        # Where a tied parameter is the tie's target (the output matrix; the token embedding is
        # its source): also recorded before a split, which may take either module away.
        self.tie_targets = [_slot(self.model, name) for name in getattr(self.model, "all_tied_weights_keys", {})]

    def materialise(self, part: nn.Module, groups: list[list[nn.Parameter]] = (),
                    take: Callable[[list[nn.Parameter]], None] | None = None) -> nn.Module:
        """Give `part` (blueprint.model or a part of it) real, filled parameters; returns it.

        `groups` (of `part`'s parameters, while still on meta) and `take`: each group is made
        real and filled apart, the other groups' parameters on meta meanwhile (as a pipeline
        stage's missing layers are), and handed to `take`, which keeps what it needs of them
        and gives their storage back before the next group is made (full sharding: this copy's
        master slices, hvdtrain.parallel.sharded_weights.materialise_slices); the parameters in no
        group come last, together, and stay as they are made. A group's values are the same as
        when the part is made at once (each module's draws are its own), and at most one group
        is whole on the host at a time."""
        kept = {id(p): p for p in part.parameters()}  # the meta parameters, held until replaced
        slots = [(module, key, p) for _, module, _ in self.modules
                 for key, p in module._parameters.items() if p is not None and id(p) in kept]
        grouped = [[id(p) for p in group if id(p) in kept] for group in groups]
        rest = set(kept).difference(*map(set, grouped))
        made = {}  # id of a kept meta parameter -> its real one: a tied parameter stays one tensor
        for index, ids in enumerate([*grouped, [i for i in kept if i in rest]]):
            new = {i: nn.Parameter(torch.empty_like(kept[i], device="cpu"), requires_grad=kept[i].requires_grad)
                   for i in ids if i not in made}  # a parameter in two groups (a tie) is the first's
            made.update(new)
            for module, key, p in slots:  # this group real, every other one on meta for its filling
                module._parameters[key] = new.get(id(p), p)
            if self.weights is not None:
                load_part(part, self.weights, self.aliases, self.saved_rows, self.pieces)
            else:
                self._initialise()
            if take is not None and index < len(grouped):
                take(list(new.values()))
        for module, key, p in slots:
            module._parameters[key] = made[id(p)]
        self.modules, self.children, self.tie_targets = [], {}, []  # the modules the part does not hold can go now
        return part

    @torch.no_grad()
    def _initialise(self):
        # The CPU generator only (the parameters are on the CPU), restored afterwards: what
        # draws from torch's generators after the build (dropout) draws as it would without it.
        with torch.random.fork_rng(devices=[]), _untied(self.tie_targets):
            for name, module, init in self.modules:
                if any(not p.is_meta for p in module.parameters()):
                    # The children the split took out are put back for this module's own
                    # _init_weights, which may reach into them (ModernBERT's model inits its
                    # decoder, which a first stage does not hold); their parameters stay on meta.
                    dropped = {c: child for c, child in self.children[id(module)].items()
                               if child is not None and module._modules.get(c) is None}
                    module._modules.update(dropped)
                    torch.default_generator.manual_seed(module_seed(self.seed, name))
                    init(module)
                    module._modules.update(dict.fromkeys(dropped))


def _slot(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """(the module holding the parameter called `name`, its key there)."""
    parent, _, key = name.rpartition(".")
    return model.get_submodule(parent), key


@contextlib.contextmanager
def _untied(targets: list[tuple[nn.Module, str]]):
    """Inside, each tie target holds a parameter of its own on the meta device instead of the
    tied one, so that its initialisation does not touch the tie's source.

    transformers initialises a model with its ties apart and ties them afterwards
    (PreTrainedModel.init_weights: initialize_weights, then tie_weights, which makes each target
    its source): the tied parameter keeps its source's initialisation (the token embedding's:
    ModernBERT's std, BERT's and Llama's zero padding row), and what the target's module drew
    is dropped. Here the target draws nothing; the source's module draws as in transformers."""
    held = [(module, key, module._parameters[key]) for module, key in targets]
    for module, key, p in held:
        module._parameters[key] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    try:
        yield
    finally:
        for module, key, p in held:
            module._parameters[key] = p


def _init_order(module: nn.Module, name: str, init) -> Iterator[tuple[str, nn.Module, Callable]]:
    """(qualified name, module, its _init_weights) children first, as transformers'
    initialize_weights visits them: a sub-model (a PreTrainedModel inside) brings its own."""
    for child_name, child in module.named_children():
        child_init = child._init_weights if hasattr(child, "_init_weights") else init
        yield from _init_order(child, f"{name}.{child_name}" if name else child_name, child_init)
    yield name, module, init


# ---------------------------------------------------------------- weights from safetensors files

def safetensors_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the file holding it, for a Hugging Face folder: model.safetensors, or the
    shards listed in model.safetensors.index.json. Reads headers only."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise UserError(f"model.pretrained '{folder}' has neither model.safetensors nor model.safetensors.index.json "
                        f"(weights are read from safetensors files only)")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def load_part(part: nn.Module, folder: Path, aliases: dict[str, list[str]], saved_rows: int | None = None,
              pieces: Callable | None = None):
    """Copy into `part` its own tensors (state_dict names) from the folder's safetensors files,
    one tensor at a time: the files are opened and only the part's names are read. A name not
    in the files is looked for under the other names of its tied parameter in the whole model
    (`aliases`, ties.tie_aliases) and without the model's base prefix ("transformer.",
    "bert."), as save_pretrained may write them. The copy casts to the part's dtype (fp32
    masters from 16-bit files).

    `pieces(name)`: for a tensor the files may hold in pieces under other names (Mixtral's hub
    layout: one tensor per expert), (the pieces' names, what joins the pieces into it), or None;
    looked for where the name itself is not in the files.

    `saved_rows`: the files' vocabulary rows where the part has more (model.resize_embeddings).
    A tensor of `saved_rows` rows where the part's has more rows of the same width (the token
    embedding, the output matrix, its bias) fills the first rows; each added row is the mean of
    the saved ones. transformers' resize_token_embeddings draws them from a normal around that
    mean with 1e-9 times the rows' covariance, i.e. the mean to within 3e-5 of the rows'
    spread: an added token starts as an average one, so the model's predictions on the text it
    knows hardly move (https://nlp.stanford.edu/~johnhew/vocab-expansion.html). The mean itself
    needs no draw, so every stage that holds a tied copy computes the same rows."""
    from safetensors import safe_open

    files = safetensors_files(folder)
    prefix = part.base_model_prefix  # a PreTrainedModel's, or the one a pipeline stage copies
    # the tensors made real (materialise's groups: the others wait on the meta device)
    targets = {name: t for name, t in part.state_dict(keep_vars=True).items() if not t.is_meta}
    by_file: dict[Path, list[tuple[str, str]]] = {}
    joined: dict[str, tuple[list[str], Callable]] = {}
    for name in targets:
        candidates = [name, *aliases.get(name, [])]
        candidates += [c.removeprefix(f"{prefix}.") for c in candidates if prefix and c.startswith(f"{prefix}.")]
        source = next((c for c in candidates if c in files), None)
        split = pieces(name) if source is None and pieces is not None else None
        if split is not None and all(piece in files for piece in split[0]):
            joined[name] = split
        elif source is None:
            raise UserError(f"model.pretrained '{folder}' has no tensor '{name}' (or it was written for another model)")
        else:
            by_file.setdefault(files[source], []).append((name, source))
    with torch.no_grad():
        for name, (names, join) in joined.items():
            parts = []
            for piece in names:
                with safe_open(str(files[piece]), framework="pt") as f:
                    parts.append(f.get_tensor(piece))
            tensor = join(parts)
            if tensor.shape != targets[name].shape:
                raise UserError(f"model.pretrained '{folder}': the pieces of '{name}' ({names[0]}, ...) make shape "
                                f"{tuple(tensor.shape)}, the model wants {tuple(targets[name].shape)}")
            targets[name].copy_(tensor)
        for path, pairs in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for name, source in pairs:
                    tensor, target = f.get_tensor(source), targets[name]
                    if _added_rows(tensor, target, saved_rows):
                        target[:saved_rows].copy_(tensor)
                        target[saved_rows:].copy_(target[:saved_rows].mean(dim=0))
                    elif tensor.shape != target.shape:
                        raise UserError(f"model.pretrained '{folder}': tensor '{source}' has shape "
                                        f"{tuple(tensor.shape)}, the model wants {tuple(target.shape)}")
                    else:
                        target.copy_(tensor)


def _added_rows(saved: torch.Tensor, target: torch.Tensor, saved_rows: int | None) -> bool:
    """Whether `target` is `saved` with vocabulary rows added (model.resize_embeddings)."""
    return (saved_rows is not None and saved.shape[0] == saved_rows and target.shape[0] > saved_rows
            and saved.shape[1:] == target.shape[1:])


# ---------------------------------------------------------------- start-up memory

class PeakRise:
    """The rise of this process's peak resident set over a `with` block (Linux): the peak is
    reset at its start (/proc/self/clear_refs), so nothing that ran before counts, and the
    rise is measured from the resident set then. `rise` (bytes) is set when the block ends."""
    rise: int

    def __enter__(self):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
        self.start = _status_bytes("VmRSS")
        return self

    def __exit__(self, *exc):
        self.rise = _status_bytes("VmHWM") - self.start


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024  # "VmHWM:   123456 kB"
    raise KeyError(field)


def _build_and_measure(build: Callable[[], nn.Module], queue):
    import transformers  # the imports a build makes are not its memory
    transformers.GPT2LMHeadModel, transformers.BertForMaskedLM  # noqa: B018 (lazy modules load on access)
    with PeakRise() as peak:
        part = build()
    tensors = {t.data_ptr(): t for t in part.state_dict().values()}  # a tied tensor once
    queue.put((peak.rise, sum(t.numel() * t.element_size() for t in tensors.values())))


def startup_peak_bytes(build: Callable[[], nn.Module]) -> tuple[int, int]:
    """(peak host memory `build()` adds, bytes of the state it returns), measured in a fresh
    process (so that nothing built before is in it): the rise of its peak resident set while
    building (PeakRise). `build` must be picklable (a module-level function or a partial)."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_build_and_measure, args=(build, queue))
    process.start()
    result = queue.get()
    process.join()
    return result
