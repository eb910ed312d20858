"""Capture a deep stack of identical blocks by exporting three of them and repeating the third.

``torch.export`` spends most of its time dispatching each operation of each
block: a 96-block GPT-3 takes ~15 s on one CPU core, most of a giant model's
planning time. The blocks of a transformer stack are the same module class with
the same parameter shapes, and their graphs differ only in which parameters they
read. So the model is exported with its stack cut to three blocks, the graph of
block 2 is checked to be block 1's with every reference shifted by one block
(its own values, the previous block's values, its own parameters, and the same
values from outside the stack), and then copied for blocks 3 .. N-1, each
reading its own parameters. What follows the stack reads the last block's values
instead of block 2's.

Anything else — a node between blocks, a block reading two blocks back, a
constant that differs between blocks 1 and 2 (a per-layer scale), an output
that collects every block's values — and the repeat is not attempted: the whole
model is exported as usual.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from torch import fx, nn

logger = logging.getLogger(__name__)

EXPORTED_BLOCKS = 3  # block 0 (reads the stack's input), block 1 (the pattern) and block 2 (its check)
MIN_BLOCKS = 8  # shorter stacks export quickly enough as they are


class NotRepeatable(Exception):
    """The exported stack does not repeat exactly; export the whole model instead."""


def repeated_stack(model: nn.Module, min_blocks: int | None = None) -> tuple[str, nn.ModuleList] | None:
    """The model's largest ModuleList of identical blocks (same class, same parameter names and shapes),
    by parameter count, if it has at least ``min_blocks`` blocks."""
    min_blocks = MIN_BLOCKS if min_blocks is None else min_blocks
    best = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < min_blocks or not name:
            continue
        signatures = {(type(block), tuple((n, tuple(p.shape)) for n, p in block.named_parameters()))
                      for block in module}
        if len(signatures) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if best is None or size > best[0]:
            best = (size, name, module)
    return None if best is None else (best[1], best[2])


@contextlib.contextmanager
def _shortened(model: nn.Module, name: str, keep: int):
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    full = getattr(parent, child)
    setattr(parent, child, nn.ModuleList(list(full)[:keep]))
    try:
        yield
    finally:
        setattr(parent, child, full)


def _block_of(node: fx.Node, stack: str) -> int | None:
    """Which block of ``stack`` made ``node`` (from its module stack), or None."""
    prefix = stack + "."
    for value in (node.meta.get("nn_module_stack") or {}).values():
        path = value[0] if isinstance(value, tuple) else str(value)
        if path.startswith(prefix):
            index = path[len(prefix):].split(".", 1)[0]
            if index.isdigit():
                return int(index)
    return None


def _rename(text: str, stack: str, old: int, new: int) -> str:
    """``stack.old`` -> ``stack.new`` in a qualified name (whole path components only)."""
    before = f"{stack}.{old}"
    if text == before:
        return f"{stack}.{new}"
    if text.startswith(before + "."):
        return f"{stack}.{new}." + text[len(before) + 1:]
    return text


def _renamed_meta(meta: dict, stack: str, old: int, new: int) -> dict:
    meta = dict(meta)
    modules = meta.get("nn_module_stack")
    if modules:
        key_old, key_new = f"{stack}.{old}", f"{stack}.{new}"
        meta["nn_module_stack"] = {
            key.replace(key_old, key_new) if key.endswith(key_old) or (key_old + ".") in key else key:
                ((_rename(value[0], stack, old, new), *value[1:]) if isinstance(value, tuple) else value)
            for key, value in modules.items()}
    return meta


class _Blocks:
    """The exported graph's nodes by block, with the checks that make repeating block 2 exact."""

    def __init__(self, graph: fx.Graph, stack: str) -> None:
        self.stack = stack
        self.nodes: list[list[fx.Node]] = [[] for _ in range(EXPORTED_BLOCKS)]
        order = []
        for node in graph.nodes:
            block = _block_of(node, stack) if node.op == "call_function" else None
            if block is not None:
                if block >= EXPORTED_BLOCKS:
                    raise NotRepeatable(f"node {node.name} claims block {block}")
                self.nodes[block].append(node)
                order.append(block)
        if order != sorted(order) or any(not nodes for nodes in self.nodes):
            raise NotRepeatable("the blocks' nodes are not in block order")
        self.index = {node: (b, j) for b, nodes in enumerate(self.nodes) for j, node in enumerate(nodes)}
        first, last = self.nodes[0][0], self.nodes[-1][-1]
        inside = False
        for node in graph.nodes:  # nothing may sit between the blocks
            inside = inside or node is first
            if inside and node not in self.index:
                raise NotRepeatable(f"node {node.name} sits between the blocks")
            if node is last:
                break
        self.first, self.last = first, last

    def _token(self, arg, block: int):
        """What ``arg`` is, as seen from ``block``: comparable between blocks 1 and 2."""
        if not isinstance(arg, fx.Node):
            return ("literal", repr(arg))
        if arg.op == "get_attr":
            target = str(arg.target)
            renamed = _rename(target, self.stack, block, -1)
            return ("attribute", renamed if renamed != target else target)
        if arg in self.index:
            owner, position = self.index[arg]
            if owner == block:
                return ("own", position)
            if owner == block - 1:
                return ("previous", position)
            return ("block", owner, position)
        return ("outside", arg)

    def _signature(self, node: fx.Node, block: int):
        tokens = []
        fx.node.map_aggregate((node.args, node.kwargs), lambda a: tokens.append(self._token(a, block)))
        return node.op, node.target, tokens

    def check(self) -> None:
        one, two = self.nodes[1], self.nodes[2]
        if len(one) != len(two) or len(self.nodes[0]) != len(one):
            raise NotRepeatable(f"the blocks have {[len(n) for n in self.nodes]} nodes")
        for a, b in zip(one, two):
            if self._signature(a, 1) != self._signature(b, 2):
                raise NotRepeatable(f"block 2's {b.name} differs from block 1's {a.name}")
        for node in two:
            for arg in node.all_input_nodes:
                if self._token(arg, 2)[0] == "block":
                    raise NotRepeatable(f"{node.name} reads a block two back")
        for b in range(EXPORTED_BLOCKS - 1):  # after the stack only the last block's values may be read
            for node in self.nodes[b]:
                if any(user not in self.index for user in node.users):
                    raise NotRepeatable(f"{node.name} of block {b} is read after the stack")


