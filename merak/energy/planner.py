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
   then, greedily, give the instruction whose next slower option saves the most energy per
   second (a longer step counted) that option, while the step stays within ``T``. One pass of
   the greedy takes, best first, every move that fits in its own float after the moves before
   it, so one pass does the work of many single moves (their plans differ from one move per
   pass by at most a few hundredths of a percent of energy).

Longest paths are computed a level of the graph at a time (:mod:`merak.energy.paths`) and the
relaxation is re-solved warm from one deadline to the next (:mod:`merak.energy.relaxation`):
8 stages x 32 microbatches, 60 deadlines, take about 2 s on one core.

A constant host overhead per instruction (measured by the profile run) lengthens every option's
time on the critical path but not the GPU's busy time.

The frontier sweeps ``T`` from the all-fastest critical path to the point past which slowing
down no longer saves energy, and keeps the Pareto-optimal (time, energy) points.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from merak.energy.dag import StepGraph
from merak.energy.paths import LevelledGraph
from merak.energy.profile_csv import Option
from merak.energy.relaxation import RelaxedProgram

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
        instruction_overhead: seconds the host adds around every instruction (measured by the profile
            run): it lengthens every path, not the GPU's busy time.
    """

    def __init__(self, graph: StepGraph, options: dict[tuple[int, str], list[Option]], p2p_power: float, *,
                 instruction_overhead: float = 0.0) -> None:
        if p2p_power < 0:
            raise ValueError(f"p2p_power must be >= 0 W, got {p2p_power}")
        if not instruction_overhead >= 0:
            raise ValueError(f"instruction_overhead must be >= 0 s, got {instruction_overhead}")
        self.graph, self.p2p_power = graph, float(p2p_power)
        self.instruction_overhead = float(instruction_overhead)
        self.paths = LevelledGraph(graph)
        # An instruction occupies its stage for its time plus the host's overhead around it (launches,
        # transfers), during which the GPU draws blocked power: the overhead lengthens every option alike.
        overhead = self.instruction_overhead
        self.choices = {key: _pareto([Option(o.frequency, o.time + overhead, o.energy) for o in values],
                                     self.p2p_power)
                        for key, values in options.items()}
        self.node_choices = [self.choices[(n.stage, n.name)] for n in graph.nodes]
        # Every node's options in one table, padded with infinitely slow ones, for the greedy's vector steps.
        width = max((len(c.times) for c in self.node_choices), default=0) + 1
        self._times = np.full((len(graph.nodes), width), np.inf)
        self._costs = np.full((len(graph.nodes), width), np.inf)
        for node, c in enumerate(self.node_choices):
            self._times[node, :len(c.times)] = c.times
            self._costs[node, :len(c.costs)] = c.costs
        self._num_options = np.array([len(c.times) for c in self.node_choices], dtype=np.int64)
        self._program: RelaxedProgram | None = None
        # Solved deadlines: the relaxation may have several optima, and which one a warm start finds
        # depends on the deadline solved before; asking twice must give the same plan.
        self._solved: dict[float, PlanPoint] = {}

    # -- evaluation ---------------------------------------------------------------------

    def critical_path(self, durations) -> float:
        """The step time with these node durations."""
        return self.paths.step_time(np.asarray(durations, dtype=float))

    def point(self, picks, deadline: float) -> PlanPoint:
        """The plan that runs node ``i`` at option ``picks[i]``."""
        picks = np.asarray(picks, dtype=np.int64)
        nodes = np.arange(len(picks))
        times = self._times[nodes, picks]
        energies = np.array([c.energies[k] for c, k in zip(self.node_choices, picks)])
        step = self.critical_path(times)
        busy = times.sum() - self.instruction_overhead * len(times)
        energy = energies.sum() + self.p2p_power * (self.graph.num_stages * step - busy)
        return PlanPoint(step, float(energy), tuple(int(c.frequencies[k]) for c, k in zip(self.node_choices, picks)),
                         deadline)

    def fastest_time(self) -> float:
        """The step time with every instruction at its fastest option."""
        return self.critical_path([c.times[0] for c in self.node_choices])

    def slowest_useful_time(self) -> float:
        """The step time with every instruction at its cheapest option (no deadline past it saves more)."""
        return self.critical_path([c.times[c.hull[-1]] for c in self.node_choices])

    # -- solving --------------------------------------------------------------------------

    def _relaxed(self, deadline: float) -> tuple[np.ndarray, float]:
        """The LP optimum's node durations and step time (at most ``deadline``)."""
        if self._program is None:
            c = self.node_choices
            self._program = RelaxedProgram(self.graph, [x.times for x in c], [x.costs for x in c],
                                           [x.hull for x in c], self.graph.num_stages * self.p2p_power)
        return self._program.solve(deadline)

    def solve(self, deadline: float) -> PlanPoint:
        """The least-energy plan whose step takes at most ``deadline`` seconds.

        Raises:
            ValueError: the deadline is shorter than the all-fastest step.
        """
        deadline = float(deadline)
        if deadline in self._solved:
            return self._solved[deadline]
        fastest = self.fastest_time()
        if deadline < fastest * (1 - 1e-9):
            raise ValueError(f"deadline {deadline:.6f} s is shorter than the fastest possible step ({fastest:.6f} s)")
        relaxed, _ = self._relaxed(max(deadline, fastest))
        fits = self._times <= relaxed[:, None] * (1 + 1e-9) + 1e-12
        picks = np.maximum(fits.sum(axis=1) - 1, 0)  # options are fastest first: the slowest that fits
        self._solved[deadline] = self.point(self._reclaim(picks, deadline), deadline)
        return self._solved[deadline]

    def _reclaim(self, picks: np.ndarray, deadline: float) -> np.ndarray:
        """Greedy improvement: give instructions their next slower option, the most energy saved per
        second of their own first, counting the longer step a move may cause (``S * p2p_power`` per
        second), while the step stays within ``deadline``.

        Each pass computes every node's float against the current step time. A move that lengthens
        the step is taken alone. Otherwise the pass takes the moves in order while each still fits in
        its node's float less the extra time of the moves taken before it in the pass (a path gains
        at most that much), and stops at the first that does not."""
        picks = np.array(picks, dtype=np.int64)
        nodes = np.arange(len(picks))
        step_power = self.graph.num_stages * self.p2p_power
        limit = deadline * (1 + 1e-12)
        while True:
            durations = self._times[nodes, picks]
            finish = self.paths.finish_times(durations)
            step = float(finish.max())
            slack = self.paths.floats(durations, finish, step)
            movable = picks + 1 < self._num_options
            slower = np.where(movable, picks + 1, picks)
            extra = self._times[nodes, slower] - durations
            longer = np.maximum(0.0, extra - slack)
            movable &= step + longer <= limit
            saved = self._costs[nodes, picks] - self._costs[nodes, slower] - step_power * longer
            gain = np.where(movable, saved / np.where(extra > 0, extra, 1.0), -np.inf)
            candidates = np.nonzero(gain > 1e-12)[0]
            if not len(candidates):
                return picks
            ranked = candidates[np.argsort(-gain[candidates], kind="stable")]
            if longer[ranked[0]] > 0:
                picks[ranked[0]] += 1
                continue
            taken = 0.0
            for node in ranked:
                if longer[node] > 0 or extra[node] + taken > slack[node] * (1 - 1e-12):
                    break
                picks[node] += 1
                taken += extra[node]

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
