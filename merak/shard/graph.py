"""The captured graph seen as a sequence of units, the places a shard may start.

A unit is a run of consecutive compute nodes from the same innermost module
(a leaf module counts as innermost for everything inside it), so no cut falls
inside a ``Linear`` or a user leaf module. Placeholders, ``get_attr`` and the
output are not units: inputs are values available before unit 0, attributes
are copied into every shard that reads them, the output belongs to the last
shard.

For a cut before unit ``k`` the *crossing values* are those made before ``k``
and read at or after ``k``; they are what a shard boundary carries (skip
connections included, relayed through the shards in between). Values that
depend on no input and no parameter and draw no random numbers (attention
masks and position ids made from shapes) never cross: every shard that reads
one computes it again (``recomputable``), which costs a few cheap operations
instead of a send.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass

from torch import fx, nn

from merak.trace.capture import CapturedGraph
from merak.trace.simplify import is_pure, written_values

_NOT_COMPUTE = ("placeholder", "get_attr", "output")


@dataclass
class Unit:
    """Consecutive compute nodes that stay together."""

    nodes: list[fx.Node]
    scope: tuple[str, ...]  # module path, outermost first ("" entries removed)


def _scope_of(node: fx.Node, leaf_scopes: set[str]) -> tuple[str, ...]:
    stack = node.meta.get("nn_module_stack") or {}
    path: list[str] = []
    for value in stack.values():
        name = value[0] if isinstance(value, tuple) else str(value)
        if not name:
            continue
        path.append(name)
        if name in leaf_scopes:
            break  # everything inside a leaf module belongs to the leaf
    if node.op == "call_module" and (not path or path[-1] != node.target):
        path.append(str(node.target))
    return tuple(path)


def _params_of_node(node: fx.Node, root: nn.Module) -> Iterable[nn.Parameter]:
    if node.op == "call_module":
        yield from root.get_submodule(str(node.target)).parameters()
    for arg in node.all_input_nodes:
        if arg.op == "get_attr":
            value = operator.attrgetter(str(arg.target))(root)
            if isinstance(value, nn.Parameter):
                yield value


class GraphUnits:
    """Units of a captured graph with parameter counts and boundary analysis."""

    def __init__(self, captured: CapturedGraph) -> None:
        self.captured = captured
        graph = captured.module.graph
        self.placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        self.output_node = next(n for n in graph.nodes if n.op == "output")
        self.units = self._group([n for n in graph.nodes if n.op not in _NOT_COMPUTE], captured.leaf_scopes)
        self.unit_of = {node: index for index, unit in enumerate(self.units) for node in unit.nodes}
        self.unit_params = self._first_use_params()
        self.recomputable = _recomputable(captured.module)
        self._last_use = self._last_uses()

    def __len__(self) -> int:
        return len(self.units)

    @staticmethod
    def _group(nodes: list[fx.Node], leaf_scopes: set[str]) -> list[Unit]:
        units: list[Unit] = []
        for node in nodes:
            scope = _scope_of(node, leaf_scopes)
            if units and units[-1].scope == scope:
                units[-1].nodes.append(node)
            else:
                units.append(Unit([node], scope))
        return _merge_split_leaves(units, leaf_scopes)

    def _first_use_params(self) -> list[int]:
        """Parameter elements per unit; a parameter read by several units counts at its first use."""
        seen: set[int] = set()
        counts = []
        for unit in self.units:
            total = 0
            for node in unit.nodes:
                for param in _params_of_node(node, self.captured.module):
                    if id(param) not in seen:
                        seen.add(id(param))
                        total += param.numel()
            counts.append(total)
        return counts

    def _last_uses(self) -> dict[fx.Node, int]:
        end = len(self.units)
        last: dict[fx.Node, int] = {}
        for node in self.placeholders + [n for u in self.units for n in u.nodes]:
            if node in self.recomputable:
                continue
            uses = [end if user.op == "output" else self.unit_of[user] for user in node.users]
            if uses:
                last[node] = max(uses)
        return last

    def defined_in(self, node: fx.Node) -> int:
        """Unit index that makes ``node`` (-1 for model inputs)."""
        return -1 if node.op == "placeholder" else self.unit_of[node]

    def crossing_counts(self) -> list[int]:
        """``counts[k]``: number of values crossing a cut before unit ``k`` (index 0 unused)."""
        delta = [0] * (len(self.units) + 2)
        for node, last in self._last_use.items():
            start = self.defined_in(node) + 1
            if last >= start:
                delta[max(start, 1)] += 1
                delta[last + 1] -= 1
        counts, running = [], 0
        for k in range(len(self.units) + 1):
            running += delta[k]
            counts.append(running)
        return counts

    def crossing_bytes(self, value_bytes: dict[fx.Node, int]) -> list[int]:
        """``bytes[k]``: bytes of the tensors crossing a cut before unit ``k`` (index 0 unused),
        from each value's measured size (``merak.shard.costs``)."""
        delta = [0] * (len(self.units) + 2)
        for node, last in self._last_use.items():
            start = self.defined_in(node) + 1
            if last >= start:
                size = value_bytes.get(node, 0)
                delta[max(start, 1)] += size
                delta[last + 1] -= size
        sizes, running = [], 0
        for k in range(len(self.units) + 1):
            running += delta[k]
            sizes.append(running)
        return sizes

    def crossing_values(self, cut: int) -> list[fx.Node]:
        """Values crossing a cut before unit ``cut``, in graph order."""
        return [node for node, last in self._last_use.items() if self.defined_in(node) < cut <= last]


def _recomputable(module: fx.GraphModule) -> set[fx.Node]:
    """Pure calls whose inputs are constants, buffers or other such calls: cheaper to compute again
    in each shard that reads them than to send (no placeholder, no parameter, no random numbers,
    nothing an in-place operation writes)."""
    graph = module.graph
    blocked = written_values(graph)
    parameters = {id(p) for p in module.parameters()}
    found: set[fx.Node] = set()
    for node in graph.nodes:
        if node in blocked:
            continue
        if node.op == "get_attr":
            if id(operator.attrgetter(str(node.target))(module)) not in parameters:
                found.add(node)
        elif is_pure(node) and all(arg in found for arg in node.all_input_nodes):
            found.add(node)
    return {node for node in found if node.op != "get_attr"}


def _merge_split_leaves(units: list[Unit], leaf_scopes: set[str]) -> list[Unit]:
    """A leaf module whose nodes are not contiguous (rare with export) becomes one unit span."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for index, unit in enumerate(units):
        for name in unit.scope:
            if name in leaf_scopes:
                first.setdefault(name, index)
                last[name] = index
    spans = sorted((first[n], last[n]) for n in first if last[n] > first[n])
    if not spans:
        return units
    merged: list[Unit] = []
    index = 0
    for start, stop in spans:
        start = max(start, index)  # a span overlapping one already merged starts after it
        merged.extend(units[index:start])
        if start <= stop:
            merged.append(Unit([n for u in units[start:stop + 1] for n in u.nodes], units[start].scope))
        index = max(index, stop + 1)
    merged.extend(units[index:])
    return merged
