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
from merak.pipeline.validate import check_pipeline_args  # noqa: F401  (the schedules check shapes with it)


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
