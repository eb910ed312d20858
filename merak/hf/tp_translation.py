"""Transformers' own tensor-parallel plans, translated into merak TPPlans.

A transformers model lists how its modules split in ``model.tp_plan``: its
class's ``_tp_plan`` merged with its config's ``base_model_tp_plan``, keys
prefixed by where each sub-model sits, values style names. The plan is read
from the model at run time and translated into a :class:`TPPlan`:

- ``colwise`` / ``rowwise`` (and their ``local_`` forms): column / row layers;
  ``packed_colwise`` on a linear layer: a column layer of 2 fused blocks (the
  stacked gate and up projections); ``colwise`` on a parameter: that tensor
  sliced (per-head attention sinks).
- ``colwise_gather_output``, ``colwise_rep``, ``rowwise_split_input``,
  ``rowwise_rep``, ``replicate``, ``local_params``: the layer's output is whole
  on every rank, so the layer stays whole (the same numbers, computed on every
  rank). On the output head, a gathered column layer becomes the vocabulary
  split used with ``parallel_vocab`` (logits split by vocabulary), with
  ``embedding_rowwise`` on the input embedding its partner.
- ``replicated_with_grad_allreduce``: the module stays whole and its
  gradients are summed over the tp group (``TPPlan.partial``).
- Every other style (experts, multi-head latent attention, sequence parallel,
  hidden-split embeddings...) raises :class:`TPPlanError` naming the style and
  the module.

Head counts: where a column layer's parent (the attention module) keeps an
integer head count (``num_heads``, ``num_key_value_heads``...), the plan divides
it by tp; the config is left alone (it is shared, and checkpoints save it).
Where the parent has ``head_dim``, resolving the plan checks that every rank
gets whole heads (``TPPlan.heads``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from torch import nn

from merak.core.names import module_pattern
from merak.tensor_parallel.layers import weight_in_out
from merak.tensor_parallel.plan import TPPlan, TPPlanError

logger = logging.getLogger(__name__)

# transformers style -> what merak does with the module (or parameter) it names.
_KINDS = {
    "colwise": "column", "local_colwise": "column", "rowwise": "row", "local_rowwise": "row",
    "packed_colwise": "packed",
    "colwise_gather_output": "gathered", "colwise_rep": "gathered",
    "rowwise_split_input": "whole", "rowwise_rep": "whole", "replicate": "whole",
    # Asks transformers to run the module on local tensors: merak's parameters always are.
    "local_params": "whole",
    "embedding_rowwise": "embedding",
    "replicated_with_grad_allreduce": "partial",
}
# Why some styles have no merak equivalent (the others: "no merak equivalent").
_UNSUPPORTED = {
    "moe_tp_experts": "mixture-of-experts weights split over ranks",
    "grouped_gemm": "mixture-of-experts weights split over ranks",
    "ep_router": "expert parallelism", "ep_dispatch_experts": "expert parallelism",
    "moe_identity_expert": "mixture-of-experts weights split over ranks",
    "packed_rowwise": "packed expert weights", "mla_kv_a_proj": "multi-head latent attention's shared projection",
    "all_reduce": "a module whose output is summed over ranks",
    "embedding_colwise": "an embedding split by hidden features",
    "sequence_parallel": "merak describes sequence parallelism as a region (TPPlan.sequence), not per module",
}
# Integer attributes of an attention module that count its heads, or their features (divided by tp).
HEAD_ATTRIBUTES = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_heads",
                   "n_kv_heads", "n_head", "all_head_size")


def transformers_rules(model: nn.Module) -> dict[str, str]:
    """The model's transformers tensor-parallel plan, keys relative to ``model`` (empty: none)."""
    rules = getattr(model, "tp_plan", None)
    if not isinstance(rules, Mapping):
        rules = getattr(model, "_tp_plan", None)
    return dict(rules) if isinstance(rules, Mapping) else {}


def _module_name(model: nn.Module, getter: str) -> str | None:
    get = getattr(model, getter, None)
    try:
        module = get() if callable(get) else None
    except NotImplementedError:  # transformers' models without that embedding
        return None
    return next((n for n, m in model.named_modules() if m is module), None) if module is not None else None


def _features(module: nn.Module) -> tuple[int, int] | None:
    """(output, input) features of a linear layer (None for anything else)."""
    try:
        in_out = weight_in_out(module)
    except TypeError:
        return None
    rows, cols = module.weight.shape
    return (cols, rows) if in_out else (rows, cols)


def _head_size(modules: dict[str, nn.Module], matched: list[str], split: int) -> int:
    """The attention heads' size when every matched layer's parent has the same ``head_dim`` and
    the split features (``split``: 0 output, 1 input) are whole heads; 0 otherwise."""
    sizes = {getattr(modules.get(n.rpartition(".")[0]), "head_dim", None) for n in matched}
    size = sizes.pop() if len(sizes) == 1 else None
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        return 0
    features = [_features(modules[n]) for n in matched]
    return size if all(f is not None and f[split] % size == 0 for f in features) else 0


