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
   the greedy ranks the moves (ties by node index) and takes, best first, the moves that keep
   the step time together, up to the first that would lengthen it; a move that conflicts with
   those taken is skipped when the moves behind it tie with it (identical stages, noise-free
   curves), since one-move-per-pass would take those next. So a pass does the work of many
   single moves, ties included (their plans differ from one move per pass by at most a few
   hundredths of a percent of energy), and every pass moves at least one instruction.
4. A time budget (``time_budget_s``) bounds the whole: once spent, the greedy keeps the valid
   plan it has, and later deadlines get the best plan already found that meets them (else the
   rounded relaxation), with a warning.

Longest paths are computed a level of the graph at a time (:mod:`merak.energy.paths`) and the
relaxation is re-solved warm from one deadline to the next (:mod:`merak.energy.relaxation`).
``bench/energy_planner_family.py`` times the planner on tie-heavy profiles (BENCHMARKS.md).

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

# Relative to the step time: a float this close to a move's extra time fits it (rounding errors of
# longest paths, which identical stages and noise-free curves hit exactly).
_TOLERANCE = 1e-12
# Conflicting moves one greedy pass skips to take the moves tied with them, at a bisection each.
_MAX_SKIPS = 64
DEFAULT_TIME_BUDGET_S = 300.0
# Large graphs relax through every other hull vertex (FrequencyPlanner._relaxed).
RELAXATION_HULL_STRIDE = 2
COARSE_RELAXATION_NODES = 256


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


