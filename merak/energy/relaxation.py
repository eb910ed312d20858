"""The frequency planner's linear relaxation, solved with HiGHS and re-solved warm per deadline.

Each instruction's cost ``c = e - p2p_power * t`` is replaced by the lower convex hull of its
options, so its duration is its fastest hull time plus how far it goes into each hull segment
(a variable bounded by the segment's length, charged the segment's slope). Node start times,
the segment fills and the step time ``T`` (charged ``S * p2p_power`` per second, at most the
deadline) are the variables; every edge and every last node gives one row
``start + duration - next start <= 0``. Successive deadlines only move ``T``'s upper bound, so
HiGHS starts each solve from the previous optimal basis: a frontier of 60 deadlines costs
little more than one cold solve.
"""

from __future__ import annotations

from collections.abc import Sequence

import highspy
import numpy as np
from scipy.sparse import coo_matrix

from merak.energy.dag import StepGraph


class RelaxedProgram:
    """The relaxation of one step graph with one set of hulls.

    Args:
        graph: the step's instruction graph.
        times: per node, the times of its options, fastest first.
        costs: per node, the costs of its options.
        hulls: per node, the indices of its options on the lower convex hull, fastest first.
        step_power: watts charged per second of step time (``S * p2p_power``).
    """

    def __init__(self, graph: StepGraph, times: Sequence[np.ndarray], costs: Sequence[np.ndarray],
                 hulls: Sequence[list[int]], step_power: float) -> None:
        n = len(graph.nodes)
        self.num_nodes = n
        segment_node, lengths, slopes = [], [], []
        for node, (t, c, hull) in enumerate(zip(times, costs, hulls)):
            for a, b in zip(hull, hull[1:]):
                segment_node.append(node)
                lengths.append(t[b] - t[a])
                slopes.append((c[b] - c[a]) / (t[b] - t[a]))
        self.segment_node = np.array(segment_node, dtype=np.int64)
        self.base = np.array([t[hull[0]] for t, hull in zip(times, hulls)], dtype=float)
        segments_of: list[list[int]] = [[] for _ in range(n)]
        for k, node in enumerate(segment_node):
            segments_of[node].append(n + k)
        self.step_column = n + len(segment_node)
        rows, cols, vals, upper = [], [], [], []

        def finish_before(node: int, column: int) -> None:
            """start(node) + its segments - column <= -base(node): ``node`` ends before ``column`` starts."""
            row = len(upper)
            for var in (node, *segments_of[node]):
                rows.append(row)
                cols.append(var)
                vals.append(1.0)
            rows.append(row)
            cols.append(column)
            vals.append(-1.0)
            upper.append(-self.base[node])

        successors = [0] * n
        for before, after in graph.edges:
            finish_before(before, after)
            successors[before] += 1
        for node in range(n):
            if not successors[node]:  # a last instruction finishes within the step
                finish_before(node, self.step_column)
        matrix = coo_matrix((vals, (rows, cols)), shape=(len(upper), self.step_column + 1)).tocsc()
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = self.step_column + 1, len(upper)
        lp.col_cost_ = np.concatenate([np.zeros(n), np.array(slopes, dtype=float), [step_power]])
        lp.col_lower_ = np.zeros(self.step_column + 1)
        lp.col_upper_ = np.concatenate([np.full(n, highspy.kHighsInf), np.array(lengths, dtype=float), [0.0]])
        lp.row_lower_ = np.full(len(upper), -highspy.kHighsInf)
        lp.row_upper_ = np.array(upper, dtype=float)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = matrix.indptr
        lp.a_matrix_.index_ = matrix.indices
        lp.a_matrix_.value_ = matrix.data
        self._highs = highspy.Highs()
        self._highs.setOptionValue("output_flag", False)
        self._highs.passModel(lp)

    def solve(self, deadline: float) -> tuple[np.ndarray, float]:
        """Every node's duration at the relaxation's optimum, and its step time (at most ``deadline``).

        Raises:
            RuntimeError: HiGHS found no optimum (the deadline is shorter than the fastest step).
        """
        self._highs.changeColBounds(self.step_column, 0.0, float(deadline))
        self._highs.run()
        status = self._highs.getModelStatus()
        if status != highspy.HighsModelStatus.kOptimal:
            raise RuntimeError(f"the frequency LP has no optimum at deadline {deadline:.6f} s: "
                               f"{self._highs.modelStatusToString(status)}")
        values = np.asarray(self._highs.getSolution().col_value)
        durations = self.base.copy()
        np.add.at(durations, self.segment_node, values[self.num_nodes:self.step_column])
        return durations, float(values[self.step_column])
