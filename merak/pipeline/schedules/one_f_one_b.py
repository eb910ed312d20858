"""1F1B with batched point-to-point exchanges (Megatron-LM's non-interleaved schedule)."""

from __future__ import annotations

from merak.pipeline.instructions import (
    Backward,
    Exchange,
    Forward,
    Instruction,
    LoadMicrobatch,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
)
from merak.pipeline.schedules.common import (
    backward_run,
    check_pipeline_args,
    end_of_step,
    forward_run,
)


def one_f_one_b_schedule(stage_id: int, num_stages: int, num_microbatches: int) -> list[Instruction]:
    """Build one stage's 1F1B training step.

    Stage ``s`` runs ``W = min(S - s - 1, M)`` warm-up forwards, then
    alternates one forward and one backward, then drains the remaining
    backwards, so at most ``W + 1`` microbatches are in flight. In the steady
    state the activation send and the gradient receive with the next stage
    (and the gradient send and next activation receive with the previous
    stage) are one :class:`Exchange` each, which cannot deadlock whatever the
    order in which neighbours post them.

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
    load = first or last
    warmup = min(num_stages - stage_id - 1, num_microbatches)
    steady = num_microbatches - warmup
    out: list[Instruction] = []
    for m in range(warmup):
        out += forward_run(m, first=first, last=last)
    if steady > 0 and not first:
        out.append(RecvActivation(warmup))
    for i in range(steady):
        m = warmup + i
        if load:
            out.append(LoadMicrobatch(m))
        out.append(Forward(m))
        if not last:
            out.append(Exchange((SendActivation(m), RecvGrad(i))))
        out.append(Backward(i))
        if not first:
            # The last steady backward has no further forward to receive for.
            if i == steady - 1:
                out.append(SendGrad(i))
            else:
                out.append(Exchange((SendGrad(i), RecvActivation(m + 1))))
    for i in range(steady, num_microbatches):
        out += backward_run(i, first=first, last=last)
    out += end_of_step()
    return out
