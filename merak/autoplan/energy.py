"""Layouts chosen for energy: ``parallel.objective`` and ``merak-plan --objective``.

Objectives: ``time`` (the default) ranks layouts by their predicted step time; ``energy`` by the least
energy per step a layout reaches with a per-instruction clock plan; ``energy@BOUND`` by the least
energy of a step no longer than a bound: ``energy@1.1x`` (at most 10 % slower than the fastest
layout's predicted step) or ``energy@250ms`` / ``energy@0.25s``.

Every layout leading on time is priced with its frequency frontier (:mod:`merak.energy.planner`)
over the exact step graph of its schedule (:func:`merak.energy.dag.step_graph`). An instruction's
time at the highest clock is the cost model's (:class:`merak.autoplan.cost.StageCostModel`); its
compute part scales with the clock as the device's clock and power model says
(:class:`merak.energy.simulated.GPUSpec`: the simulated GPU itself, or the model of the cluster's
A100/H100/H200), its tensor-parallel communication does not and draws the blocked power. What the
step spends outside the graph (pipeline transfers, the gradient reduction, the optimizer step: the
cost model's step less the graph's critical path at the highest clocks) is blocked time on every
GPU. The energy of a step counts every GPU: each pipeline's plan, times dp x tp.

A long step (more microbatches than the schedule simulator takes whole) is planned at two short
lengths and extended linearly, as the cost model extends its step time.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass

from merak.autoplan.cluster import Cluster
from merak.autoplan.cost import StageCostModel, along_the_step, group_links
from merak.autoplan.search import Candidate
from merak.energy.dag import step_graph
from merak.energy.planner import FrequencyPlanner, PlanPoint, pareto_points
from merak.energy.profile_csv import Option
from merak.energy.simulated import SPECS, GPUSpec
from merak.report.console import quiet_below

logger = logging.getLogger(__name__)

OBJECTIVES = ("time", "energy", "energy@<slowdown>x", "energy@<step>ms", "energy@<step>s")
# Clocks the layouts are planned over: every fourth 15 MHz step. Frontiers of 20-30 clocks are within a
# fraction of a percent of the full table's and plan several times faster; all are supported clocks.
PLANNING_CLOCK_STRIDE = 4
FRONTIER_POINTS = 12  # of the chosen layout's frontier, the one the run gets
# Planning time: per step graph of a layout being ranked (the planner keeps its best plans when it runs
# out), for the whole ranking (layouts left unpriced rank after the priced ones, saying so), and for the
# chosen layout's whole step. Deep pipelines with hundreds of microbatches have graphs of many thousand
# instructions.
LAYOUT_PLANNING_BUDGET_S = 5.0
RANKING_BUDGET_S = 60.0
RUN_FRONTIER_BUDGET_S = 30.0
# Accelerator names of the presets and the clock/power model standing in for them.
_POWER_MODELS = (("A100", "A100"), ("H100", "H100"), ("H200", "H100"))


@dataclass(frozen=True)
class Objective:
    """What the planner minimizes: ``time``, ``energy``, or ``energy`` within a step bound (a slowdown over
    the fastest layout's predicted step, or seconds)."""

    kind: str = "time"
    slowdown: float | None = None
    step_s: float | None = None

    @classmethod
    def parse(cls, text: str) -> Objective:
        """The objective ``text`` names (see the module docstring); ValueError naming the accepted forms."""
        value = str(text).strip().lower()
        if value in ("time", "energy"):
            return cls(value)
        match = re.fullmatch(r"energy@([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)(x|ms|s)", value)
        if match is None:
            raise ValueError(f"objective {text!r}: use one of {', '.join(OBJECTIVES)} (e.g. energy@1.1x)")
        number, unit = float(match.group(1)), match.group(2)
        if unit == "x":
            if number < 1:
                raise ValueError(f"objective {text!r}: a slowdown bound is at least 1x (1.1x: 10 % slower)")
            return cls("energy", slowdown=number)
        if number <= 0:
            raise ValueError(f"objective {text!r}: the step bound must be positive")
        return cls("energy", step_s=number / 1000 if unit == "ms" else number)

    @property
    def wants_energy(self) -> bool:
        return self.kind == "energy"

    def deadline(self, fastest_step_s: float) -> float | None:
        """The step bound in seconds, given the fastest layout's predicted step (None: no bound)."""
        if self.slowdown is not None:
            return self.slowdown * fastest_step_s
        return self.step_s

    def __str__(self) -> str:
        if self.slowdown is not None:
            return f"energy@{self.slowdown:g}x"
        if self.step_s is not None:
            return f"energy@{self.step_s * 1000:g}ms"
        return self.kind


@dataclass(frozen=True)
class EnergyPrice:
    """A layout's clock plan under the objective and what it is predicted to cost, every GPU counted.

    ``frontier_time_s`` is the plan's critical path (what ``trainer.frontier_deadline`` selects it by);
    ``step_s`` adds the step's time outside the graph. Without a plan meeting the objective's bound,
    ``meets_bound`` is False and the figures are the layout's fastest plan's."""

    step_s: float
    energy_j: float
    fastest_step_s: float
    fastest_energy_j: float
    frontier_time_s: float
    outside_graph_s: float
    mean_clock_mhz: float
    min_clock_mhz: int
    max_clock_mhz: int
    gpus: int
    power_model: str
    bound_s: float | None = None  # the objective's step bound, in seconds
    meets_bound: bool = True

    def to_json(self) -> dict:
        return dict(vars(self))

    def clocks(self) -> str:
        """The clock plan in short: ``1410`` or ``mean 1032 (870-1410)`` MHz."""
        if self.min_clock_mhz == self.max_clock_mhz:
            return str(self.max_clock_mhz)
        return f"mean {self.mean_clock_mhz:.0f} ({self.min_clock_mhz}-{self.max_clock_mhz})"


def power_model(cluster: Cluster) -> GPUSpec:
    """The clock and power model of the cluster's devices: the simulated GPU the processes time themselves
    as, or the model of a preset's A100/H100/H200. ValueError when there is none (CPU workers)."""
    if cluster.simulated_gpu is not None:
        return SPECS[cluster.simulated_gpu]
    if cluster.cores_per_node is not None:
        raise ValueError("an energy objective needs GPUs with a clock and power model: CPU processes have none; "
                         "set trainer.energy_device=simulated (simulated GPUs on this machine) or plan for a GPU "
                         "cluster (cluster=h100-80)")
    name = cluster.accelerator.name.upper()
    for fragment, model in _POWER_MODELS:
        if fragment in name:
            return SPECS[model]
    raise ValueError(f"an energy objective needs a clock and power model of {cluster.accelerator.name}; "
                     f"known: {', '.join(fragment for fragment, _ in _POWER_MODELS)}")


def _planning_clocks(spec: GPUSpec) -> list[int]:
    clocks = spec.clocks()
    return clocks[::PLANNING_CLOCK_STRIDE]


class LayoutEnergy:
    """Frequency frontiers of one layout's step graphs, from the cost model's instruction times.

    Args:
        report: the plan report (its cost model and cluster).
        candidate: the layout, priced by the cost model (simulated schedule).
        spec: the devices' clock and power model.
    """

    def __init__(self, report, candidate: Candidate, spec: GPUSpec) -> None:
        self.layout, self.spec = candidate.layout, spec
        self.predicted_step_s = candidate.predicted_step_s
        model = report.cost_model
        _, _, pp_link = group_links(model.cluster, self.layout.dp, self.layout.tp, self.layout.pp)
        self.costs = StageCostModel(model.pieces(self.layout), self.layout.pp, pp_link, self.layout.recomputes)
        self.clocks = _planning_clocks(spec)
        self.gpus = self.layout.dp * self.layout.tp

    def _options(self, graph) -> dict[tuple[int, str], list[Option]]:
        """Per (stage, instruction): its time and energy at every planning clock."""
        options: dict[tuple[int, str], list[Option]] = {}
        spec, blocked = self.spec, self.spec.blocked_power
        for node in graph.nodes:
            key = (node.stage, node.name)
            if key in options:
                continue
            seconds = self.costs.of(node.stage, node.instruction)
            piece = self.costs.piece(node.stage, node.instruction)
            whole = piece.forward + piece.backward
            # Tensor-parallel and ZeRO communication: the clock does not speed it up.
            fixed = seconds * (piece.tp_seconds + piece.zero_seconds) / whole if whole > 0 else 0.0
            compute = seconds - fixed
            options[key] = [Option(clock, spec.time(compute, clock) + fixed,
                                   spec.energy(compute, clock) + blocked * fixed) for clock in self.clocks]
        return options

    def planner(self, num_microbatches: int, budget_s: float = LAYOUT_PLANNING_BUDGET_S):
        """The step graph of ``num_microbatches`` and its :class:`FrequencyPlanner`."""
        layout = self.layout
        graph = step_graph(layout.schedule, layout.pp, num_microbatches, layout.chunks)
        return graph, FrequencyPlanner(graph, self._options(graph), self.spec.blocked_power, time_budget_s=budget_s)

    def price(self, deadline: float | None) -> EnergyPrice:
        """The least-energy plan whose whole step fits ``deadline`` (None: the least-energy plan)."""
        layout = self.layout
        planners: dict[int, FrequencyPlanner] = {}
        fastest: dict[int, PlanPoint] = {}

        def fastest_time(length: int) -> list[float]:
            planners[length] = self.planner(length)[1]
            with _planner_warnings_only():
                fastest[length] = planners[length].fastest()
            return [fastest[length].iteration_time]

        graph_fastest = along_the_step(layout, fastest_time)[0]
        outside = max(0.0, self.predicted_step_s - graph_fastest)
        # The same share of each length's fastest critical path: a bound on the whole step becomes one on
        # the graph, and the plans chosen at two short lengths extend to the step's length.
        stretch = None if deadline is None else (deadline - outside) / graph_fastest
        chosen: dict[int, PlanPoint | None] = {}

        def plan(length: int) -> list[float]:
            chosen[length] = _least_energy(planners[length], stretch)
            point = chosen[length] or fastest[length]
            return [point.iteration_time, point.energy, fastest[length].energy]

        time_s, energy, fastest_energy = along_the_step(layout, plan)
        shown = chosen[max(chosen)] or fastest[max(chosen)]  # the plan of the longest length planned
        clocks = shown.frequencies
        blocked_outside = self.spec.blocked_power * layout.pp * outside
        return EnergyPrice(
            step_s=time_s + outside, energy_j=(energy + blocked_outside) * self.gpus,
            fastest_step_s=graph_fastest + outside, fastest_energy_j=(fastest_energy + blocked_outside) * self.gpus,
            frontier_time_s=time_s, outside_graph_s=outside, mean_clock_mhz=sum(clocks) / len(clocks),
            min_clock_mhz=min(clocks), max_clock_mhz=max(clocks), gpus=layout.world_size,
            power_model=self.spec.name, bound_s=deadline, meets_bound=all(p is not None for p in chosen.values()))


def _least_energy(planner: FrequencyPlanner, stretch: float | None) -> PlanPoint | None:
    """The least-energy plan of the whole frontier (``stretch`` None), or of the steps at most ``stretch`` x
    the fastest one (None when that is faster than the fastest)."""
    with _planner_warnings_only():
        if stretch is None:
            return planner.least_energy()
        if stretch < 1 - 1e-9:
            return None
        fastest = planner.fastest_time()
        return planner.solve(max(stretch * fastest, fastest))


def _planner_warnings_only():
    """The planner logs every frontier (ranking plans dozens); its warnings (a spent time budget) still show."""
    return quiet_below(logging.WARNING, "merak.energy.planner")


def _within(points: list[PlanPoint], bound: float | None) -> int:
    """The least-energy point (fastest first, energy falling) taking at most ``bound``; -1 when none does."""
    if bound is None:
        return len(points) - 1
    fitting = [i for i, p in enumerate(points) if p.iteration_time <= bound * (1 + 1e-9)]
    return fitting[-1] if fitting else -1


def rank_for_energy(report, objective: Objective) -> None:
    """Price the layouts leading on time for energy (``candidate.energy``) and reorder ``report.candidates``:
    least energy first among those meeting the objective's bound, then the priced ones that do not (fastest
    first), then the rest as they were. Each runner-up's ``why_not`` says what it costs more."""
    spec = power_model(report.cluster)
    fastest = report.best.predicted_step_s
    deadline = objective.deadline(fastest)
    # The simulated candidates: the leading ones and the best of every grid not far behind.
    simulated = [c for c in report.candidates if c.fits and c.prediction.simulated]
    started, leading = time.monotonic(), []
    for candidate in simulated:
        if time.monotonic() - started > RANKING_BUDGET_S:
            logger.warning("objective %s: %d of %d layouts priced for energy within %.0f s; the rest rank after "
                           "them", objective, len(leading), len(simulated), RANKING_BUDGET_S)
            break
        candidate.energy = LayoutEnergy(report, candidate, spec).price(deadline)
        leading.append(candidate)
    meeting = sorted((c for c in leading if c.energy.meets_bound), key=lambda c: c.energy.energy_j)
    missing = [c for c in leading if not c.energy.meets_bound]
    rest = [c for c in report.candidates if c not in leading]
    if not meeting:
        bound = f"{deadline * 1e3:,.1f} ms" if deadline is not None else "none"
        raise ValueError(f"objective {objective}: no layout is predicted to step within {bound} (the fastest "
                         f"takes {fastest * 1e3:,.1f} ms); loosen the bound")
    report.candidates = meeting + missing + rest
    best = meeting[0]
    for candidate in report.candidates[1:]:
        if candidate.fits:
            candidate.why_not = _explain(candidate, best, deadline)


def _explain(candidate: Candidate, best: Candidate, deadline: float | None) -> str:
    if candidate.energy is None:
        return "not priced for energy (not among the layouts leading on time, or past the ranking's time budget)"
    price = candidate.energy
    if not price.meets_bound:
        return f"no clock plan steps within {deadline * 1e3:,.1f} ms (fastest {price.fastest_step_s * 1e3:,.1f} ms)"
    more = price.energy_j / best.energy.energy_j - 1
    slower = price.step_s / best.energy.step_s - 1
    if abs(more) < 5e-4:
        return f"as little energy within 0.05 %, ranked lower on time (step {slower:+.1%})"
    return f"{more:+.1%} energy, step {slower:+.1%}"


def frontier_for_run(report, candidate: Candidate, objective: Objective, path: str) -> float:
    """Plan ``candidate``'s whole step, write its frontier to ``path`` (``trainer.frequency_frontier``) and
    return the ``trainer.frontier_deadline`` that selects the objective's plan."""
    from merak.energy.frontier import write_frontier

    energy = LayoutEnergy(report, candidate, power_model(report.cluster))
    price = candidate.energy if candidate.energy is not None else energy.price(
        objective.deadline(report.best.predicted_step_s))
    layout = candidate.layout
    graph, planner = energy.planner(layout.num_microbatches, budget_s=RUN_FRONTIER_BUDGET_S)
    with _planner_warnings_only():
        points = planner.frontier(FRONTIER_POINTS)
    bound = price.bound_s
    if bound is not None:  # the bound's own plan, between two of the frontier's
        solved = _least_energy(planner, (bound - price.outside_graph_s) / planner.fastest_time())
        points = pareto_points([*points, *([solved] if solved is not None else [])])
    # Pareto points, energy falling: without a bound the last one uses the least.
    index = max(0, _within(points, None if bound is None else bound - price.outside_graph_s))
    write_frontier(path, graph, points, schedule=layout.schedule, num_chunks=layout.chunks,
                   p2p_power=energy.spec.blocked_power, num_microbatches=layout.num_microbatches,
                   step_overhead=price.outside_graph_s)
    # A hair above the plan's own time, so that rounding in the file never selects a faster plan.
    return points[index].iteration_time * (1 + 1e-6)


__all__ = ["EnergyPrice", "LayoutEnergy", "OBJECTIVES", "Objective", "frontier_for_run", "power_model",
           "rank_for_energy"]
