"""ZB-H1: 1F1B with each backward split into its input- and weight-gradient halves."""

from __future__ import annotations

from merak.pipeline.instructions import (
    BackwardInput,
    BackwardWeight,
    Forward,
    Instruction,
)
from merak.pipeline.schedules.common import check_pipeline_args
from merak.pipeline.schedules.placement import place_communication


def zb_h1_schedule(stage_id: int, num_stages: int, num_microbatches: int) -> list[Instruction]:
    """Build one stage's ZB-H1 step (zero-bubble pipeline, Qi et al. 2023, at 1F1B's peak memory).

    The input-gradient half of a backward (BackwardInput) is what the previous
    stage waits for, so it runs as soon as its gradient arrives; the
    weight-gradient half (BackwardWeight) may wait. Stage ``s`` keeps up to
    ``s`` weight halves pending: in the steady state it runs ``F, BI`` and the
    oldest pending ``W``; in the drain the pending W fill the time 1F1B spends
    waiting. So every stage holds at most ``S`` microbatches, the peak of
    1F1B's first stage, and with ``F = BI = W`` and ``M >= S`` the step takes
    ``M (F+BI+W) + (S-1)(F+BI-W)`` instead of 1F1B's ``M (F+BI+W) + (S-1)(F+BI+W)``.

    Args:
        stage_id: This stage, ``0 <= stage_id < num_stages``.
        num_stages: Number of pipeline stages S.
        num_microbatches: Number of microbatches M.

    Returns:
        The stage's instructions, ending with the gradient reductions and the optimizer step.
    """
    check_pipeline_args(stage_id, num_stages, num_microbatches)
    warmup = min(num_stages - stage_id - 1, num_microbatches)
    order: list[Instruction] = [Forward(m) for m in range(warmup)]
    pending: list[int] = []
    for m in range(num_microbatches):
        if warmup + m < num_microbatches:
            order.append(Forward(warmup + m))
        order.append(BackwardInput(m))
        pending.append(m)
        while len(pending) > stage_id:
            order.append(BackwardWeight(pending.pop(0)))
    order += [BackwardWeight(m) for m in pending]
    return place_communication(stage_id, num_stages, order)
