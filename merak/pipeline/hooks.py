"""Listeners the executor calls around each step and compute instruction.

The names passed to ``on_instruction_begin``/``on_instruction_end`` are
"forward" (also for pre-checkpoint forwards) and "backward", the ones zeus's
PipelineFrequencyOptimizer expects, plus "recompute", "backward_input" and
"backward_weight" for the instructions only Merak's and the zero-bubble
schedules use (merak.pipeline.instructions.INSTRUCTION_NAMES). Timers, the
profiler and energy plans are all listeners of this kind.
"""

from __future__ import annotations

from collections.abc import Sequence


class PipelineHook:
    """Base class with no-op callbacks; override the ones you need."""

    def on_step_begin(self) -> None:
        """Called before the first instruction of a step."""

    def on_step_end(self) -> None:
        """Called after the last instruction of a step."""

    def on_instruction_begin(self, name: str) -> None:
        """Called before a compute instruction (``name`` as described in the module docstring)."""

    def on_instruction_end(self, name: str) -> None:
        """Called after a compute instruction."""


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

    def on_instruction_begin(self, name: str) -> None:
        for hook in self.hooks:
            hook.on_instruction_begin(name)

    def on_instruction_end(self, name: str) -> None:
        for hook in self.hooks:
            hook.on_instruction_end(name)
