"""Per-instruction GPU clocks that trade iteration time for energy (the Perseus problem).

Every compute instruction of a training step can run at any profiled clock. The GPU of each
stage draws ``p2p_power`` whenever it is not computing, so a step that takes ``T`` seconds
uses::

    E = sum_i e_i + p2p_power * (S * T - sum_i t_i) = sum_i (e_i - p2p_power * t_i) + S * p2p_power * T

For a deadline ``T`` the planner minimises ``sum_i c_i(t_i)`` with ``c = e - p2p_power * t``
subject to the step's critical path being at most ``T``. Its steps:

1. Per (stage, instruction), keep the options that are Pareto-optimal in (time, c).
2. Relax each instruction's cost to the lower convex hull of its options and solve the
   resulting linear program (start times, how far into each hull segment each duration goes,
   and the step time, charged ``S * p2p_power`` per second, at most ``T``) with HiGHS. This is
   the exact continuous optimum: a lower bound.
3. Round every duration down to the slowest option that fits in it (never lengthening a path),
   then, greedily, give the instruction whose next slower option saves the most energy (a
   longer step counted) that option, while the step stays within ``T``.

The frontier sweeps ``T`` from the all-fastest critical path to the point past which slowing
down no longer saves energy, and keeps the Pareto-optimal (time, energy) points.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from merak.energy.dag import StepGraph, topological_order
from merak.energy.profile_csv import Option

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlanPoint:
    """One frequency plan and what it costs.

    Attributes:
        iteration_time: the step's critical path in seconds.
        energy: the step's energy in joules (all stages, blocked time included).
        frequencies: the clock of every node of the graph, by node index.
        deadline: the time the point was solved for.
    """

    iteration_time: float
    energy: float
    frequencies: tuple[int, ...]
    deadline: float

    def stage_plans(self, graph: StepGraph) -> list[list[tuple[str, int]]]:
        """Per stage, ``(instruction, MHz)`` in execution order: zeus's plan format."""
        plans: list[list[tuple[str, int]]] = [[] for _ in range(graph.num_stages)]
        for node, frequency in zip(graph.nodes, self.frequencies):
            plans[node.stage].append((node.name, int(frequency)))
        return plans


@dataclass
class _Choices:
    """Pareto options of one (stage, instruction), fastest first, and their convex hull."""

    times: np.ndarray
    costs: np.ndarray
    energies: np.ndarray
    frequencies: np.ndarray
    hull: list[int] = field(default_factory=list)


