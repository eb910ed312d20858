"""GPipe: every forward of the step, then every backward (fill, drain, no interleaving)."""

from __future__ import annotations

from merak.pipeline.instructions import Instruction
from merak.pipeline.schedules.common import (
    backward_run,
    check_pipeline_args,
    end_of_step,
    forward_run,
)


def gpipe_schedule(stage_id: int, num_stages: int, num_microbatches: int) -> list[Instruction]:
    """Build one stage's GPipe training step.

    All forwards 0..M-1 run first, then all backwards in the same order, so a
    stage keeps the activations of all M microbatches alive at the peak.
    Point-to-point traffic uses separate blocking instructions.

    Args:
        stage_id: This stage, ``0 <= stage_id < num_stages``.
        num_stages: Number of pipeline stages S.
        num_microbatches: Number of microbatches M.

    Returns:
        The stage's instructions, ending with the gradient reductions and the optimizer step.

    Raises:
        ValueError: If the numbers are out of range.
    """
    check_pipeline_args(stage_id, num_stages, num_microbatches)
    first, last = stage_id == 0, stage_id == num_stages - 1
    out: list[Instruction] = []
    for m in range(num_microbatches):
        out += forward_run(m, first=first, last=last)
    for m in range(num_microbatches):
        out += backward_run(m, first=first, last=last)
    return out + end_of_step()
