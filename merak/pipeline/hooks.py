"""Listeners the executor calls around each step and compute instruction.

Around every compute instruction the executor calls ``on_instruction_begin(event)`` and
``on_instruction_end(event)`` with an :class:`InstructionEvent`: which instruction it is
(its name, stage, chunk and microbatch), in which step, and how much work it does (FLOPs).
Listeners need nothing else from the executor. Timers, the profiler, memory meters and
energy plans are all listeners of this kind.

The names are "forward" (also for pre-checkpoint forwards) and "backward", the ones zeus's
PipelineFrequencyOptimizer expects, plus "recompute", "backward_input" and
"backward_weight" for the instructions only Merak's and the zero-bubble schedules use
(merak.pipeline.instructions.INSTRUCTION_NAMES). Callbacks written for zeus's name-only
protocol are adapted in :mod:`merak.energy.zeus_client`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from merak.pipeline import instructions as ins

# The work of each compute instruction in forwards of the same chunk: a backward computes the
# gradients of the inputs and of the weights, each about one forward's work.
FORWARDS_PER_INSTRUCTION = {"forward": 1, "recompute": 1, "backward": 2, "backward_input": 1, "backward_weight": 1}
# The instructions whose autograd pass meets checkpointed parts first and runs their forward again.
RECOMPUTING_INSTRUCTIONS = ("backward", "backward_input")


@dataclass(frozen=True)
class InstructionEvent:
    """One compute instruction of one stage, as listeners see it.

    Attributes:
        name: "forward", "recompute", "backward", "backward_input" or "backward_weight".
        stage: the pipeline stage (rank position in the pipeline) that runs it.
        chunk: the model chunk it runs (0 without interleaving).
        microbatch: the microbatch it runs on.
        step: the index of the step being run (the optimizer step it belongs to).
        flops: its floating-point operations: the chunk's forward FLOPs for one microbatch times
            ``FORWARDS_PER_INSTRUCTION[name]``, and for the backward (or its input half) of a chunk
            checkpointing parts of its forward (``activation_checkpointing``), the forward FLOPs of
            those parts, which it runs again. The chunk's first forward counts them, so they
            are None when that forward begins (and on a chunk no plain forward has run yet).
        instruction: the schedule's instruction object (tells a pre-checkpoint forward from a plain one).
    """

    name: str
    stage: int
    chunk: int
    microbatch: int
    step: int
    flops: int | None
    instruction: ins.Instruction

    @property
    def plan_name(self) -> str:
        """The name energy profiles and plans use (:func:`merak.pipeline.instructions.plan_name`)."""
        return ins.plan_name(self.instruction)

    @classmethod
    def of(cls, instruction: ins.Instruction, *, stage: int, step: int,
           chunk_forward_flops: int | None, chunk_recomputed_flops: int = 0) -> InstructionEvent:
        """The event of compute ``instruction``, given the forward FLOPs of its chunk (None: not counted yet)
        and those of its checkpointed parts."""
        name = ins.INSTRUCTION_NAMES[type(instruction)]
        flops = None if chunk_forward_flops is None else FORWARDS_PER_INSTRUCTION[name] * chunk_forward_flops \
            + (chunk_recomputed_flops if name in RECOMPUTING_INSTRUCTIONS else 0)
        return cls(name=name, stage=stage, chunk=instruction.chunk, microbatch=instruction.microbatch, step=step,
                   flops=flops, instruction=instruction)


class PipelineHook:
    """Base class with no-op callbacks; override the ones you need."""

    def on_step_begin(self) -> None:
        """Called before the first instruction of a step."""

    def on_step_end(self) -> None:
        """Called after the last instruction of a step."""

    def on_instruction_begin(self, event: InstructionEvent) -> None:
        """Called before a compute instruction."""

    def on_instruction_end(self, event: InstructionEvent) -> None:
        """Called after a compute instruction (``event.flops`` is known by then)."""


class HookList(PipelineHook):
    """Fans every callback out to several hooks, in order."""

    def __init__(self, hooks: Sequence[PipelineHook] = ()) -> None:
        self.hooks = list(hooks)

    def on_step_begin(self) -> None:
        for hook in self.hooks:
            hook.on_step_begin()

    def on_step_end(self) -> None:
        for hook in self.hooks:
            hook.on_step_end()

    def on_instruction_begin(self, event: InstructionEvent) -> None:
        for hook in self.hooks:
            hook.on_instruction_begin(event)

    def on_instruction_end(self, event: InstructionEvent) -> None:
        for hook in self.hooks:
            hook.on_instruction_end(event)
