"""Leaner graphs: less Python per forward, the same numbers.

A captured graph runs as generated Python; each node costs host time however
small its kernel. These rewrites take out work that eager PyTorch does not do:

- *Flat attribute paths.* ``torch.export`` reads a parameter as
  ``getattr(self.vit.layers, "0").attention.q_proj.weight``: six
  ``Module.__getattr__`` calls per parameter per forward. Each module the
  graph reads from is registered once on the graph module under a flat name,
  so a read is ``self.vit_layers_0_attention_q_proj.weight``. The modules are
  the same objects: parameters stay shared with the model.
- *No-op dropout.* ``dropout(x, p=0.0)`` (models configured without dropout)
  is ``x``; the node is removed.
- *Folded constants.* Export traces the attention masks and position ids
  Hugging Face models build from shapes alone (``arange``, comparisons,
  ``expand``): dozens of operations per forward whose result never changes.
  Integer and boolean results that depend on no input and no parameter are
  computed once and kept as non-persistent buffers (so they move with the
  stage); floating-point ones are left alone, because casting the model to
  fp16/bf16 would cast a buffer but not what the graph computes.
- *Dead code.* Pure values nothing reads are not computed.
"""

from __future__ import annotations

import operator

import torch
from torch import fx, nn

from merak.trace.mutation import writes_in_place

# Dropout as fx (functions) and export (aten operators) record it; the probability is the second argument.
DROPOUT_CALLS = {torch.ops.aten.dropout.default, torch.ops.aten.feature_dropout.default,
                 torch.ops.aten.alpha_dropout.default, torch.ops.aten.feature_alpha_dropout.default,
                 nn.functional.dropout, nn.functional.dropout1d, nn.functional.dropout2d, nn.functional.dropout3d,
                 nn.functional.alpha_dropout, nn.functional.feature_alpha_dropout, torch.dropout}


def _flat_name(module: fx.GraphModule, path: str, taken: dict[str, str]) -> str:
    if path in taken:
        return taken[path]
    base = path.replace(".", "_")
    name, count = base, 0
    while hasattr(module, name):
        count += 1
        name = f"{base}_{count}"
    taken[path] = name
    return name


def flatten_attribute_paths(module: fx.GraphModule) -> int:
    """Point every nested ``get_attr`` / ``call_module`` target at a flat alias of its module.

    Returns:
        How many nodes were rewritten.
    """
    taken: dict[str, str] = {}
    changed = 0
    for node in module.graph.nodes:
        if node.op not in ("get_attr", "call_module") or "." not in str(node.target):
            continue
        target = str(node.target)
        owner_path, attribute = target.rsplit(".", 1) if node.op == "get_attr" else (target, None)
        if "." not in owner_path:  # a direct child: already one lookup
            continue
        owner = module.get_submodule(owner_path)
        alias = _flat_name(module, owner_path, taken)
        if not hasattr(module, alias):
            module.add_submodule(alias, owner)
        node.target = f"{alias}.{attribute}" if attribute is not None else alias
        changed += 1
    if changed:
        module.delete_all_unused_submodules()
        module.recompile()
    return changed


def is_inactive_dropout(node: fx.Node) -> bool:
    """A dropout call whose probability is the constant 0: it returns its input."""
    if node.op != "call_function" or node.target not in DROPOUT_CALLS:
        return False
    p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
    return isinstance(p, (int, float)) and not isinstance(p, bool) and p == 0


def drop_inactive_dropout(module: fx.GraphModule) -> int:
    """Replace dropout nodes with probability 0 by their input. Returns how many were removed."""
    removed = 0
    for node in list(module.graph.nodes):
        if is_inactive_dropout(node):
            node.replace_all_uses_with(node.args[0] if node.args else node.kwargs["input"])
            module.graph.erase_node(node)
            removed += 1
    if removed:
        module.recompile()
    return removed


CONSTANT_PREFIX = "_merak_constant_"
MAX_CONSTANT_BYTES = 256 * 2**20


def is_pure(node: fx.Node) -> bool:
    """A call whose only effect is its result: a functional aten operator that draws no random
    numbers, or getitem/getattr. Methods and modules (``bernoulli_`` on a tensor, say) never are."""
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return (torch.Tag.nondeterministic_seeded not in target.tags and not target._schema.is_mutable
                and not node.is_impure())
    return target in (operator.getitem, getattr)


def remove_dead_values(graph: fx.Graph) -> int:
    """Erase pure calls whose results nothing reads (fx's own dead-code pass would also erase
    in-place methods such as ``bernoulli_`` that fx traces record). Returns how many."""
    removed = 0
    for node in reversed(list(graph.nodes)):
        if not node.users and (is_pure(node) or node.op == "get_attr"):
            graph.erase_node(node)
            removed += 1
    return removed


def _is_foldable(node: fx.Node, constant: set[fx.Node]) -> bool:
    return (is_pure(node) and node.target is not getattr
            and all(arg in constant for arg in node.all_input_nodes))


def _on_cpu(value):
    return torch.device("cpu") if isinstance(value, torch.device) else value


