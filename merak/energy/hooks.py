"""Pipeline listeners for energy: simulated compute, measuring, and executing frequency plans.

They are :class:`~merak.pipeline.hooks.PipelineHook` listeners: the executor calls
``on_step_begin``, ``on_instruction_begin(event)``, ``on_instruction_end(event)`` and
``on_step_end``, each instruction described by an :class:`~merak.pipeline.hooks.InstructionEvent`.
A worker's list is ordered: whatever sets the clock (a :class:`FrequencyPlanHook`, or zeus's
``PipelineFrequencyOptimizer`` behind :class:`~merak.energy.zeus_client.ZeusCallbackHook`), then
:class:`SimulatedCompute` (on a simulated GPU), then :class:`InstructionMeter`, so the meter sees
each instruction's full simulated duration.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from merak.energy.device import GPUDevice
from merak.energy.simulated import SimulatedGPU
from merak.pipeline.hooks import InstructionEvent, PipelineHook


class PlanMismatchError(RuntimeError):
    """The instructions a stage runs differ from its frequency plan."""


class SimulatedCompute(PipelineHook):
    """Makes each compute instruction take as long on the CPU as on ``device`` at its locked clock.

    An instruction's work at the highest clock is its FLOPs (``event.flops``) at ``flops_per_second``.

    Args:
        device: the simulated GPU.
        flops_per_second: the simulated GPU's speed at its highest clock (``trainer.simulated_tflops``).
    """

    def __init__(self, device: SimulatedGPU, flops_per_second: float) -> None:
        if flops_per_second <= 0:
            raise ValueError(f"flops_per_second must be > 0, got {flops_per_second}")
        self.device, self.flops_per_second = device, flops_per_second

    def on_instruction_begin(self, event: InstructionEvent) -> None:
        self.device.begin_compute()

    def on_instruction_end(self, event: InstructionEvent) -> None:
        if event.flops is None:
            raise RuntimeError(f"stage {event.stage} ran {event.name} of chunk {event.chunk} with no FLOP count "
                               "(the chunk's first forward counts them)")
        self.device.end_compute(event.flops / self.flops_per_second)


@dataclass
class StepMeasurement:
    """Time and energy of one step on one GPU, and of each of its compute instructions in order.

    ``compute_span`` is the time from the step's start to the end of its last compute instruction:
    the step without what follows the pipeline (the gradient reduction, where a fast pipeline
    waits for a slow one, and the optimizer step)."""

    time: float
    energy: float
    instructions: list[tuple[str, float, float]] = field(default_factory=list)  # (name, seconds, joules)
    compute_span: float = 0.0

    def breakdown(self) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
        """``({name: [seconds, ...]}, {name: [joules, ...]})`` in execution order."""
        times: dict[str, list[float]] = {}
        energies: dict[str, list[float]] = {}
        for name, seconds, joules in self.instructions:
            times.setdefault(name, []).append(seconds)
            energies.setdefault(name, []).append(joules)
        return times, energies


class InstructionMeter(PipelineHook):
    """Measures every step, and with ``per_instruction`` every compute instruction, with ``device``.

    Each reading synchronizes the device first, so that the work queued before it is counted where it
    ran. Reading around every instruction stalls the host at each one: only the features that need the
    instructions' own times and energies (profiles, plans, frontiers, zeus) pay for it. Without
    ``per_instruction`` a step costs two readings, at its start and its end; its ``instructions`` stay
    empty and its ``compute_span`` is the whole step.

    ``steps`` keeps every finished step's :class:`StepMeasurement`.
    """

    def __init__(self, device: GPUDevice, clock: Callable[[], float] = time.perf_counter, *,
                 per_instruction: bool = True) -> None:
        self.device, self.clock, self.per_instruction = device, clock, per_instruction
        self.steps: list[StepMeasurement] = []
        self._step: tuple[float, float] | None = None
        self._instruction: tuple[float, float] | None = None
        self._current: list[tuple[str, float, float]] = []
        self._last_compute_end = 0.0

    def _read(self) -> tuple[float, float]:
        self.device.synchronize()
        return self.clock(), self.device.energy()

    def on_step_begin(self) -> None:
        self._current = []
        self._step = self._read()
        self._last_compute_end = self._step[0]

    def on_instruction_begin(self, event: InstructionEvent) -> None:
        if self.per_instruction:
            self._instruction = self._read()

    def on_instruction_end(self, event: InstructionEvent) -> None:
        if not self.per_instruction:
            return
        now, joules = self._read()
        start, start_joules = self._instruction
        self._current.append((event.plan_name, now - start, joules - start_joules))
        self._last_compute_end = now

    def on_step_end(self) -> None:
        now, joules = self._read()
        start, start_joules = self._step
        span_end = self._last_compute_end if self.per_instruction else now
        self.steps.append(StepMeasurement(now - start, joules - start_joules, self._current, span_end - start))


class FrequencyPlanHook(PipelineHook):
    """Runs one stage's frequency plan: before each compute instruction, lock its clock.

    Args:
        device: the GPU whose clock is set.
        plan: ``[(instruction, MHz), ...]`` for one step, in execution order.
        stage: the stage (for messages).

    Raises (during the step):
        PlanMismatchError: an instruction's name differs from the plan's, or the step runs
            more or fewer compute instructions than the plan lists.
    """

    def __init__(self, device: GPUDevice, plan: Sequence[tuple[str, int]], stage: int) -> None:
        self.device, self.plan, self.stage = device, list(plan), stage
        supported = set(device.supported_clocks())
        unsupported = sorted({mhz for _, mhz in self.plan if mhz not in supported})
        if unsupported:
            raise PlanMismatchError(f"stage {stage}'s plan uses clocks {unsupported} MHz that {device.name} does "
                                    "not support")
        self._next = 0

    def on_step_begin(self) -> None:
        self._next = 0

    def on_instruction_begin(self, event: InstructionEvent) -> None:
        if self._next >= len(self.plan):
            raise PlanMismatchError(f"stage {self.stage} runs more compute instructions than its plan's "
                                    f"{len(self.plan)} (the plan was made for fewer microbatches or another "
                                    "schedule)")
        expected, mhz = self.plan[self._next]
        if expected != event.plan_name:
            raise PlanMismatchError(f"stage {self.stage}'s compute instruction #{self._next} is {event.plan_name!r} "
                                    f"(microbatch {event.microbatch}, chunk {event.chunk}) but its plan says "
                                    f"{expected!r} (the plan was made for another schedule)")
        # Work queued before this instruction must finish at the clock it was planned for.
        self.device.synchronize()
        self.device.set_clock(mhz)
        self._next += 1

    def on_step_end(self) -> None:
        if self._next != len(self.plan):
            raise PlanMismatchError(f"stage {self.stage} ran {self._next} compute instructions but its plan lists "
                                    f"{len(self.plan)} (the plan was made for more microbatches or another schedule)")
