"""DeepSpeed's synchronous 1F1B: 1F1B order with separate blocking sends and receives."""

from __future__ import annotations

from merak.pipeline.instructions import Exchange, Instruction, is_send
from merak.pipeline.schedules.one_f_one_b import one_f_one_b_schedule


def ds_default_schedule(stage_id: int, num_stages: int, num_microbatches: int) -> list[Instruction]:
    """Build one stage's DeepSpeed-style 1F1B training step.

    The compute order is that of 1F1B; each :class:`Exchange` is split into
    its ops as separate blocking instructions. Even stages send first and odd
    stages receive first, so of two neighbours one always sends while the
    other receives, and rendezvous (unbuffered) sends cannot deadlock.

    Args:
        stage_id: This stage, ``0 <= stage_id < num_stages``.
        num_stages: Number of pipeline stages S.
        num_microbatches: Number of microbatches M.

    Returns:
        The stage's instructions, ending with the gradient reductions and the optimizer step.

    Raises:
        ValueError: If the numbers are out of range.
    """
    sends_first = stage_id % 2 == 0
    out: list[Instruction] = []
    for instr in one_f_one_b_schedule(stage_id, num_stages, num_microbatches):
        if isinstance(instr, Exchange):
            # sorted is stable, so ops of the same direction keep their order.
            out.extend(sorted(instr.ops, key=lambda op: is_send(op) != sends_first))
        else:
            out.append(instr)
    return out