def _head_attributes(modules: dict[str, nn.Module], pattern: str, matched: list[str]) -> dict[str, tuple]:
    """Head-count attributes of the matched layers' parents (the attention modules): the parents'
    glob -> names when every parent has the same ones, else parent name -> names."""
    found = {}
    for parent in dict.fromkeys(n.rpartition(".")[0] for n in matched if "." in n):
        owner = modules[parent]
        found[parent] = tuple(a for a in HEAD_ATTRIBUTES
                              if isinstance(getattr(owner, a, None), int) and not isinstance(getattr(owner, a), bool))
    same = set(found.values())
    if len(same) == 1 and "." in pattern:
        attrs = same.pop()
        return {pattern.rpartition(".")[0]: attrs} if attrs else {}
    return {parent: attrs for parent, attrs in found.items() if attrs}


def _block_globs(patterns) -> tuple[str, ...]:
    """``model.layers.*`` for ``model.layers.*.self_attn.q_proj``: the repeated blocks."""
    blocks = {}
    for pattern in patterns:
        parts = pattern.split(".")
        star = next((i for i, part in enumerate(parts) if "*" in part), None)
        if star is not None:
            blocks[".".join(parts[:star + 1])] = None
    return tuple(blocks)


def translate_plan(model: nn.Module, rules: Mapping[str, str]) -> TPPlan | None:
    """``rules`` (transformers' form: module or parameter glob -> style) as a TPPlan for ``model``.

    Rules that match nothing in this model are skipped: transformers' plans cover every
    variant of an architecture (layer types a given config does not build).

    Returns:
        The plan, or None when it splits nothing (every named layer stays whole).

    Raises:
        TPPlanError: naming every style merak cannot express and a module it names.
    """
    modules = dict(model.named_modules())
    names = list(modules)
    parameters = dict(model.named_parameters())
    head, embedding = _module_name(model, "get_output_embeddings"), _module_name(model, "get_input_embeddings")
    styles, fused, heads, attributes, sliced, partial = {}, {}, {}, {}, {}, []
    vocab_head = vocab_embedding = None
    problems = []
    for pattern, style in rules.items():
        regex = module_pattern(pattern)
        matched = [n for n in names if regex.fullmatch(n)]
        tensors = [] if matched else [p for p in parameters if regex.fullmatch(p)]
        if not matched and not tensors:
            logger.debug("transformers' rule %r (%s) matches nothing in %s", pattern, style, type(model).__name__)
            continue
        kind = _KINDS.get(style)
        if kind == "packed" and not all(isinstance(modules[n], nn.Linear) for n in matched):
            kind = None
        if tensors and kind not in ("column", "whole"):
            kind = None
        if kind is None:
            reason = _UNSUPPORTED.get(style, "no merak equivalent")
            if tensors and style not in _UNSUPPORTED:  # merak splits a bare parameter only as per-head slices
                reason = "a parameter (not a module) split this way has no merak equivalent"
            problems.append(f"{pattern!r} is {style!r} (e.g. {(matched or tensors)[0]}): {reason}")
        elif tensors:
            if kind == "column":  # a per-head tensor (attention sinks): this rank's heads
                sliced[pattern] = max(parameters[tensors[0]].dim() - 2, 0)
        elif kind in ("column", "row", "packed"):
            styles[pattern] = "row" if kind == "row" else "column"
            if kind == "packed":
                fused[pattern] = 2
            size = _head_size(modules, matched, 1 if kind == "row" else 0) if kind != "packed" else 0
            if size:
                heads[pattern] = size
            if kind == "column":
                attributes.update(_head_attributes(modules, pattern, matched))
        elif kind == "gathered" and matched == [head]:
            vocab_head = pattern
        elif kind == "embedding":
            if matched == [embedding]:
                vocab_embedding = pattern
            else:  # another embedding (an MLP's lookup table): rows split, lookups summed
                styles[pattern] = "vocab"
        elif kind == "partial":
            partial.append(pattern)
    if problems:
        raise TPPlanError(f"transformers' tensor-parallel plan of {type(model).__name__} uses styles merak cannot "
                          "express:\n  - " + "\n  - ".join(problems)
                          + "\npass a merak TPPlan for this model (or train it with tp=1)")
    if not styles and not sliced:
        logger.warning("transformers' tensor-parallel plan of %s splits no layer in merak (every layer it names "
                       "keeps its output whole on every rank)", type(model).__name__)
        return None
    return TPPlan(styles=styles, fused=fused, heads=heads, attributes=attributes, sliced=sliced,
                  partial=tuple(partial), vocab=_vocab(modules, head, embedding, vocab_head, vocab_embedding),
                  blocks=_block_globs(styles))


def _vocab(modules, head, embedding, vocab_head, vocab_embedding) -> dict[str, str]:
    """The vocabulary rules (parallel_vocab): only with the output head split by vocabulary, because
    merak's vocabulary-parallel loss reads split logits; the input embedding goes with it when
    transformers splits it too or when it shares the head's weight."""
    if vocab_head is None:
        return {}
    vocab = {vocab_head: "column"}
    tied = embedding is not None and getattr(modules[embedding], "weight", None) is getattr(modules[head], "weight", 0)
    if vocab_embedding is not None or tied:
        vocab[vocab_embedding or embedding] = "vocab"
    return vocab

