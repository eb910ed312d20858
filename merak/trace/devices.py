"""Graphs that run wherever their stage is placed.

``torch.export`` writes the device it captured on into the graph: ``arange``,
``zeros``, ``to`` and ``_assert_tensor_metadata`` nodes carry ``device=cpu`` (or
``meta`` for a model built on the meta device). A stage moved to a GPU would
then mix devices. Here every such constant is replaced by the device of a
zero-element buffer, the *device anchor*, that each graph module holds: moving
the stage (``.to(device)``) moves the anchor, and the graph follows at run time
for the price of one attribute read per forward. Metadata assertions are
dropped (they only re-check what capture saw, and cost host time every call).
"""

from __future__ import annotations

import torch
from torch import fx, nn

ANCHOR = "_merak_device_anchor"

_METADATA_ASSERTIONS = {torch.ops.aten._assert_tensor_metadata.default}


def new_anchor() -> torch.Tensor:
    """A zero-element tensor whose only job is to say where its module lives.

    Integer-typed so that ``module.to(dtype)`` (half-precision runs) leaves it alone.
    """
    return torch.empty(0, dtype=torch.uint8)


def attach_anchor(module: nn.Module, anchor: torch.Tensor) -> torch.Tensor:
    """Register ``anchor`` on ``module`` as a non-persistent buffer (never in a state dict);
    returns the anchor ``module`` holds (its earlier one, if it had one)."""
    if module._buffers.get(ANCHOR) is None:
        module.register_buffer(ANCHOR, anchor, persistent=False)
    return module._buffers[ANCHOR]


def _is_device_constant(value, key: str | None = None) -> bool:
    if isinstance(value, torch.device):
        return True
    # fx keeps what the model wrote: ``x.to("cpu")`` or ``torch.zeros(..., device="cuda")``.
    if key == "device" and isinstance(value, str):
        try:
            torch.device(value)
        except RuntimeError:
            return False
        return True
    return False


def device_constants(graph: fx.Graph) -> list[fx.Node]:
    """Nodes whose arguments hold a literal device (what :func:`follow_stage_device` removes)."""
    found = []
    for node in graph.nodes:
        hits: list[object] = []
        fx.node.map_aggregate(node.args, lambda v, hits=hits: hits.append(v) if _is_device_constant(v) else v)
        for key, value in node.kwargs.items():
            fx.node.map_aggregate(value, lambda v, k=key, hits=hits: hits.append(v) if _is_device_constant(v, k) else v)
        if hits:
            found.append(node)
    return found


def follow_stage_device(module: fx.GraphModule, anchor: torch.Tensor | None = None) -> int:
    """Make ``module``'s graph read its device from an anchor buffer instead of constants.

    Args:
        module: a captured graph module (changed in place and recompiled).
        anchor: the anchor tensor to register (shared with the module the graph was cut from,
            so helpers that swap that module's buffers see it); a new one when None.

    Returns:
        How many nodes changed (device constants rewritten plus assertions removed).
    """
    graph = module.graph
    changed = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _METADATA_ASSERTIONS and not node.users:
            graph.erase_node(node)
            changed += 1
    targets = device_constants(graph)
    if targets:
        attach_anchor(module, anchor if anchor is not None else new_anchor())
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        after = placeholders[-1].next if placeholders else next(iter(graph.nodes))
        with graph.inserting_before(after):
            anchor_node = graph.get_attr(ANCHOR)
            device = graph.call_function(getattr, (anchor_node, "device"))
        for node in targets:
            node.args = fx.node.map_aggregate(node.args, lambda v: device if _is_device_constant(v) else v)
            node.kwargs = {key: fx.node.map_aggregate(value, lambda v, k=key: device if _is_device_constant(v, k)
                                                      else v)
                           for key, value in node.kwargs.items()}
        changed += len(targets)
    if changed:
        module.recompile()
    return changed


__all__ = ["ANCHOR", "attach_anchor", "device_constants", "follow_stage_device", "new_anchor"]
