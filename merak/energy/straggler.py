"""Straggler-aware frequency plans: pipelines that would wait for a slower one slow down instead.

With data parallelism every pipeline waits at the gradient reduction for the slowest one. A
pipeline that finishes early waits at ``p2p_power`` (Perseus' *extrinsic energy bloat*); run
at a slower point of the frontier it finishes just in time and uses less energy, and the step
takes no longer.

Every ``window`` steps each rank reports the mean time from its step's start to the end of its
last compute instruction (its share of the pipeline, without the wait at the reduction); a
pipeline's time is its slowest rank's. Every rank then decides the same thing from the same
numbers (:class:`PlanSwitcher`), and all stages of a pipeline switch together at that step's
start.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass

from merak.distributed import groups
from merak.energy.frontier import Frontier
from merak.energy.hooks import FrequencyPlanHook, InstructionMeter, PlanMismatchError
from merak.pipeline.hooks import InstructionEvent, PipelineHook

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlanSwitch:
    """A pipeline moved from frontier point ``before`` to ``after`` at the start of step ``step``: the
    least-energy point predicted to take at most ``limit`` seconds (the straggler's ``target`` less the
    margin and the pipeline's own excess over the base point's prediction)."""

    step: int
    pipeline: int
    before: int
    after: int
    target: float
    limit: float


class PlanSwitcher:
    """Which frontier point every pipeline runs, given their measured times.

    A pipeline's *own time* is what it would take at the base point: its measured time less the
    predicted time its current point adds over the base. The slowest own time is the target.
    Each pipeline then runs the least-energy point predicted to finish ``margin`` before the
    target, counting its own excess over the base's prediction (host work, transfers). The
    choices change only when the target moved by more than ``hysteresis`` since they were made.

    Args:
        frontier: the points to choose from.
        pipelines: how many data-parallel pipelines there are.
        base: the point every pipeline runs without a straggler.
        hysteresis: relative change of the target that triggers a new choice.
        margin: relative distance kept below the target.
    """

    def __init__(self, frontier: Frontier, pipelines: int, base: int, hysteresis: float, margin: float) -> None:
        self.frontier, self.base, self.hysteresis, self.margin = frontier, base, hysteresis, margin
        self.current = [base] * pipelines
        self.target: float | None = None
        self.limits: list[float | None] = [None] * pipelines  # what each pipeline's point had to fit within

    def own_times(self, measured: list[float]) -> list[float]:
        """Each pipeline's time had it run the base point."""
        times = [p.iteration_time for p in self.frontier.points]
        return [m - (times[c] - times[self.base]) for m, c in zip(measured, self.current)]

    def update(self, measured: list[float]) -> list[tuple[int, int, int]]:
        """Take the pipelines' measured times; returns ``(pipeline, before, after)`` for each switch."""
        own = self.own_times(measured)
        target = max(own)
        if self.target is not None and abs(target - self.target) <= self.hysteresis * self.target:
            return []
        self.target = target
        base_time = self.frontier.points[self.base].iteration_time
        switches = []
        for pipeline, own_time in enumerate(own):
            # The straggler (or one as slow) has no slack: its limit is at most the base point's time.
            excess = own_time - base_time
            self.limits[pipeline] = target * (1 - self.margin) - excess
            choice = max(self.base, self.frontier.index_within(self.limits[pipeline]))
            if choice != self.current[pipeline]:
                switches.append((pipeline, self.current[pipeline], choice))
                self.current[pipeline] = choice
        return switches


class StragglerAwarePlans(PipelineHook):
    """Runs this stage's plan of the frontier point its pipeline is on, and moves along the frontier.

    Collective: every ``window`` steps every rank of the job exchanges its measured time (at the
    start of the same step). A ``window`` of 0 never switches.

    Args:
        device: this rank's GPU.
        frontier: the frontier the job runs.
        meter: the listener that measures this rank's steps.
        stage, pipeline, pipelines: this rank's pipeline stage, data-parallel rank and the dp degree.
        base: the point every pipeline starts on.
        window, hysteresis, margin: see :class:`PlanSwitcher`.
    """

    def __init__(self, device, frontier: Frontier, meter: InstructionMeter, *, stage: int, pipeline: int,
                 pipelines: int, base: int, window: int, hysteresis: float, margin: float) -> None:
        self.device, self.frontier, self.meter = device, frontier, meter
        self.stage, self.pipeline, self.window = stage, pipeline, window
        self.switcher = PlanSwitcher(frontier, pipelines, base, hysteresis, margin)
        self.control = FrequencyPlanHook(device, frontier.points[base].plans[stage], stage)
        supported = set(device.supported_clocks())
        for index, point in enumerate(frontier.points):  # a switch must not find out in the middle of training
            unsupported = sorted({mhz for _, mhz in point.plans[stage] if mhz not in supported})
            if unsupported:
                raise PlanMismatchError(f"frontier point {index} runs stage {stage} at {unsupported} MHz, which "
                                        f"{device.name} does not support")
        self.switches: list[PlanSwitch] = []
        self.since_step = 0  # the first step run under the current points (the summary measures from it)

    @property
    def point(self) -> int:
        """The frontier point this rank's pipeline runs."""
        return self.switcher.current[self.pipeline]

    def _measured(self) -> float | None:
        """This rank's mean compute span over the last window, at the start of steps 1 + k * window (k >= 1;
        step 0 warms up). Decisions are a window apart, so every window after a switch runs the new points."""
        steps = self.meter.steps
        done = len(steps)
        if self.window == 0 or done <= 1 or (done - 1) % self.window:
            return None
        return statistics.fmean(s.compute_span for s in steps[-self.window:])

    def on_step_begin(self) -> None:
        span = self._measured()
        if span is not None:
            reports = groups.gather_from_all((self.pipeline, span))  # every rank decides from the same numbers
            pipelines = len(self.switcher.current)
            measured = [max(s for p, s in reports if p == d) for d in range(pipelines)]
            step = len(self.meter.steps)
            switches = self.switcher.update(measured)
            if switches:
                self.since_step = step
            for pipeline, before, after in switches:
                self.switches.append(PlanSwitch(step, pipeline, before, after, self.switcher.target,
                                                self.switcher.limits[pipeline]))
                if pipeline != self.pipeline:
                    continue
                self.control.plan = list(self.frontier.points[after].plans[self.stage])
                if self.stage == 0:
                    logger.info("step %d: pipeline %d moves from frontier point %d to %d (straggler at %.4f s)",
                                step, pipeline, before, after, self.switcher.target)
        self.control.on_step_begin()

    def on_instruction_begin(self, event: InstructionEvent) -> None:
        self.control.on_instruction_begin(event)

    def on_step_end(self) -> None:
        self.control.on_step_end()


__all__ = ["PlanSwitch", "PlanSwitcher", "StragglerAwarePlans"]