def repeat_blocks(graph_module: fx.GraphModule, stack: str, blocks: nn.ModuleList) -> None:
    """Extend an export of the first three blocks of ``stack`` to all ``len(blocks)`` blocks, in place.

    Raises:
        NotRepeatable: the exported blocks do not repeat exactly.
    """
    graph = graph_module.graph
    found = _Blocks(graph, stack)
    found.check()
    template = found.nodes[-1]
    last_template = EXPORTED_BLOCKS - 1
    outside_users = {node: [u for u in node.users if u not in found.index] for node in template}
    attributes: dict[str, fx.Node] = {}
    holder = graph_module.get_submodule(stack)
    previous, anchor = template, found.last  # each new node goes after the one made before it
    for block in range(EXPORTED_BLOCKS, len(blocks)):
        holder.add_module(str(block), blocks[block])
        copies: list[fx.Node] = []

        def mapped(arg: fx.Node, block=block, copies=copies, previous=previous) -> fx.Node:
            if arg.op == "get_attr":
                target = _rename(str(arg.target), stack, last_template, block)
                if target == str(arg.target):
                    return arg
                if target not in attributes:
                    with graph.inserting_before(found.first):
                        attributes[target] = graph.get_attr(target)
                    attributes[target].meta = dict(arg.meta)
                return attributes[target]
            if arg in found.index:
                owner, position = found.index[arg]
                return copies[position] if owner == last_template else previous[position]
            return arg

        for node in template:
            with graph.inserting_after(anchor):
                copy = graph.node_copy(node, mapped)
            copy.meta = _renamed_meta(node.meta, stack, last_template, block)
            copies.append(copy)
            anchor = copy
        previous = copies
    for position, node in enumerate(template):
        for user in outside_users[node]:
            user.replace_input_with(node, previous[position])
    graph.lint()
    graph_module.recompile()


def capture_with_repeats(model: nn.Module, export: Callable[[nn.Module], tuple[fx.GraphModule, object]],
                         min_blocks: int | None = None) -> tuple[fx.GraphModule, object, str] | None:
    """Export ``model`` with its largest stack of identical blocks cut to three, then repeat the last.

    ``export`` exports a model and returns (graph module, output spec). Returns them with a note, or
    None when the model has no long stack or its blocks do not repeat exactly (export it whole).
    """
    found = repeated_stack(model, MIN_BLOCKS if min_blocks is None else min_blocks)
    if found is None:
        return None
    name, blocks = found
    with _shortened(model, name, EXPORTED_BLOCKS):
        module, spec = export(model)
    try:
        repeat_blocks(module, name, blocks)
    except NotRepeatable as reason:
        logger.info("exporting %s whole: %s", type(model).__name__, reason)
        return None
    return module, spec, f"exported 3 of the {len(blocks)} blocks of {name} and repeated the last"
