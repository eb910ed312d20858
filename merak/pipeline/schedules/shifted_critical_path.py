"""Merak's shifted critical path: recomputation moved off the pipeline's critical path."""

from __future__ import annotations

from merak.pipeline.instructions import Backward, Forward, Instruction
from merak.pipeline.schedules.common import check_pipeline_args
from merak.pipeline.schedules.placement import (
    drain_microbatches,
    one_f_one_b_order,
    place_communication,
    pre_checkpoint,
)

MIN_MICROBATCHES = 4


def shifted_critical_path_schedule(stage_id: int, num_stages: int, num_microbatches: int) -> list[Instruction]:
    """Build one stage's shifted-critical-path step (the original's "full critical path").

    Needs ``M >= 4`` and ``M >= S``. The last stage runs plain 1F1B without
    checkpointing (the engine gives it none); its gradient sends and the next
    activation receives are separate, so the stage before it is not held up.
    Stage S-2 runs three forwards before its first backward, the first two
    pre-checkpointed and recomputed just before their backwards:
    ``PF0 PF1 F2 R0 B0 R1 B1 F3 B2 ... F(M-1) B(M-2) B(M-1)``. Stage S-3
    pre-checkpoints microbatch 0 and recomputes it before B0; it and the
    stages before it recompute their drain microbatches early, as in
    pre_recompute_1f1b.

    Args:
        stage_id: This stage, ``0 <= stage_id < num_stages``.
        num_stages: Number of pipeline stages S.
        num_microbatches: Number of microbatches M.

    Returns:
        The stage's instructions, ending with the gradient reductions and the optimizer step.

    Raises:
        ValueError: If the numbers are out of range or M is below 4 or below S.
    """
    check_pipeline_args(stage_id, num_stages, num_microbatches)
    if num_microbatches < max(MIN_MICROBATCHES, num_stages):
        raise ValueError(f"shifted_critical_path needs num_microbatches >= max(4, num_stages) = "
                         f"{max(MIN_MICROBATCHES, num_stages)}, got {num_microbatches}")
    last = num_stages - 1
    if stage_id == last:
        return place_communication(stage_id, num_stages, one_f_one_b_order(stage_id, num_stages, num_microbatches))
    if stage_id == last - 1:
        order: list[Instruction] = [Forward(0), Forward(1), Forward(2), Backward(0), Backward(1)]
        for i in range(2, num_microbatches):
            order += ([Forward(i + 1)] if i + 1 < num_microbatches else []) + [Backward(i)]
        return place_communication(stage_id, num_stages, pre_checkpoint(order, (0, 1)))
    early = set(drain_microbatches(stage_id, num_stages, num_microbatches))
    if stage_id == last - 2:
        early.add(0)
    order = one_f_one_b_order(stage_id, num_stages, num_microbatches)
    return place_communication(stage_id, num_stages, pre_checkpoint(order, sorted(early)))
