"""Check one stage's instruction list on its own (pairing across stages is the simulator's job)."""

from __future__ import annotations

from collections.abc import Sequence

from merak.pipeline.instructions import (
    INSTRUCTION_TYPES,
    MICROBATCH_TYPES,
    P2P_TYPES,
    Backward,
    BackwardInput,
    BackwardWeight,
    Exchange,
    Forward,
    Instruction,
    LoadMicrobatch,
    OptimizerStep,
    PreCheckpointForward,
    RecomputeForward,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    p2p_ops,
    peer_offset,
    virtual_stage,
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


class ScheduleError(ValueError):
    """A schedule is malformed, pairs the wrong microbatches, or deadlocks."""


def _positions(stage_id: int, num_stages: int, num_microbatches: int, num_chunks: int,
               instructions: Sequence[Instruction]):
    """Index every microbatch-bearing op by (type, chunk, microbatch); check types, ranges and peers."""
    where: dict[tuple[type, int, int], list[int]] = {}
    others: dict[type, list[int]] = {}
    chain = num_chunks * num_stages
    for idx, instr in enumerate(instructions):
        if not isinstance(instr, INSTRUCTION_TYPES):
            raise ScheduleError(f"stage {stage_id}: instruction #{idx} {instr!r} is not an instruction")
        if isinstance(instr, Exchange) and (not instr.ops or not all(isinstance(op, P2P_TYPES) for op in instr.ops)):
            raise ScheduleError(
                f"stage {stage_id}: instruction #{idx} {instr!r} must hold one or more point-to-point ops")
        items = p2p_ops(instr) or ((instr,) if isinstance(instr, MICROBATCH_TYPES) else ())
        if not items:
            others.setdefault(type(instr), []).append(idx)
        for item in items:
            if not 0 <= item.chunk < num_chunks:
                raise ScheduleError(f"stage {stage_id}: instruction #{idx} {item!r} has chunk outside "
                                    f"[0, {num_chunks - 1}]")
            if isinstance(item, P2P_TYPES):
                peer = virtual_stage(stage_id, item.chunk, num_stages) + peer_offset(item)
                if not 0 <= peer < chain:
                    raise ScheduleError(
                        f"stage {stage_id}: instruction #{idx} {item!r} talks to non-existent virtual stage "
                        f"{peer} (num_stages={num_stages}, chunks={num_chunks})")
            if not 0 <= item.microbatch < num_microbatches:
                raise ScheduleError(f"stage {stage_id}: instruction #{idx} {item!r} has microbatch outside "
                                    f"[0, {num_microbatches - 1}]")
            where.setdefault((type(item), item.chunk, item.microbatch), []).append(idx)
    return where, others


def validate_stage_list(stage_id: int, num_stages: int, num_microbatches: int,
                        instructions: Sequence[Instruction], training: bool = True, num_chunks: int = 1) -> None:
    """Check one stage's list on its own.

    Per chunk and microbatch: one forward (Forward, or PreCheckpointForward
    followed by one RecomputeForward), one backward (Backward, or BackwardInput
    then BackwardWeight) when training, and the loads, receives and sends its
    position in the chain needs, each in a possible order.

    Args:
        stage_id: The stage the list belongs to.
        num_stages: Number of pipeline stages (ranks).
        num_microbatches: Number of microbatches per step.
        instructions: The stage's instructions in execution order.
        training: Whether the list is a training step (backward and optimizer
            step required) or forward-only.
        num_chunks: Model chunks per stage (virtual stages per rank).

    Raises:
        ValueError: If the pipeline shape itself is impossible.
        ScheduleError: On the first structural problem found; the message names
            the stage, the instruction and the microbatch.
    """
    check_pipeline_args(stage_id, num_stages, num_microbatches)
    where, others = _positions(stage_id, num_stages, num_microbatches, num_chunks, instructions)

    def find(kind: type, c: int, m: int, allowed: tuple[int, ...]) -> int | None:
        found = where.get((kind, c, m), [])
        if len(found) not in allowed:
            wanted = " or ".join({0: "no", 1: "exactly one"}[n] for n in allowed)
            raise ScheduleError(f"stage {stage_id}: expected {wanted} {kind(m, c)!r}, found {len(found)} "
                                f"(at {found})")
        return found[0] if found else None

    def order(first_kind: type, i: int | None, then_kind: type, j: int | None, c: int, m: int) -> None:
        if i is not None and j is not None and not i < j:
            raise ScheduleError(f"stage {stage_id}: {first_kind(m, c)!r} (#{i}) must come before "
                                f"{then_kind(m, c)!r} (#{j})")

    chain_end = num_chunks * num_stages - 1
    for c in range(num_chunks):
        v = virtual_stage(stage_id, c, num_stages)
        first, last = v == 0, v == chain_end
        for m in range(num_microbatches):
            plain = find(Forward, c, m, (0, 1))
            pre = find(PreCheckpointForward, c, m, (0, 1) if training else (0,))
            if (plain is None) == (pre is None):
                raise ScheduleError(f"stage {stage_id}: microbatch {m} (chunk {c}) needs exactly one of "
                                    f"Forward and PreCheckpointForward")
            fwd_kind, fwd = (Forward, plain) if pre is None else (PreCheckpointForward, pre)
            recompute = find(RecomputeForward, c, m, (1,) if pre is not None else (0,))
            order(PreCheckpointForward, pre, RecomputeForward, recompute, c, m)
            whole = find(Backward, c, m, (0, 1) if training else (0,))
            half = find(BackwardInput, c, m, (0, 1) if training else (0,))
            weight = find(BackwardWeight, c, m, (1,) if half is not None else (0,))
            if training and (whole is None) == (half is None):
                raise ScheduleError(f"stage {stage_id}: microbatch {m} (chunk {c}) needs exactly one of "
                                    f"Backward and BackwardInput+BackwardWeight")
            bwd_kind, bwd = (Backward, whole) if half is None else (BackwardInput, half)
            order(fwd_kind, fwd, bwd_kind, bwd, c, m)
            order(RecomputeForward, recompute, bwd_kind, bwd, c, m)
            order(BackwardInput, half, BackwardWeight, weight, c, m)
            order(LoadMicrobatch, find(LoadMicrobatch, c, m, (1,) if first or last else (0,)), fwd_kind, fwd, c, m)
            order(RecvActivation, find(RecvActivation, c, m, (0,) if first else (1,)), fwd_kind, fwd, c, m)
            order(fwd_kind, fwd, SendActivation, find(SendActivation, c, m, (0,) if last else (1,)), c, m)
            order(RecvGrad, find(RecvGrad, c, m, (1,) if training and not last else (0,)), bwd_kind, bwd, c, m)
            order(bwd_kind, bwd, SendGrad, find(SendGrad, c, m, (1,) if training and not first else (0,)), c, m)

    steps = others.get(OptimizerStep, [])
    if training and steps != [len(instructions) - 1]:
        raise ScheduleError(
            f"stage {stage_id}: a training step needs exactly one OptimizerStep() as the last "
            f"instruction, found it at {steps} of {len(instructions)}")
    if not training and steps:
        raise ScheduleError(f"stage {stage_id}: forward-only list has OptimizerStep() at {steps}")
