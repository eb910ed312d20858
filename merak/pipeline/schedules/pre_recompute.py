"""Merak's early recomputation: the drain bubble of 1F1B is filled with recomputation."""

from __future__ import annotations

from merak.pipeline.instructions import Instruction
from merak.pipeline.schedules.common import check_pipeline_args
from merak.pipeline.schedules.placement import (
    drain_microbatches,
    one_f_one_b_order,
    place_communication,
    pre_checkpoint,
)


def pre_recompute_1f1b_schedule(stage_id: int, num_stages: int, num_microbatches: int) -> list[Instruction]:
    """Build one stage's pre-recompute 1F1B step (``early_recompute_1f1b`` in Merak-Zeus).

    The order is 1F1B's, but the last ``S - s - 1`` microbatches of stage
    ``s`` (those whose backwards come in the drain) run as
    PreCheckpointForward, and each is recomputed with full activations right
    before its backward, while the stage would otherwise wait for the gradient.
    S=4, M=8, stage 0: ``F0 F1 F2 F3 B0 F4 B1 PF5 B2 PF6 B3 PF7 B4 R5 B5 R6 B6 R7 B7``.

    Args:
        stage_id: This stage, ``0 <= stage_id < num_stages``.
        num_stages: Number of pipeline stages S.
        num_microbatches: Number of microbatches M.

    Returns:
        The stage's instructions, ending with the gradient reductions and the optimizer step.
    """
    check_pipeline_args(stage_id, num_stages, num_microbatches)
    order = one_f_one_b_order(stage_id, num_stages, num_microbatches)
    order = pre_checkpoint(order, drain_microbatches(stage_id, num_stages, num_microbatches))
    return place_communication(stage_id, num_stages, order)
