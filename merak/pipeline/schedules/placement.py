"""From a stage's compute order to its full instruction list.

The Merak, interleaved and zero-bubble schedules are written as compute orders
(which forward, recompute and backward runs when); this module adds the data
loads, receives and sends around them. A receive comes right before the
compute that needs it and a send right after the compute that produced it;
sends are posted and complete in the background, so a stage blocks only when
it truly waits for a neighbour.
"""

from __future__ import annotations

from collections.abc import Sequence

from merak.pipeline.instructions import (
    Backward,
    BackwardInput,
    Forward,
    Instruction,
    LoadMicrobatch,
    PreCheckpointForward,
    RecomputeForward,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    virtual_stage,
)
from merak.pipeline.schedules.common import end_of_step


def place_communication(stage_id: int, num_stages: int, compute: Sequence[Instruction],
                        num_chunks: int = 1) -> list[Instruction]:
    """Surround each compute instruction with the loads, receives and sends it implies.

    Args:
        stage_id: This stage.
        num_stages: Number of stages (ranks).
        compute: The stage's compute instructions in execution order.
        num_chunks: Model chunks per stage.

    Returns:
        The stage's instruction list, ending with the gradient reductions and the optimizer step.
    """
    chain_end = num_chunks * num_stages - 1
    out: list[Instruction] = []
    for instr in compute:
        v = virtual_stage(stage_id, instr.chunk, num_stages)
        first, last = v == 0, v == chain_end
        m, c = instr.microbatch, instr.chunk
        if isinstance(instr, (Forward, PreCheckpointForward)):
            out += [] if first else [RecvActivation(m, c)]
            out += [LoadMicrobatch(m, c)] if first or last else []
            out.append(instr)
            out += [] if last else [SendActivation(m, c)]
        elif isinstance(instr, (Backward, BackwardInput)):
            out += [] if last else [RecvGrad(m, c)]
            out.append(instr)
            out += [] if first else [SendGrad(m, c)]
        else:
            out.append(instr)
    return out + end_of_step()


def one_f_one_b_order(stage_id: int, num_stages: int, num_microbatches: int) -> list[Instruction]:
    """The compute order of 1F1B: S-s-1 warm-up forwards, one forward one backward, then the drain."""
    warmup = min(num_stages - stage_id - 1, num_microbatches)
    order: list[Instruction] = [Forward(m) for m in range(warmup)]
    for i in range(num_microbatches - warmup):
        order += [Forward(warmup + i), Backward(i)]
    order += [Backward(i) for i in range(num_microbatches - warmup, num_microbatches)]
    return order


def pre_checkpoint(order: Sequence[Instruction], microbatches) -> list[Instruction]:
    """Turn the forwards of ``microbatches`` into PreCheckpointForward and recompute each right
    before its backward (so before the stage blocks on that backward's gradient)."""
    chosen = set(microbatches)
    out: list[Instruction] = []
    for instr in order:
        if isinstance(instr, Forward) and instr.microbatch in chosen:
            out.append(PreCheckpointForward(instr.microbatch, instr.chunk))
            continue
        if isinstance(instr, (Backward, BackwardInput)) and instr.microbatch in chosen:
            out.append(RecomputeForward(instr.microbatch, instr.chunk))
        out.append(instr)
    return out


def drain_microbatches(stage_id: int, num_stages: int, num_microbatches: int) -> range:
    """The last S-s-1 microbatches: those whose backwards fall in the 1F1B drain of stage s."""
    count = min(num_stages - stage_id - 1, num_microbatches)
    return range(num_microbatches - count, num_microbatches)
