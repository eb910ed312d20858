"""The compute-instruction graph of one training step of any merak schedule.

Nodes are the compute instructions of every stage (forward, recompute, backward, and the
split backwards), in each stage's execution order. Edges say what must finish before what:

- a stage runs its instructions one after another, in its list's order;
- a receive hands over what the peer's matching send carried: the compute instructions after
  the receive wait for the last compute instruction the peer ran before posting the send.

Communication takes no time here (its cost is the power drawn while blocked, which the
planner charges separately), which is the Perseus model. Because edges come from the
instruction lists themselves, every schedule (interleaved, zero-bubble, the recomputing
Merak schedules) gets its exact graph.
"""

from __future__ import annotations

from dataclasses import dataclass

from merak.pipeline import instructions as ins
from merak.pipeline.schedules import build_schedule

COMPUTE_TYPES = (*ins.FORWARD_TYPES, ins.RecomputeForward, ins.Backward, ins.BackwardInput, ins.BackwardWeight)


@dataclass(frozen=True)
class Node:
    """A compute instruction: its stage, position among the stage's compute instructions, and name
    (:func:`merak.pipeline.instructions.plan_name`: ``forward``, ``backward@1``, ...)."""

    stage: int
    index: int
    name: str
    instruction: ins.Instruction


@dataclass
class StepGraph:
    """Nodes in a topological order, with edges as ``(before, after)`` node indices."""

    nodes: list[Node]
    edges: list[tuple[int, int]]
    num_stages: int

    def stage_names(self, stage: int) -> list[str]:
        """The instruction names stage ``stage`` runs, in order (what its frequency plan lists)."""
        return [n.name for n in self.nodes if n.stage == stage]


def _ops(instruction):
    if isinstance(instruction, ins.Exchange):
        return instruction.ops
    return (instruction,) if isinstance(instruction, ins.P2P_TYPES) else ()


def _channel(stage: int, op, num_stages: int) -> tuple[str, int, int]:
    """(kind, boundary, microbatch): the same triple for a send and its matching receive."""
    virtual = ins.virtual_stage(stage, op.chunk, num_stages)
    if isinstance(op, ins.SendActivation):
        return "activation", virtual, op.microbatch
    if isinstance(op, ins.RecvActivation):
        return "activation", virtual - 1, op.microbatch
    if isinstance(op, ins.SendGrad):
        return "grad", virtual - 1, op.microbatch
    return "grad", virtual, op.microbatch


def step_graph(schedule: str, num_stages: int, num_microbatches: int, num_chunks: int = 1) -> StepGraph:
    """The graph of one step of ``schedule`` (a name from merak.pipeline.schedules).

    Raises:
        ValueError: unknown schedule or numbers out of range (as build_schedule).
    """
    lists = [build_schedule(name=schedule, stage_id=s, num_stages=num_stages, num_microbatches=num_microbatches,
                            num_chunks=num_chunks) for s in range(num_stages)]
    ids: dict[tuple[int, int], int] = {}
    nodes: list[Node] = []
    sent_after: dict[tuple, int] = {}  # channel -> node that finished before the send was posted
    waits: list[tuple[int, tuple]] = []  # (first compute node after a receive, channel)
    for stage, program in enumerate(lists):
        last, pending = None, []
        for instruction in program:
            if isinstance(instruction, COMPUTE_TYPES):
                node = len(nodes)
                ids[(stage, node)] = node
                nodes.append(Node(stage, sum(n.stage == stage for n in nodes), ins.plan_name(instruction), instruction))
                waits += [(node, channel) for channel in pending]
                pending, last = [], node
                continue
            for op in _ops(instruction):
                channel = _channel(stage, op, num_stages)
                if isinstance(op, (ins.SendActivation, ins.SendGrad)):
                    if last is None:
                        raise ValueError(f"stage {stage} of {schedule} sends {op!r} before computing anything")
                    sent_after[channel] = last
                else:
                    pending.append(channel)
    edges = []
    for stage in range(num_stages):
        chain = [i for i, n in enumerate(nodes) if n.stage == stage]
        edges += list(zip(chain, chain[1:]))
    for node, channel in waits:
        if channel not in sent_after:
            raise ValueError(f"{schedule}: a receive of {channel} has no matching send")
        edges.append((sent_after[channel], node))
    return StepGraph(nodes=nodes, edges=sorted(set(edges)), num_stages=num_stages)


def topological_order(graph: StepGraph) -> list[int]:
    """Node indices so that every edge goes forward (Kahn's algorithm).

    Raises:
        ValueError: the schedule deadlocks (the graph has a cycle).
    """
    successors: list[list[int]] = [[] for _ in graph.nodes]
    indegree = [0] * len(graph.nodes)
    for before, after in graph.edges:
        successors[before].append(after)
        indegree[after] += 1
    ready = [i for i, d in enumerate(indegree) if d == 0]
    order = []
    while ready:
        node = ready.pop()
        order.append(node)
        for nxt in successors[node]:
            indegree[nxt] -= 1
            if indegree[nxt] == 0:
                ready.append(nxt)
    if len(order) != len(graph.nodes):
        raise ValueError("the schedule's instruction graph has a cycle (it would deadlock)")
    return order