def written_values(graph: fx.Graph) -> set[fx.Node]:
    """Values an in-place operation may write (T5's ``relative_buckets += ...``), with everything they
    may be views of: folding them into a buffer would make the write accumulate across forwards."""
    blocked: set[fx.Node] = set()
    pending = [arg for node in graph.nodes if writes_in_place(node) for arg in node.all_input_nodes]
    while pending:
        node = pending.pop()
        if node not in blocked:
            blocked.add(node)
            pending.extend(node.all_input_nodes)
    return blocked


def fold_constants(module: fx.GraphModule) -> int:
    """Compute once what depends on no input and no parameter; keep its integer and boolean results.

    Run on the whole captured graph, before it is cut: a folded value is then read (``get_attr``)
    by every shard that needs it instead of crossing stage boundaries. Values are computed on the
    CPU, whatever device the graph names (a model captured on meta included), and move with the
    stages that hold them.

    Returns:
        How many values were replaced by buffers.
    """
    graph = module.graph
    blocked = written_values(graph)
    constant: set[fx.Node] = set()
    for node in graph.nodes:
        if node not in blocked and _is_foldable(node, constant):
            constant.add(node)
    # In graph order, so every process names the buffers alike.
    frontier = [n for n in graph.nodes if n in constant and any(u not in constant for u in n.users)]
    values: dict[fx.Node, object] = {}
    with torch.no_grad():
        for node in graph.nodes:
            if node in constant:
                args = fx.node.map_aggregate(node.args, lambda v: values[v] if isinstance(v, fx.Node) else _on_cpu(v))
                kwargs = fx.node.map_aggregate(node.kwargs,
                                               lambda v: values[v] if isinstance(v, fx.Node) else _on_cpu(v))
                values[node] = node.target(*args, **kwargs)
    folded = 0
    for node in frontier:
        value = values[node]
        if not isinstance(value, torch.Tensor) or value.is_floating_point() or value.is_complex() \
                or value.numel() * value.element_size() > MAX_CONSTANT_BYTES:
            continue
        name = _free_name(module)
        module.register_buffer(name, value.contiguous().clone(), persistent=False)
        with graph.inserting_before(node):
            replacement = graph.get_attr(name)
        node.replace_all_uses_with(replacement)
        folded += 1
    if folded:
        remove_dead_values(graph)
        module.recompile()
    return folded


_SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _constant_of(module: fx.GraphModule, node) -> torch.Tensor | None:
    if isinstance(node, fx.Node) and node.op == "get_attr" and str(node.target).startswith(CONSTANT_PREFIX):
        return getattr(module, str(node.target))
    return None


def _is_causal_pattern(mask: torch.Tensor) -> bool:
    rows, columns = mask.shape[-2], mask.shape[-1]
    return rows == columns and bool((mask == torch.ones(rows, columns, dtype=torch.bool).tril()).all())


def use_fused_attention(module: fx.GraphModule) -> int:
    """Scaled-dot-product attention with a constant boolean mask: an all-true mask is dropped and a
    causal one becomes ``is_causal=True``, so the fused (flash) kernels can run and no ``[mbs, 1, S, S]``
    mask is read. The same numbers; returns how many attention calls changed."""
    changed = 0
    for node in module.graph.nodes:
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        mask_node = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
        mask = _constant_of(module, mask_node)
        if mask is None or mask.dtype != torch.bool or mask.device.type == "meta":
            continue
        if node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5 else False):
            continue
        if bool(mask.all()):
            causal = False
        elif _is_causal_pattern(mask):
            causal = True
        else:
            continue
        args = list(node.args[:3])
        kwargs = {k: v for k, v in node.kwargs.items() if k != "attn_mask"}
        for index, name in ((4, "dropout_p"), (5, "is_causal"), (6, "scale"), (7, "enable_gqa")):
            if len(node.args) > index:
                kwargs[name] = node.args[index]
        if causal:
            kwargs["is_causal"] = True
        node.args, node.kwargs = tuple(args), kwargs
        changed += 1
    if changed:
        remove_dead_values(module.graph)
        module.recompile()
    return changed


def simplify_captured(module: fx.GraphModule) -> None:
    """The rewrites of a whole captured graph, before it is cut into shards."""
    drop_inactive_dropout(module)
    fold_constants(module)
    use_fused_attention(module)


def simplify_shard(module: fx.GraphModule) -> None:
    """The rewrites of one shard: flat attribute paths, folded constants kept out of state dicts,
    no dead code."""
    for name in list(module._buffers):
        if name.startswith(CONSTANT_PREFIX):
            module._non_persistent_buffers_set.add(name)
    flatten_attribute_paths(module)
    if remove_dead_values(module.graph):
        module.recompile()


def _free_name(module: nn.Module) -> str:
    index = 0
    while hasattr(module, f"{CONSTANT_PREFIX}{index}"):
        index += 1
    return f"{CONSTANT_PREFIX}{index}"


__all__ = ["DROPOUT_CALLS", "drop_inactive_dropout", "is_inactive_dropout", "flatten_attribute_paths", "fold_constants",
           "is_pure", "remove_dead_values", "written_values",
           "simplify_captured",
           "simplify_shard", "use_fused_attention"]
