"""The decode schedule: one stage's instructions for generating a sequence token by token.

Decoding step ``t`` (the instructions' ``microbatch``) feeds the pipeline the positions
that are new at that step (the whole prompt at step 0, then the previous token) and
yields token ``t``::

    first stage    [RecvToken(t-1)]  DecodeForward(t)  SendActivation(t)
    middle stage   RecvActivation(t)  DecodeForward(t)  SendActivation(t)
    last stage     RecvActivation(t)  DecodeForward(t)  PickToken(t)  [SendToken(t)]

The first stage receives token ``t - 1`` from the last stage before step ``t`` (from step
1 on); the last stage sends every token but the final one, which no stage reads. With one
stage the token stays where it was picked: no transfer at all. A step cannot start before
the previous token exists, so the stages take turns: decoding one sequence keeps one
stage busy at a time.

A sequence that ends early (its end-of-sequence token at step ``t``) is cut short at run
time: step ``t + 1`` carries a stop marker through the activation channel instead of
hidden states (see :mod:`merak.pipeline.decode`), and no stage runs further. What the
stages exchange then is exactly this schedule's for ``t + 2`` steps, so a schedule that
passes the simulator for every number of steps is safe however early a sequence ends.

Pure Python, no torch: :func:`merak.pipeline.simulate.simulate` checks these lists with
:func:`validate_decode_list` and pairs their transfers like a training step's.
"""

from __future__ import annotations

from collections.abc import Sequence

from merak.pipeline.instructions import (
    DecodeForward,
    Instruction,
    PickToken,
    RecvActivation,
    RecvToken,
    SendActivation,
    SendToken,
)
from merak.pipeline.validate import ScheduleError, check_pipeline_args

DECODE_LIST_TYPES = (DecodeForward, PickToken, SendToken, RecvToken, SendActivation, RecvActivation)


def decode_step(stage_id: int, num_stages: int, step: int, num_steps: int) -> list[Instruction]:
    """One stage's instructions for decoding step ``step`` of ``num_steps``.

    Args:
        stage_id: This stage, ``0 <= stage_id < num_stages``.
        num_stages: Number of pipeline stages.
        step: The decoding step, ``0 <= step < num_steps``.
        num_steps: Tokens to generate (steps in the whole schedule).

    Returns:
        The step's instructions (see the module docstring).

    Raises:
        ValueError: If the numbers are out of range.
    """
    check_pipeline_args(stage_id, num_stages, num_steps)
    if not 0 <= step < num_steps:
        raise ValueError(f"step must be in [0, {num_steps - 1}], got {step}")
    first, last = stage_id == 0, stage_id == num_stages - 1
    out: list[Instruction] = []
    if first and step > 0 and num_stages > 1:
        out.append(RecvToken(step - 1))
    if not first:
        out.append(RecvActivation(step))
    out.append(DecodeForward(step))
    if not last:
        out.append(SendActivation(step))
    if last:
        out.append(PickToken(step))
        if num_stages > 1 and step < num_steps - 1:
            out.append(SendToken(step))
    return out


def decode_schedule(stage_id: int, num_stages: int, num_steps: int) -> list[Instruction]:
    """One stage's instructions for generating ``num_steps`` tokens: every :func:`decode_step` in order."""
    return [instr for step in range(num_steps) for instr in decode_step(stage_id, num_stages, step, num_steps)]


def validate_decode_list(stage_id: int, num_stages: int, num_steps: int, instructions: Sequence[Instruction]) -> None:
    """Check one stage's decoding list on its own (the simulator pairs the stages' transfers).

    Per step: one DecodeForward, steps in order (the KV cache grows one step after the
    other); on all but the first stage the step's RecvActivation before it; on all but the
    last its SendActivation after it; on the last stage its PickToken after it and, with
    several stages and before the final step, its SendToken after that; on the first
    stage, with several stages, token ``t - 1``'s RecvToken before step ``t``'s
    DecodeForward (and after step ``t - 1``'s). Chunks are always 0.

    Raises:
        ValueError: If the pipeline shape itself is impossible.
        ScheduleError: On the first problem found; the message names the stage, the
            instruction and the step.
    """
    check_pipeline_args(stage_id, num_stages, num_steps)
    first, last = stage_id == 0, stage_id == num_stages - 1
    where: dict[tuple[type, int], list[int]] = {}
    for index, instr in enumerate(instructions):
        if not isinstance(instr, DECODE_LIST_TYPES):
            raise ScheduleError(f"stage {stage_id}: instruction #{index} {instr!r} has no place in a decoding list")
        if instr.chunk != 0:
            raise ScheduleError(f"stage {stage_id}: instruction #{index} {instr!r} names a chunk; decoding runs "
                                f"one chunk per stage")
        if not 0 <= instr.microbatch < num_steps:
            raise ScheduleError(f"stage {stage_id}: instruction #{index} {instr!r} has a step outside "
                                f"[0, {num_steps - 1}]")
        where.setdefault((type(instr), instr.microbatch), []).append(index)

    def find(kind: type, step: int, needed: bool) -> int | None:
        found = where.get((kind, step), [])
        if len(found) != int(needed):
            wanted = "exactly one" if needed else "no"
            raise ScheduleError(f"stage {stage_id}: expected {wanted} {kind(step)!r}, found {len(found)} (at {found})")
        return found[0] if found else None

    def before(earlier: int | None, later: int | None, what: str) -> None:
        if earlier is not None and later is not None and not earlier < later:
            raise ScheduleError(f"stage {stage_id}: {what} (they are instructions #{earlier} and #{later})")

    previous_forward = None
    for step in range(num_steps):
        forward = find(DecodeForward, step, True)
        before(previous_forward, forward, f"DecodeForward({step - 1}) must come before DecodeForward({step})")
        before(find(RecvActivation, step, not first), forward,
               f"RecvActivation({step}) must come before DecodeForward({step})")
        before(forward, find(SendActivation, step, not last),
               f"SendActivation({step}) must follow DecodeForward({step})")
        pick = find(PickToken, step, last)
        before(forward, pick, f"PickToken({step}) must follow DecodeForward({step})")
        before(pick, find(SendToken, step, last and num_stages > 1 and step < num_steps - 1),
               f"SendToken({step}) must follow PickToken({step})")
        received = find(RecvToken, step - 1, first and num_stages > 1) if step > 0 else None
        before(previous_forward, received, f"RecvToken({step - 1}) must follow DecodeForward({step - 1})")
        before(received, forward, f"RecvToken({step - 1}) must come before DecodeForward({step})")
        previous_forward = forward
    find(RecvToken, num_steps - 1, False)  # the final token is never sent
