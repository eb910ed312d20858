"""Merak's 1F1B where the last stage never checkpoints and the others recompute early."""

from __future__ import annotations

from merak.pipeline.instructions import Instruction
from merak.pipeline.schedules.common import check_pipeline_args
from merak.pipeline.schedules.placement import (
    drain_microbatches,
    one_f_one_b_order,
    place_communication,
    pre_checkpoint,
)


def last_no_recompute_1f1b_schedule(stage_id: int, num_stages: int, num_microbatches: int) -> list[Instruction]:
    """Build one stage's last-no-recompute 1F1B step.

    The last stage keeps full activations (the engine gives it no
    checkpointing), so the critical path through it has no recomputation.
    Other stages recompute their drain microbatches early, as in
    pre_recompute_1f1b, and stage S-2 also pre-checkpoints microbatch 0 and
    recomputes it while the last stage runs F0 and B0.

    Args:
        stage_id: This stage, ``0 <= stage_id < num_stages``.
        num_stages: Number of pipeline stages S.
        num_microbatches: Number of microbatches M.

    Returns:
        The stage's instructions, ending with the gradient reductions and the optimizer step.
    """
    check_pipeline_args(stage_id, num_stages, num_microbatches)
    order = one_f_one_b_order(stage_id, num_stages, num_microbatches)
    if stage_id == num_stages - 1:
        return place_communication(stage_id, num_stages, order)
    early = set(drain_microbatches(stage_id, num_stages, num_microbatches))
    if stage_id == num_stages - 2:
        early.add(0)
    return place_communication(stage_id, num_stages, pre_checkpoint(order, sorted(early)))