def pareto_points(points: list[PlanPoint]) -> list[PlanPoint]:
    """``points`` fastest first, each kept only if it uses less energy than every faster one."""
    kept: list[PlanPoint] = []
    for point in sorted(points, key=lambda p: (p.iteration_time, p.energy)):
        if not kept or point.energy < kept[-1].energy - 1e-9:
            kept.append(point)
    return kept


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
        time_budget_s: seconds of planning (spent in :meth:`solve`, the frontier's included) after
            which the greedy stops:
            the deadline being solved keeps the valid plan it has reached, later deadlines the best
            plan already found that meets them (else the rounded relaxation), and a warning says
            so. ``None``: no limit.
    """

    def __init__(self, graph: StepGraph, options: dict[tuple[int, str], list[Option]], p2p_power: float, *,
                 instruction_overhead: float = 0.0, time_budget_s: float | None = DEFAULT_TIME_BUDGET_S) -> None:
        if p2p_power < 0:
            raise ValueError(f"p2p_power must be >= 0 W, got {p2p_power}")
        if not instruction_overhead >= 0:
            raise ValueError(f"instruction_overhead must be >= 0 s, got {instruction_overhead}")
        if time_budget_s is not None and not time_budget_s >= 0:
            raise ValueError(f"time_budget_s must be >= 0 s, got {time_budget_s}")
        self.time_budget_s = time_budget_s
        self._planning_s = 0.0  # seconds spent in solve(), against the budget
        self.over_budget = False  # set once the budget cut a greedy short
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
        """The LP optimum's node durations and step time (at most ``deadline``).

        On a graph of more than ``COARSE_RELAXATION_NODES`` instructions the relaxation runs through every
        other vertex of each instruction's hull (and its last): it only seeds the rounding and the greedy,
        and its warm solves, which dominate a long step's frontier, pivot about once per vertex crossed.
        With every vertex of an 81-clock curve they take twice as long there, for plans no better
        (benchmark section 19); on smaller graphs they are cheap and every vertex seeds a little better."""
        if self._program is None:
            c = self.node_choices
            stride = RELAXATION_HULL_STRIDE if len(self.graph.nodes) > COARSE_RELAXATION_NODES else 1
            hulls = [sorted({*x.hull[::stride], x.hull[-1]}) for x in c]
            self._program = RelaxedProgram(self.graph, [x.times for x in c], [x.costs for x in c], hulls,
                                           self.graph.num_stages * self.p2p_power)
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
        begun = time.monotonic()
        try:
            return self._solve(deadline, fastest, begun)
        finally:
            self._planning_s += time.monotonic() - begun

    def _solve(self, deadline: float, fastest: float, begun: float) -> PlanPoint:
        """:meth:`solve` for a new, feasible ``deadline``, begun at ``begun`` (``time.monotonic()``)."""
        stop_at = None if self.time_budget_s is None else begun + self.time_budget_s - self._planning_s
        if not self.over_budget and stop_at is not None and begun >= stop_at:
            self._spent(deadline)
        if self.over_budget:
            known = self._best_known(deadline)
            if known is not None:
                self._solved[deadline] = known
                return known
        relaxed, _ = self._relaxed(max(deadline, fastest))
        fits = self._times <= relaxed[:, None] * (1 + 1e-9) + 1e-12
        picks = np.maximum(fits.sum(axis=1) - 1, 0)  # options are fastest first: the slowest that fits
        if not self.over_budget:
            picks, finished = self._reclaim(picks, deadline, stop_at)
            if not finished:
                self._spent(deadline)
        self._solved[deadline] = self.point(picks, deadline)
        return self._solved[deadline]

    def _spent(self, deadline: float) -> None:
        """Note, once, that the time budget ran out while solving ``deadline``."""
        self.over_budget = True
        logger.warning("frequency planner: the time budget of %.1f s is spent at deadline %.6f s; that deadline "
                       "keeps the greedy's plan so far, later ones the best plan already found that meets them "
                       "(else the rounded relaxation); a larger time_budget_s (merak-energy plan "
                       "--time-budget) gives better plans", self.time_budget_s, deadline)

    def _best_known(self, deadline: float) -> PlanPoint | None:
        """Past the time budget: the least-energy plan already solved whose step meets ``deadline``
        (None if there is none)."""
        meets = [p for p in self._solved.values() if p.iteration_time <= deadline * (1 + 1e-12)]
        if not meets:
            return None
        best = min(meets, key=lambda p: p.energy)
        return PlanPoint(best.iteration_time, best.energy, best.frequencies, deadline)

    def _reclaim(self, picks: np.ndarray, deadline: float, stop_at: float | None = None) -> tuple[np.ndarray, bool]:
        """Greedy improvement: give instructions their next slower option, the most energy saved per
        second of their own first, counting the longer step a move may cause (``S * p2p_power`` per
        second), while the step stays within ``deadline``.

        Each pass computes every node's float against the current step time and ranks the moves,
        ties by node index. A move that lengthens the step is taken alone. Otherwise the pass takes,
        in rank order, the moves that keep the step (:meth:`_take_batch`). Returns the picks and
        whether the greedy ran to its end (False: ``stop_at``, a ``time.monotonic()`` instant,
        passed first; the picks are a valid plan all the same)."""
        picks = np.array(picks, dtype=np.int64)
        nodes = np.arange(len(picks))
        step_power = self.graph.num_stages * self.p2p_power
        limit = deadline * (1 + 1e-12)
        while True:
            if stop_at is not None and time.monotonic() >= stop_at:
                return picks, False
            durations = self._times[nodes, picks]
            finish = self.paths.finish_times(durations)
            step = float(finish.max())
            slack = self.paths.floats(durations, finish, step)
            movable = picks + 1 < self._num_options
            slower = np.where(movable, picks + 1, picks)
            extra = self._times[nodes, slower] - durations
            # A move exactly as long as its float (identical stages, noise-free curves) keeps the step:
            # a rounding error of the float must not count as lengthening it.
            longer = extra - slack
            longer = np.where(longer > _TOLERANCE * step, longer, 0.0)
            movable &= step + longer <= limit
            saved = self._costs[nodes, picks] - self._costs[nodes, slower] - step_power * longer
            gain = np.where(movable, saved / np.where(extra > 0, extra, 1.0), -np.inf)
            candidates = np.nonzero(gain > 1e-12)[0]
            if not len(candidates):
                return picks, True
            ranked = candidates[np.argsort(-gain[candidates], kind="stable")]
            lengthens = longer[ranked] > 0
            if lengthens[0]:
                picks[ranked[0]] += 1
                continue
            # Only the moves ranked before the first that lengthens the step: that one's gain already
            # counts its longer step, so it must keep its place in the order.
            batch = ranked[:int(np.argmax(lengthens))] if lengthens.any() else ranked
            self._take_batch(picks, batch, gain, extra, slack, step, max(step, min(step * (1 + _TOLERANCE), limit)))

    def _take_batch(self, picks: np.ndarray, batch: np.ndarray, gain: np.ndarray, extra: np.ndarray,
                    slack: np.ndarray, step: float, limit: float) -> None:
        """Take, in order, the moves of ``batch`` (each fits in its own float) that together keep the
        step within ``limit`` (``step``, or a rounding error more, within the deadline): what taking
        them one pass each would do, in a few path evaluations.

        Moves that keep the step leave every other move's gain as it is, so the longest prefix of
        ``batch`` whose moves fit together is what single moves would take first. The floats vouch
        for a first part of it without a path evaluation: a move that fits in its float less the
        extra time of every move taken before it lengthens no path past the step (a path gains at
        most that much). The rest of the prefix is found by doubling, then bisection, on the step
        time, as a prefix that fits only has prefixes that fit. The move after the prefix would now
        lengthen the step, which lowers its gain: the moves tied with it (identical stages) come next
        in the one-move greedy, so the pass skips it and goes on through its ties; it ends at the
        first conflict with no tie behind it, or after ``_MAX_SKIPS`` conflicts."""
        nodes = np.arange(len(picks))
        tolerance = limit - step  # what a float may fall short of a move it takes

        def fits(moves: np.ndarray) -> bool:
            trial = picks.copy()
            trial[moves] += 1
            return self.paths.step_time(self._times[nodes, trial]) <= limit

        position, skips, taken = 0, 0, 0.0
        while position < len(batch):
            rest = batch[position:]
            vouched = taken + np.cumsum(extra[rest]) <= slack[rest] + tolerance
            sure = len(rest) if vouched.all() else int(np.argmin(vouched))
            picks[rest[:sure]] += 1
            taken += float(extra[rest[:sure]].sum())
            rest = rest[sure:]
            if not len(rest):
                return
            if fits(rest):
                picks[rest] += 1
                return
            low, high, size = 0, len(rest) - 1, 1  # rest[:low] fits, rest[:high + 1] does not
            while size <= high and fits(rest[:size]):
                low, size = size, 2 * size
            high = min(high, size - 1)
            while low < high:
                middle = (low + high + 1) // 2
                if fits(rest[:middle]):
                    low = middle
                else:
                    high = middle - 1
            picks[rest[:low]] += 1
            taken += float(extra[rest[:low]].sum())
            conflict = rest[low]
            position += sure + low + 1
            skips += 1
            if (skips > _MAX_SKIPS or position >= len(batch)
                    or gain[batch[position]] < gain[conflict] * (1 - 1e-9)):
                return

    def _useful_end(self) -> float:
        """The longest step worth planning: past the relaxed optimum's own step time a longer step only adds
        blocked energy."""
        fastest, slowest = self.fastest_time(), self.slowest_useful_time()
        return min(slowest, self._relaxed(slowest)[1] * 1.02) if slowest > fastest else fastest

    def least_energy(self) -> PlanPoint:
        """The plan of least energy whatever its step time (about the frontier's last point, for two solves
        instead of a frontier's): the cheaper of the plans solved at the relaxed optimum's step time and a
        little past it."""
        fastest, end = self.fastest_time(), self._useful_end()
        deadlines = sorted({max(fastest, end / 1.02), end})
        return min((self.solve(t) for t in deadlines), key=lambda p: (p.energy, p.iteration_time))

    def frontier(self, num_points: int = 60) -> list[PlanPoint]:
        """Pareto-optimal plans from the fastest step to the least-energy one, fastest first."""
        started = time.perf_counter()
        fastest, end = self.fastest_time(), self._useful_end()
        deadlines = np.linspace(fastest, end, max(2, num_points)) if end > fastest else [fastest]
        points = [self.solve(float(t)) for t in deadlines]
        kept = pareto_points(points)
        logger.info("frontier: %d points (%d deadlines) in %.1f s", len(kept), len(points),
                    time.perf_counter() - started)
        return kept

    def fastest(self) -> PlanPoint:
        """The least-energy plan that keeps the all-fastest step time."""
        return self.solve(self.fastest_time())
