"""The search over layouts: every valid one is priced, the ones that fit are ranked by step time.

Candidates: every (dp, tp, pp) the recipe accepts (tensor groups within a node), microbatch, schedule (1F1B,
zb_h1, interleaved), recomputation (off, full, selective), ZeRO 0-3 (dp > 1) and sequence parallelism (tp > 1),
priced in closed form; the best, and the best of every grid not far behind, are then simulated with their real
schedules.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from merak.autoplan.cluster import Cluster
from merak.autoplan.cost import CostModel, LayoutError, Prediction
from merak.autoplan.layout import RECOMPUTE_MODES, ZERO_STAGES, Layout
from merak.pipeline.simulate import ScheduleError

logger = logging.getLogger(__name__)

PIPELINE_SCHEDULES = ("1f1b", "zb_h1", "interleaved_1f1b")
MEMORY_HEADROOM = 0.9  # of a device's memory the plan may fill (allocator fragmentation, workspace buffers)
SIMULATED_BEST = 16  # candidates simulated after the closed-form ranking
SIMULATED_PER_GRID = 1
SIMULATED_PER_GRID_WITHIN = 2.0  # ... when its closed-form step is within this factor of the best one
SIMULATED_PER_GRID_MAX_PP = 32  # ... and its pipeline is not so deep that simulating it takes seconds
# A more involved layout must be this much faster to beat a simpler one (predictions are not exact).
SIMPLICITY_MARGIN = 0.01


def _divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]


@dataclass
class Candidate:
    """A layout with its prediction; ``why_not`` says why it lost (or does not fit)."""

    layout: Layout
    prediction: Prediction
    fits: bool
    why_not: str = ""
    # With an energy objective, its clock plan and predicted energy (merak.autoplan.energy.EnergyPrice).
    energy: Any = None

    @property
    def predicted_step_s(self) -> float:
        return self.prediction.step_s

    @property
    def predicted_stage_memory(self) -> list[int]:
        return list(self.prediction.stage_memory)

    def to_json(self) -> dict:
        return {"layout": self.layout.to_json(), "key": self.layout.key(), "overrides": self.layout.overrides(),
                "predicted_step_s": self.prediction.step_s,
                "predicted_stage_memory_bytes": list(self.prediction.stage_memory),
                "breakdown": self.prediction.breakdown, "simulated": self.prediction.simulated,
                "fits": self.fits, "why_not": self.why_not} | ({"energy": self.energy.to_json()} if self.energy else {})


@dataclass
class SearchSpace:
    """What the search may choose (all of it by default)."""

    world_size: int
    global_batch_size: int
    schedules: tuple[str, ...] = PIPELINE_SCHEDULES
    recompute: tuple[str, ...] = RECOMPUTE_MODES
    zero_stages: tuple[int, ...] = ZERO_STAGES
    sequence_parallel: tuple[bool, ...] = (False, True)
    max_micro_batch_size: int | None = None
    layout_problems: Callable[[int, int, int], list[str]] = field(default=lambda dp, tp, pp: [])


def grids(space: SearchSpace, cluster: Cluster, max_pp: int | None = None) -> list[tuple[int, int, int]]:
    """Every (dp, tp, pp) of the world size that the recipe and the cluster allow."""
    found = []
    for tp in _divisors(space.world_size):
        if tp > cluster.devices_per_node:
            continue  # tensor-parallel traffic at every layer stays inside a node
        for pp in _divisors(space.world_size // tp):
            dp = space.world_size // (tp * pp)
            if max_pp is not None and pp > max_pp:
                continue
            if space.global_batch_size % dp or space.layout_problems(dp, tp, pp):
                continue
            found.append((dp, tp, pp))
    return found


def layouts(space: SearchSpace, cluster: Cluster, max_pp: int | None = None) -> Iterable[Layout]:
    """Every candidate layout of the search space."""
    for dp, tp, pp in grids(space, cluster, max_pp):
        per_replica = space.global_batch_size // dp
        for micro in _divisors(per_replica):
            if space.max_micro_batch_size and micro > space.max_micro_batch_size:
                continue
            microbatches = per_replica // micro
            schedules = [(s, 2 if s == "interleaved_1f1b" else 1) for s in space.schedules] if pp > 1 \
                else [("1f1b", 1)]
            for schedule, chunks in schedules:
                if chunks > 1 and microbatches % pp:
                    continue  # interleaving runs microbatches in groups of pp
                for recompute in space.recompute:
                    for zero in (space.zero_stages if dp > 1 else (0,)):
                        for sequence_parallel in (space.sequence_parallel if tp > 1 else (False,)):
                            yield Layout(dp=dp, tp=tp, pp=pp, micro_batch_size=micro,
                                         num_microbatches=microbatches, schedule=schedule, chunks=chunks,
                                         recompute=recompute, zero_stage=zero,
                                         sequence_parallel=sequence_parallel)


def _complexity(layout: Layout) -> int:
    return int(layout.recomputes) + layout.zero_stage + int(layout.schedule != "1f1b") \
        + int(layout.sequence_parallel)


def _starved(layout: Layout) -> bool:
    """Fewer microbatches than pipeline stages: every stage idles for most of the step."""
    return layout.num_microbatches < layout.pp


def _rank_key(candidate: Candidate) -> tuple[bool, float]:
    # A starved pipeline ranks after every other layout that fits, whatever its predicted step: the run
    # would warn that its stages idle, and a prediction that favours it is the cost model's error bar.
    layout = candidate.layout
    return _starved(layout), candidate.prediction.step_s * (1 + SIMPLICITY_MARGIN * _complexity(layout))


_PARTS = {"bubble_s": "pipeline bubble", "tp_comm_s": "tensor-parallel communication",
          "recompute_s": "recomputation", "dp_comm_s": "data-parallel gradient reduction",
          "zero_comm_s": "ZeRO's gathers and reduce-scatters in every microbatch",
          "tied_comm_s": "summing tied weights' gradients between stages",
          "optimizer_s": "optimizer step", "compute_s": "compute on the busiest stage",
          "sync_s": "the loss and gradient norm reduced over every process"}


def explain(candidate: Candidate, best: Candidate) -> str:
    """Why ``candidate`` ranks below ``best``: its step and its largest extra cost."""
    if not candidate.fits:
        return candidate.why_not
    slower = candidate.prediction.step_s / best.prediction.step_s - 1
    if _starved(candidate.layout) and not _starved(best.layout):
        return (f"{slower:+.1%}: {candidate.layout.num_microbatches} microbatches for {candidate.layout.pp} "
                f"stages, each stage idles for most of the step")
    extra = {name: candidate.prediction.breakdown.get(name, 0.0) - best.prediction.breakdown.get(name, 0.0)
             for name in _PARTS}
    name = max(extra, key=extra.get)
    if extra[name] <= 0 or slower <= 0:  # ranked below only by the simplicity margin
        return f"{slower:+.1%}: as fast within the margin, but less simple"
    return f"{slower:+.1%}: {_PARTS[name]} +{extra[name] * 1e3:.3g} ms"


def _fits(prediction, usable: float) -> tuple[bool, str]:
    """Whether the prediction's fullest device holds at most ``usable`` bytes, and why not."""
    if prediction.max_memory <= usable:
        return True, ""
    return False, (f"does not fit: {prediction.max_memory / 2**30:.3g} GiB on its fullest device, "
                   f"{usable / 2**30:.3g} GiB usable")


