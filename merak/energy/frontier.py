"""The frontier file: every plan of a time-energy frontier, with its predicted time and energy.

``merak-energy plan`` writes ``frontier.json``; a run reads it with
``trainer.frequency_frontier`` and may move along it while training (straggler-aware plans,
:mod:`merak.energy.straggler`). A point's predicted energy is the planner's: the instructions'
energy plus ``p2p_power`` for every second a stage's GPU is not computing, over ``S`` GPUs and
the point's step time. Stretched to a longer step ``T`` (waiting for a straggler), the same
plan uses ``energy + S * p2p_power * (T - iteration_time)``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from merak.core.files import write_json_atomic
from merak.energy.dag import StepGraph, step_graph
from merak.energy.plans import PlanError, StagePlans, check_plan

FORMAT = 1


class FrontierError(ValueError):
    """A frontier file that is malformed or does not fit the run's schedule."""


@dataclass(frozen=True)
class FrontierPoint:
    """One plan of the frontier: per stage ``(instruction, MHz)`` in execution order, and its prediction."""

    iteration_time: float
    energy: float
    plans: StagePlans


@dataclass(frozen=True)
class Frontier:
    """The points of a frontier, fastest first (each slower one uses less energy), and what they were planned for."""

    schedule: str
    num_stages: int
    num_microbatches: int
    num_chunks: int
    p2p_power: float
    points: list[FrontierPoint]

    def index_within(self, step_time: float) -> int:
        """The least-energy point predicted to take at most ``step_time`` (the fastest when none does)."""
        fitting = [i for i, p in enumerate(self.points) if p.iteration_time <= step_time]
        return fitting[-1] if fitting else 0

    def energy_at(self, index: int, step_time: float) -> float:
        """Predicted energy of point ``index`` over a step of ``step_time`` seconds (at least its own)."""
        point = self.points[index]
        return point.energy + self.num_stages * self.p2p_power * max(0.0, step_time - point.iteration_time)

    def check(self, schedule: str, num_stages: int, num_microbatches: int, num_chunks: int, *,
              source: str = "the frontier") -> None:
        """Raise FrontierError unless every point's plans fit this schedule and layout."""
        try:
            graph = step_graph(schedule, num_stages, num_microbatches, num_chunks)
            for index, point in enumerate(self.points):
                check_plan(point.plans, graph, source=f"{source} point {index}")
        except (PlanError, ValueError) as error:
            raise FrontierError(f"{error} (the frontier was planned for {self.schedule}, {self.num_stages} stages, "
                                f"{self.num_microbatches} microbatches, {self.num_chunks} chunks)") from None


def write_frontier(path: str, graph: StepGraph, points, *, schedule: str, num_chunks: int, p2p_power: float,
                   num_microbatches: int, step_overhead: float = 0.0) -> None:
    """Write the planner's ``points`` (:class:`merak.energy.planner.PlanPoint`, fastest first, their step
    times and energies including ``step_overhead``, the step's tail) atomically."""
    write_json_atomic(path, {
        "format": FORMAT, "schedule": schedule, "num_stages": graph.num_stages, "num_microbatches": num_microbatches,
        "num_chunks": num_chunks, "p2p_power": p2p_power, "step_overhead_s": step_overhead,
        "points": [{"iteration_time": p.iteration_time, "energy": p.energy,
                    "plans": [[[name, mhz] for name, mhz in stage] for stage in p.stage_plans(graph)]}
                   for p in points]})


def _number(value, what: str, path: str) -> float:
    # JSON has NaN and Infinity: a NaN compares false with everything and would pass "< 0".
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise FrontierError(f"frontier file {path!r}: {what} is {value!r}, not a number >= 0")
    return float(value)


def _header(data: dict, path: str) -> tuple[str, int, int, int]:
    """schedule, num_stages, num_microbatches and num_chunks, each of its JSON type (``int(x)`` would
    round 2.5 and overflow on Infinity)."""
    missing = [key for key in ("schedule", "num_stages", "num_microbatches", "num_chunks", "p2p_power", "points")
               if key not in data]
    if missing:
        raise FrontierError(f"frontier file {path!r} lacks {', '.join(missing)}")
    if not isinstance(data["schedule"], str):
        raise FrontierError(f"frontier file {path!r}: schedule is {data['schedule']!r}, not a name")
    counts = []
    for key in ("num_stages", "num_microbatches", "num_chunks"):
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise FrontierError(f"frontier file {path!r}: {key} is {value!r}, not an integer >= 1")
        counts.append(value)
    return (data["schedule"], *counts)


def _plans(value, what: str, path: str) -> StagePlans:
    if not isinstance(value, list) or not value:
        raise FrontierError(f"frontier file {path!r}: {what} is not a list of stage plans")
    plans = []
    for stage, entries in enumerate(value):
        if not isinstance(entries, list) or not all(
                isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and isinstance(e[1], int)
                and not isinstance(e[1], bool) and e[1] > 0 for e in entries):
            raise FrontierError(f"frontier file {path!r}: {what} stage {stage} is not a list of "
                                "[instruction, MHz] pairs")
        plans.append([(name, mhz) for name, mhz in entries])
    return plans


def read_frontier(path: str) -> Frontier:
    """Parse and check a frontier file.

    Every problem, whatever the file holds (binary data, another JSON document, nesting deeper
    than the parser goes), is a one-line FrontierError naming the file.

    Raises:
        FrontierError: missing, not UTF-8 JSON, another format, or points out of order.
    """
    if not os.path.isfile(path):
        why = "is not a file" if os.path.exists(path) else "does not exist"
        raise FrontierError(f"frontier file {path!r} {why} (merak-energy plan writes DIR/frontier.json)")
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except UnicodeDecodeError as error:
        raise FrontierError(f"frontier file {path!r} is not UTF-8 text (byte {error.object[error.start]:#04x} at "
                            f"offset {error.start}): not a frontier.json that merak-energy plan wrote") from None
    except (OSError, ValueError, RecursionError) as error:  # ValueError: JSONDecodeError, numbers too long
        raise FrontierError(f"frontier file {path!r} is not readable JSON: {error}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise FrontierError(f"frontier file {path!r} is not a merak frontier of format {FORMAT}")
    header = _header(data, path)
    p2p_power, raw = _number(data["p2p_power"], "p2p_power", path), data["points"]
    if not isinstance(raw, list) or not raw:
        raise FrontierError(f"frontier file {path!r} has no points")
    points = []
    for i, p in enumerate(raw):
        if not isinstance(p, dict):
            raise FrontierError(f"frontier file {path!r}: point {i} is {p!r}, not an object")
        points.append(FrontierPoint(_number(p.get("iteration_time"), f"point {i}'s iteration_time", path),
                                    _number(p.get("energy"), f"point {i}'s energy", path),
                                    _plans(p.get("plans"), f"point {i}'s plans", path)))
    for i in range(1, len(points)):
        if not (points[i].iteration_time > points[i - 1].iteration_time and points[i].energy < points[i - 1].energy):
            raise FrontierError(f"frontier file {path!r}: points must be ordered fastest first, each slower one "
                                f"using less energy (point {i} does not)")
    return Frontier(*header, p2p_power=p2p_power, points=points)
