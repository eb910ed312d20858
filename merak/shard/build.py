"""Turn cut positions into runnable shards.

Each shard is a ``torch.fx.GraphModule`` with one argument, the incoming
payload (a dict: model inputs by name for the first shard, crossing values by
node name after that), and returns the dict of values crossing its end; the
last shard returns the model's output. Values a later shard needs are passed
through every shard in between. Parameters are shared with the captured module
(never copied), so tied weights stay one object. No shard holds the device it
was captured on (merak.trace.devices), and each is made lean for the host
(merak.trace.simplify). Values computed from constants alone (masks, position
ids) are computed again in each shard that reads them instead of being sent. A
received value the shard writes in place is copied first (merak.trace.mutation).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence

from torch import fx, nn

from merak.shard.graph import GraphUnits
from merak.trace.capture import RebuildOutput
from merak.trace.devices import attach_anchor, follow_stage_device, new_anchor
from merak.trace.mutation import copy_inputs_written_in_place
from merak.trace.simplify import simplify_shard


def _lookup(env: dict[fx.Node, fx.Node], graph: fx.Graph, index: int, recomputable: set[fx.Node],
            node: fx.Node) -> fx.Node:
    """The shard's copy of ``node``: attributes are copied into every shard that reads them, and
    recomputable values (``GraphUnits.recomputable``) are computed again there instead of received."""
    if node not in env:
        if node.op == "get_attr":
            env[node] = graph.node_copy(node)
        elif node in recomputable:
            env[node] = graph.node_copy(node, functools.partial(_lookup, env, graph, index, recomputable))
        else:
            raise AssertionError(f"value {node.name} is not available in shard {index}")
    return env[node]


def _key(node: fx.Node, input_names: dict[fx.Node, str]) -> str:
    return input_names.get(node, node.name)


def build_shards(units: GraphUnits, cuts: Sequence[int]) -> list[fx.GraphModule]:
    """One GraphModule per shard for the given cut positions."""
    captured = units.captured
    input_names = dict(zip(units.placeholders, captured.input_names))
    bounds = [0, *cuts, len(units)]
    # One device anchor for all shards, also held by the captured module so that helpers which
    # swap its buffers (measuring a meta-built model) move the anchor with them.
    anchor = attach_anchor(captured.module, new_anchor())
    shards = []
    for index in range(len(bounds) - 1):
        start, stop = bounds[index], bounds[index + 1]
        graph = fx.Graph()
        payload = graph.placeholder("payload")
        env: dict[fx.Node, fx.Node] = {}
        incoming = units.placeholders if index == 0 else units.crossing_values(start)
        for value in incoming:
            if index == 0 and not value.users:
                continue
            env[value] = graph.call_function(operator.getitem, (payload, _key(value, input_names)))
            env[value].meta = dict(value.meta)

        lookup = functools.partial(_lookup, env, graph, index, units.recomputable)
        for unit in units.units[start:stop]:
            for node in unit.nodes:
                env[node] = graph.node_copy(node, lookup)
        if stop == len(units):
            graph.output(fx.map_arg(units.output_node.args[0], lookup))
        else:
            graph.output({_key(v, input_names): env[v] for v in units.crossing_values(stop)})
        shard = fx.GraphModule(captured.module, graph, f"Shard{index}")
        if index > 0:  # received values are leaves that require grad: an in-place write needs a copy
            copy_inputs_written_in_place(shard, [env[value] for value in incoming])
        follow_stage_device(shard, anchor)
        simplify_shard(shard)
        shards.append(shard)
    return shards


def shard_modules(units: GraphUnits, cuts: Sequence[int]) -> list[nn.Module]:
    """The shards as a module list; an export capture's last shard also rebuilds the output structure."""
    shards: list[nn.Module] = list(build_shards(units, cuts))
    spec = units.captured.output_spec
    if spec is not None:
        shards[-1] = nn.Sequential(shards[-1], RebuildOutput(spec))
    return shards
