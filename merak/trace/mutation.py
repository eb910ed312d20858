"""In-place writes in captured graphs.

A later pipeline stage receives its inputs as fresh leaf tensors that require
grad, and autograd refuses an in-place operation on such a leaf (or on a view
of one). A stage boundary placed right before ``relu(inplace=True)`` after a
residual add (every ResNet block ends this way) would fail at the first step.
``copy_inputs_written_in_place`` gives such a stage its own copy of the input to
write, so any cut position is runnable; everything downstream, values passed on
to later stages included, reads the copy, so the written values are the ones
the whole model sees.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

IN_PLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
                      operator.ilshift, operator.irshift, operator.imatmul, operator.setitem}
IN_PLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                    "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__"}

# Calls whose result may share storage with their first argument.
VIEW_METHODS = {"view", "view_as", "reshape", "reshape_as", "transpose", "permute", "unsqueeze", "squeeze",
                "expand", "expand_as", "flatten", "unflatten", "narrow", "select", "t", "chunk", "split",
                "unbind", "__getitem__", "detach", "contiguous", "movedim", "as_strided", "diagonal", "unfold",
                "swapaxes", "split_with_sizes", "tensor_split", "type_as", "to", "float", "view_as_real"}
VIEW_FUNCTIONS = {operator.getitem, getattr, torch.reshape, torch.flatten, torch.transpose, torch.permute,
                  torch.squeeze, torch.unsqueeze, torch.chunk, torch.split, torch.narrow, torch.select, torch.t,
                  torch.unbind, torch.movedim, torch.diagonal, torch.swapaxes, torch.tensor_split, torch.unflatten}


def _is_written(schema_argument) -> bool:
    return schema_argument.alias_info is not None and schema_argument.alias_info.is_write


def written_arguments(node: fx.Node) -> list[fx.Node]:
    """The values ``node`` writes in place (empty for a functional call)."""
    args = node.args
    if node.op == "call_function":
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            written = []
            for position, argument in enumerate(target._schema.arguments):
                if _is_written(argument):
                    value = args[position] if position < len(args) else node.kwargs.get(argument.name)
                    values = value if isinstance(value, (list, tuple)) else [value]
                    written.extend(v for v in values if isinstance(v, fx.Node))
            return written
        if target in IN_PLACE_OPERATORS or node.kwargs.get("inplace") is True:
            first = args[0] if args else node.kwargs.get("input")
            return [first] if isinstance(first, fx.Node) else []
        return []
    if node.op == "call_method":
        name = str(node.target)
        if name in IN_PLACE_DUNDERS or (name.endswith("_") and not name.startswith("__")):
            return [args[0]] if args and isinstance(args[0], fx.Node) else []
        return []
    if node.op == "call_module":
        owner = node.graph.owning_module
        module = owner.get_submodule(str(node.target)) if owner is not None else None
        if module is not None and getattr(module, "inplace", False) is True:
            first = args[0] if args else None
            return [first] if isinstance(first, fx.Node) else []
    return []


def writes_in_place(node: fx.Node) -> bool:
    """Whether ``node`` writes any of its inputs in place (modules built with ``inplace=True`` included)."""
    return bool(written_arguments(node))


def _may_be_view_of(user: fx.Node, value: fx.Node) -> bool:
    if not user.args or user.args[0] is not value:
        return False
    if user.op == "call_method":
        return str(user.target) in VIEW_METHODS
    if user.op == "call_function":
        target = user.target
        if isinstance(target, torch._ops.OpOverload):
            return any(r.alias_info is not None for r in target._schema.returns) and not target._schema.is_mutable
        return target in VIEW_FUNCTIONS
    return False


def is_written_in_place(value: fx.Node) -> bool:
    """Whether ``value``, or a view that may share its storage, is written in place by its graph."""
    pending, seen = [value], set()
    while pending:
        node = pending.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            if node in written_arguments(user):
                return True
            if _may_be_view_of(user, node):
                pending.append(user)
    return False


def copy_inputs_written_in_place(module: fx.GraphModule, inputs: list[fx.Node]) -> int:
    """Read a copy (``clone``) of each of ``inputs`` the graph writes in place. Returns how many."""
    graph = module.graph
    copied = 0
    for value in inputs:
        if not is_written_in_place(value):
            continue
        with graph.inserting_after(value):
            copy = graph.call_method("clone", (value,))
        copy.meta = dict(value.meta)
        value.replace_all_uses_with(copy, delete_user_cb=lambda user, copy=copy: user is not copy)
        copied += 1
    if copied:
        module.recompile()
    return copied


__all__ = ["copy_inputs_written_in_place", "is_written_in_place", "written_arguments", "writes_in_place"]
