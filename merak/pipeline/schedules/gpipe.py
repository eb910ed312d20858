"""GPipe: every forward of the step, then every backward (fill, drain, no interleaving)."""

from __future__ import annotations

from merak.pipeline.instructions import (
    Backward,
    Forward,
    Instruction,
    LoadMicrobatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
)
from merak.pipeline.simulate import check_pipeline_args


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
        if not first:
            out.append(RecvActivation(m))
        if first or last:
            out.append(LoadMicrobatch(m))
        out.append(Forward(m))
        if not last:
            out.append(SendActivation(m))
    for m in range(num_microbatches):
        if not last:
            out.append(RecvGrad(m))
        out.append(Backward(m))
        if not first:
            out.append(SendGrad(m))
    out += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
    return out