def _pareto(options: list[Option], p2p_power: float) -> _Choices:
    ordered = sorted(options, key=lambda o: (o.time, o.energy - p2p_power * o.time))
    kept: list[Option] = []
    for option in ordered:
        cost = option.energy - p2p_power * option.time
        if not kept or cost < kept[-1].energy - p2p_power * kept[-1].time - 1e-15:
            if kept and option.time <= kept[-1].time:
                kept[-1] = option  # same time, cheaper
            else:
                kept.append(option)
    times = np.array([o.time for o in kept])
    costs = np.array([o.energy - p2p_power * o.time for o in kept])
    choices = _Choices(times, costs, np.array([o.energy for o in kept]), np.array([o.frequency for o in kept]))
    hull = [0]
    for i in range(1, len(kept)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # drop b when it lies on or above the segment a -> i
            cross = (times[b] - times[a]) * (costs[i] - costs[a]) - (costs[b] - costs[a]) * (times[i] - times[a])
            if cross <= 0:
                hull.pop()
            else:
                break
        hull.append(i)
    choices.hull = hull
    return choices


class FrequencyPlanner:
    """Plans clocks for every compute instruction of ``graph``.

    Args:
        graph: the step's instruction graph (:func:`merak.energy.dag.step_graph`).
        options: ``{(stage, instruction): [Option, ...]}`` from a profile.
        p2p_power: watts a GPU draws while blocked on communication or its peers.
    """

    def __init__(self, graph: StepGraph, options: dict[tuple[int, str], list[Option]], p2p_power: float) -> None:
        if p2p_power < 0:
            raise ValueError(f"p2p_power must be >= 0 W, got {p2p_power}")
        self.graph, self.p2p_power = graph, float(p2p_power)
        self.order = topological_order(graph)
        self.choices = {key: _pareto(values, self.p2p_power) for key, values in options.items()}
        self.node_choices = [self.choices[(n.stage, n.name)] for n in graph.nodes]
        n = len(graph.nodes)
        self._pred: list[list[int]] = [[] for _ in range(n)]
        self._succ: list[list[int]] = [[] for _ in range(n)]
        for before, after in graph.edges:
            self._pred[after].append(before)
            self._succ[before].append(after)
        self._program = None

    # -- evaluation ---------------------------------------------------------------------

    def critical_path(self, durations) -> float:
        """The step time with these node durations."""
        finish = np.zeros(len(durations))
        for node in self.order:
            start = max((finish[p] for p in self._pred[node]), default=0.0)
            finish[node] = start + durations[node]
        return float(finish.max()) if len(finish) else 0.0

    def _floats(self, durations, deadline: float) -> np.ndarray:
        """How much longer each node could take without the step exceeding ``deadline``."""
        n = len(durations)
        earliest, latest = np.zeros(n), np.full(n, deadline)
        for node in self.order:
            earliest[node] = max((earliest[p] + durations[p] for p in self._pred[node]), default=0.0)
        for node in reversed(self.order):
            latest[node] = min((latest[s] - durations[s] for s in self._succ[node]), default=deadline)
        return latest - earliest - np.asarray(durations)

    def point(self, picks, deadline: float) -> PlanPoint:
        """The plan that runs node ``i`` at option ``picks[i]``."""
        times = np.array([c.times[k] for c, k in zip(self.node_choices, picks)])
        energies = np.array([c.energies[k] for c, k in zip(self.node_choices, picks)])
        step = self.critical_path(times)
        energy = energies.sum() + self.p2p_power * (self.graph.num_stages * step - times.sum())
        return PlanPoint(step, float(energy), tuple(int(c.frequencies[k]) for c, k in zip(self.node_choices, picks)),
                         deadline)

    def fastest_time(self) -> float:
        """The step time with every instruction at its fastest option."""
        return self.critical_path([c.times[0] for c in self.node_choices])

    def slowest_useful_time(self) -> float:
        """The step time with every instruction at its cheapest option (no deadline past it saves more)."""
        return self.critical_path([c.times[c.hull[-1]] for c in self.node_choices])

    # -- solving --------------------------------------------------------------------------

    def _build_program(self):
        """The LP's constant parts: variables are node start times, then hull segment fills."""
        from scipy.sparse import coo_matrix

        n = len(self.graph.nodes)
        columns, lengths, slopes = [], [], []
        for node, c in enumerate(self.node_choices):
            for a, b in zip(c.hull, c.hull[1:]):
                columns.append(node)
                lengths.append(c.times[b] - c.times[a])
                slopes.append((c.costs[b] - c.costs[a]) / (c.times[b] - c.times[a]))
        num_vars = n + len(columns)
        rows, cols, vals, rhs = [], [], [], []
        segments_of: list[list[int]] = [[] for _ in range(n)]
        for k, node in enumerate(columns):
            segments_of[node].append(n + k)
        base = np.array([c.times[c.hull[0]] for c in self.node_choices])

        def finish_before(node: int, column: int) -> None:
            """One row: start + duration of ``node`` - variable ``column`` <= 0 (the base time moved right)."""
            row = len(rhs)
            for var in (node, *segments_of[node]):
                rows.append(row)
                cols.append(var)
                vals.append(1.0)
            rows.append(row)
            cols.append(column)
            vals.append(-1.0)
            rhs.append(-base[node])

        for before, after in self.graph.edges:  # an edge: ``before`` finishes before ``after`` starts
            finish_before(before, after)
        step_var = num_vars  # the step time T, charged S * p2p_power per second
        for node in (i for i in range(n) if not self._succ[i]):  # a last instruction finishes within T
            finish_before(node, step_var)
        row = len(rhs)
        matrix = coo_matrix((vals, (rows, cols)), shape=(row, num_vars + 1)).tocsr()
        bounds = [(0, None)] * n + [(0, length) for length in lengths]
        cost = np.concatenate([np.zeros(n), np.array(slopes), [self.graph.num_stages * self.p2p_power]])
        self._program = (matrix, np.array(rhs), base, bounds, cost, columns)

    def _relaxed(self, deadline: float) -> tuple[np.ndarray, float]:
        """The LP optimum's node durations and step time (at most ``deadline``)."""
        from scipy.optimize import linprog

        if self._program is None:
            self._build_program()
        matrix, rhs, base, bounds, cost, columns = self._program
        result = linprog(cost, A_ub=matrix, b_ub=rhs, bounds=[*bounds, (0, deadline)], method="highs")
        if result.status != 0:
            raise RuntimeError(f"the frequency LP failed at deadline {deadline:.6f} s: {result.message}")
        durations = base.copy()
        n = len(self.graph.nodes)
        np.add.at(durations, np.array(columns, dtype=int), result.x[n:-1])
        return durations, float(result.x[-1])

    def solve(self, deadline: float) -> PlanPoint:
        """The least-energy plan whose step takes at most ``deadline`` seconds.

        Raises:
            ValueError: the deadline is shorter than the all-fastest step.
        """
        fastest = self.fastest_time()
        if deadline < fastest * (1 - 1e-9):
            raise ValueError(f"deadline {deadline:.6f} s is shorter than the fastest possible step ({fastest:.6f} s)")
        relaxed, _ = self._relaxed(deadline)
        picks = []
        for c, duration in zip(self.node_choices, relaxed):
            fits = np.nonzero(c.times <= duration * (1 + 1e-9) + 1e-12)[0]
            picks.append(int(fits[-1]) if len(fits) else 0)
        return self.point(self._reclaim(picks, deadline), deadline)

    def _reclaim(self, picks: list[int], deadline: float) -> list[int]:
        """Greedy improvement: repeatedly give the instruction whose next slower option saves the most
        energy per second of its own that option, counting the longer step it may cause (``S * p2p_power`` per second),
        while the step stays within ``deadline``. Extending one instruction by ``x`` lengthens the
        step by ``max(0, x - float)``, its float computed against the current step time."""
        durations = np.array([c.times[k] for c, k in zip(self.node_choices, picks)])
        step_power = self.graph.num_stages * self.p2p_power
        while True:
            step = self.critical_path(durations)
            slack = self._floats(durations, step)
            best, best_gain = None, 1e-12
            for node, (c, k) in enumerate(zip(self.node_choices, picks)):
                if k + 1 >= len(c.times):
                    continue
                extra = c.times[k + 1] - c.times[k]
                longer = max(0.0, extra - slack[node])
                if step + longer > deadline * (1 + 1e-12):
                    continue
                gain = (c.costs[k] - c.costs[k + 1] - step_power * longer) / extra
                if gain > best_gain:
                    best, best_gain = node, gain
            if best is None:
                return picks
            picks[best] += 1
            durations[best] = self.node_choices[best].times[picks[best]]

    def frontier(self, num_points: int = 60) -> list[PlanPoint]:
        """Pareto-optimal plans from the fastest step to the least-energy one, fastest first."""
        started = time.perf_counter()
        fastest, slowest = self.fastest_time(), self.slowest_useful_time()
        # Past the relaxed optimum's own step time a longer step only adds blocked energy.
        end = min(slowest, self._relaxed(slowest)[1] * 1.02) if slowest > fastest else fastest
        deadlines = np.linspace(fastest, end, max(2, num_points)) if end > fastest else [fastest]
        points = [self.solve(float(t)) for t in deadlines]
        points.sort(key=lambda p: (p.iteration_time, p.energy))
        kept: list[PlanPoint] = []
        for p in points:
            if not kept or p.energy < kept[-1].energy - 1e-9:
                kept.append(p)
        logger.info("frontier: %d points (%d deadlines) in %.1f s", len(kept), len(points),
                    time.perf_counter() - started)
        return kept

    def fastest(self) -> PlanPoint:
        """The least-energy plan that keeps the all-fastest step time."""
        return self.solve(self.fastest_time())