def search(model: CostModel, space: SearchSpace, capacity_bytes: float, max_pp: int | None = None) -> list[Candidate]:
    """Price every layout; return the candidates best first (fitting ones first)."""
    priced: list[Candidate] = []
    usable = capacity_bytes * MEMORY_HEADROOM
    for layout in layouts(space, model.cluster, max_pp):
        try:
            prediction = model.predict(layout, simulate_schedule=False)
        except (LayoutError, ScheduleError, ValueError) as error:
            logger.debug("%s: %s", layout.key(), error)
            continue
        fits, why = _fits(prediction, usable)
        priced.append(Candidate(layout, prediction, fits, why))
    if not priced:
        return []
    fitting = sorted((c for c in priced if c.fits), key=_rank_key)
    chosen = {id(c): c for c in fitting[:SIMULATED_BEST]}
    per_grid: dict[tuple[int, int, int], int] = {}
    for candidate in fitting:
        close = candidate.prediction.step_s <= fitting[0].prediction.step_s * SIMULATED_PER_GRID_WITHIN
        cheap = candidate.layout.pp <= SIMULATED_PER_GRID_MAX_PP
        if close and cheap and per_grid.get(candidate.layout.grid, 0) < SIMULATED_PER_GRID:
            per_grid[candidate.layout.grid] = per_grid.get(candidate.layout.grid, 0) + 1
            chosen[id(candidate)] = candidate
    for candidate in chosen.values():
        try:
            candidate.prediction = model.predict(candidate.layout, simulate_schedule=True)
        except ScheduleError as error:
            candidate.fits, candidate.why_not = False, f"its schedule cannot run: {error}"
        else:  # priced on the run's own cuts now (a large model's first ranking may not have been)
            candidate.fits, candidate.why_not = _fits(candidate.prediction, usable)
    simulated = sorted((c for c in chosen.values() if c.fits), key=_rank_key)
    rest = [c for c in fitting if id(c) not in chosen]
    unfit = sorted((c for c in priced if not c.fits), key=lambda c: c.prediction.max_memory)
    ranked = simulated + rest + unfit
    if simulated:
        for candidate in ranked[1:]:
            candidate.why_not = explain(candidate, simulated[0])
    return ranked
