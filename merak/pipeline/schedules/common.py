"""Pieces every schedule shares: argument checks and the per-microbatch instruction runs."""

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


def check_pipeline_args(stage_id: int, num_stages: int, num_microbatches: int) -> None:
    """Reject impossible pipeline shapes.

    Args:
        stage_id: Stage index, ``0 <= stage_id < num_stages``.
        num_stages: Number of pipeline stages, at least 1.
        num_microbatches: Number of microbatches per step, at least 1.

    Raises:
        ValueError: If a number is not an int or out of range; the message quotes the numbers.
    """
    values = {"stage_id": stage_id, "num_stages": num_stages, "num_microbatches": num_microbatches}
    for name, value in values.items():
        # bool is an int subclass; True stages is surely a caller bug.
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if not 0 <= stage_id < num_stages:
        raise ValueError(f"stage_id must be in [0, {num_stages - 1}] for num_stages={num_stages}, got {stage_id}")


def forward_run(microbatch: int, *, first: bool, last: bool) -> list[Instruction]:
    """Receive the input (unless first), load data (first/last), forward, send the output (unless last)."""
    run: list[Instruction] = []
    if not first:
        run.append(RecvActivation(microbatch))
    if first or last:
        run.append(LoadMicrobatch(microbatch))
    run.append(Forward(microbatch))
    if not last:
        run.append(SendActivation(microbatch))
    return run


def backward_run(microbatch: int, *, first: bool, last: bool) -> list[Instruction]:
    """Receive the output gradient (unless last), backward, send the input gradient (unless first)."""
    run: list[Instruction] = []
    if not last:
        run.append(RecvGrad(microbatch))
    run.append(Backward(microbatch))
    if not first:
        run.append(SendGrad(microbatch))
    return run


def end_of_step() -> list[Instruction]:
    """Tied-weight and data-parallel gradient reductions, then the optimizer step."""
    return [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
