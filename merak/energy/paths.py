"""Longest paths through a step graph, a whole level of nodes per numpy operation.

The frequency planner evaluates the same graph thousands of times with different durations.
Nodes are grouped by depth (the most edges on any path from a source), so every node of a
level depends only on earlier levels: one pass over the levels gives every node's earliest
finish, one pass back gives its latest start. A step of S stages and M microbatches has about
2 (S + M) levels, against 2 S M nodes.
"""

from __future__ import annotations

import numpy as np

from merak.energy.dag import StepGraph, topological_order


def _padded(neighbours: list[list[int]], missing: int) -> np.ndarray:
    """``neighbours`` as a rectangular index array, short rows filled with ``missing``."""
    width = max(1, max((len(row) for row in neighbours), default=1))
    table = np.full((len(neighbours), width), missing, dtype=np.int64)
    for node, row in enumerate(neighbours):
        table[node, :len(row)] = row
    return table


class LevelledGraph:
    """A step graph prepared for vectorized longest-path passes.

    Args:
        graph: the step's instruction graph.
    """

    def __init__(self, graph: StepGraph) -> None:
        n = len(graph.nodes)
        self.num_nodes = n
        predecessors: list[list[int]] = [[] for _ in range(n)]
        successors: list[list[int]] = [[] for _ in range(n)]
        for before, after in graph.edges:
            predecessors[after].append(before)
            successors[before].append(after)
        depth = np.zeros(n, dtype=np.int64)
        for node in topological_order(graph):
            depth[node] = max((depth[p] + 1 for p in predecessors[node]), default=0)
        self.levels = [np.nonzero(depth == d)[0] for d in range(int(depth.max()) + 1)] if n else []
        # Index n is a sentinel: it finishes at 0 going forward and starts at the deadline going back.
        before, after = _padded(predecessors, n), _padded(successors, n)
        self._before = [before[level] for level in self.levels]
        self._after = [after[level] for level in self.levels]
        # The same neighbours a column at a time: a few np.maximum calls cost less than a reduction
        # over a narrow 2-D gather, and the greedy evaluates paths thousands of times per deadline.
        self._before_columns = [tuple(np.ascontiguousarray(b[:, k]) for k in range(b.shape[1])) for b in self._before]

    def finish_times(self, durations) -> np.ndarray:
        """Every node's earliest finish (length ``num_nodes``)."""
        durations = np.asarray(durations, dtype=float)
        finish = np.zeros(self.num_nodes + 1)
        for level, columns in zip(self.levels, self._before_columns):
            start = finish[columns[0]]
            for column in columns[1:]:
                np.maximum(start, finish[column], out=start)
            finish[level] = start + durations[level]
        return finish[:-1]

    def step_time(self, durations) -> float:
        """The critical path: when the last node finishes."""
        return float(self.finish_times(durations).max()) if self.num_nodes else 0.0

    def floats(self, durations: np.ndarray, finish: np.ndarray, deadline: float) -> np.ndarray:
        """How much longer each node could take without any path exceeding ``deadline``, given its
        earliest ``finish`` times (from :meth:`finish_times`)."""
        latest_start = np.full(self.num_nodes + 1, float(deadline))
        for level, after in zip(reversed(self.levels), reversed(self._after)):
            latest_start[level] = latest_start[after].min(axis=1) - durations[level]
        return latest_start[:-1] - (finish - durations)
