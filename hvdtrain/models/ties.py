"""Tied parameters: the names under which one parameter appears in a model (the token
embedding and the output matrix), for pipeline stages, checkpoints and the stage builder."""


def tied_names(model) -> list[list[str]]:
    """Groups of names that are one parameter in the model (GPT-2's wte and lm_head, BERT's word
    embeddings and decoder), in the model's order."""
    by_param = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(p, []).append(name)
    return [names for names in by_param.values() if len(names) > 1]


def tie_aliases(model) -> dict[str, list[str]]:
    """For each parameter name, the other names of the same tied parameter in the whole model
    (GPT-2's wte and lm_head, BERT's word embeddings and decoder): a checkpoint may hold it
    under one name only (one process) or under both (pipeline stages)."""
    return {n: [m for m in names if m != n] for names in tied_names(model) for n in names}
