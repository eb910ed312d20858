"""Simulate and validate the instruction lists of all pipeline stages together.

The simulator is an event model of one training (or inference) step. Each
stage runs its list in order. Compute and other instructions occupy the stage
for their cost. A point-to-point instruction (a bare op or an
:class:`~merak.pipeline.instructions.Exchange`) posts all its ops when the
stage reaches it and blocks the stage until every op has met its partner on
the neighbouring stage. Partners are paired first-in first-out per channel
(sender stage, receiver stage, activation or gradient), which is what NCCL and
gloo do for tagless point-to-point traffic, so a schedule that passes here
cannot pair the wrong tensors at run time.

Bare ops are modelled as rendezvous (a send waits for the receive), the most
conservative reading of a blocking send: a schedule that is deadlock-free here
is deadlock-free whatever buffering the backend provides.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from merak.pipeline.instructions import (
    COMPUTE_TYPES,
    INSTRUCTION_TYPES,
    MICROBATCH_TYPES,
    P2P_TYPES,
    Backward,
    Exchange,
    Forward,
    Instruction,
    LoadMicrobatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    is_send,
    matching_op,
    p2p_ops,
    peer_offset,
)
from merak.pipeline.schedules.common import check_pipeline_args


class ScheduleError(ValueError):
    """A schedule is malformed, pairs the wrong microbatches, or deadlocks."""


class CostModel(Protocol):
    """Anything that prices an instruction of a stage (e.g. measured per-stage costs)."""

    def of(self, stage_id: int, instruction: Instruction) -> float:
        """Return the duration of ``instruction`` on stage ``stage_id``."""
        ...


@dataclass(frozen=True)
class Costs:
    """Uniform instruction costs, the same on every stage.

    Attributes:
        forward: Duration of one Forward.
        backward: Duration of one Backward.
        p2p: Duration of one point-to-point instruction or Exchange, counted
            from the moment both partners of an op have been posted.
        other: Duration of LoadMicrobatch, ReduceTiedGrads, ReduceGrads and
            OptimizerStep.
    """

    forward: float = 1.0
    backward: float = 1.0
    p2p: float = 0.0
    other: float = 0.0

    def of(self, stage_id: int, instruction: Instruction) -> float:
        """Return the duration of ``instruction`` (the same on every stage).

        Args:
            stage_id: The stage running the instruction (unused: costs are uniform).
            instruction: The instruction to price.

        Returns:
            Its duration in the model's time unit.
        """
        del stage_id
        if isinstance(instruction, Forward):
            return self.forward
        if isinstance(instruction, Backward):
            return self.backward
        if isinstance(instruction, (Exchange,) + P2P_TYPES):
            return self.p2p
        return self.other


@dataclass(frozen=True)
class TimelineEvent:
    """One instruction of one stage, placed in simulated time."""

    stage: int
    instruction: Instruction
    start: float
    end: float


@dataclass(frozen=True)
class SimulationResult:
    """Outcome of :func:`simulate`.

    Attributes:
        makespan: End time of the last instruction of any stage.
        busy: Per stage, the total Forward and Backward time.
        bubble_fraction: ``1 - sum(busy) / (S * span)`` where ``span`` runs
            from the first compute start to the last compute end of all
            stages, so zero-cost bookkeeping does not count as bubble.
        timeline: Every instruction of every stage, stage by stage in program order.
    """

    makespan: float
    busy: tuple[float, ...]
    bubble_fraction: float
    timeline: tuple[TimelineEvent, ...]


def _positions(stage_id: int, num_stages: int, num_microbatches: int, instructions: Sequence[Instruction]):
    """Index every microbatch-bearing op by (type, microbatch); check types, ranges and peers."""
    where: dict[tuple[type, int], list[int]] = {}
    others: dict[type, list[int]] = {}
    for idx, instr in enumerate(instructions):
        if not isinstance(instr, INSTRUCTION_TYPES):
            raise ScheduleError(f"stage {stage_id}: instruction #{idx} {instr!r} is not an instruction")
        if isinstance(instr, Exchange):
            if not instr.ops or not all(isinstance(op, P2P_TYPES) for op in instr.ops):
                raise ScheduleError(
                    f"stage {stage_id}: instruction #{idx} {instr!r} must hold one or more point-to-point ops"
                )
            if len({peer_offset(op) for op in instr.ops}) > 1:
                raise ScheduleError(f"stage {stage_id}: instruction #{idx} {instr!r} mixes both neighbours")
        items = p2p_ops(instr) or ((instr,) if isinstance(instr, MICROBATCH_TYPES) else ())
        if not items:
            others.setdefault(type(instr), []).append(idx)
        for item in items:
            if isinstance(item, P2P_TYPES):
                peer = stage_id + peer_offset(item)
                if not 0 <= peer < num_stages:
                    raise ScheduleError(
                        f"stage {stage_id}: instruction #{idx} {item!r} talks to non-existent stage {peer} "
                        f"(num_stages={num_stages})"
                    )
            if not 0 <= item.microbatch < num_microbatches:
                raise ScheduleError(
                    f"stage {stage_id}: instruction #{idx} {item!r} has microbatch outside "
                    f"[0, {num_microbatches - 1}]"
                )
            where.setdefault((type(item), item.microbatch), []).append(idx)
    return where, others


def validate_stage_list(
    stage_id: int,
    num_stages: int,
    num_microbatches: int,
    instructions: Sequence[Instruction],
    training: bool = True,
) -> None:
    """Check one stage's list on its own (pairing across stages is :func:`simulate`'s job).

    Args:
        stage_id: The stage the list belongs to.
        num_stages: Number of pipeline stages.
        num_microbatches: Number of microbatches per step.
        instructions: The stage's instructions in execution order.
        training: Whether the list is a training step (backward and optimizer
            step required) or forward-only.

    Raises:
        ValueError: If the pipeline shape itself is impossible.
        ScheduleError: On the first structural problem found; the message names
            the stage, the instruction and the microbatch.
    """
    check_pipeline_args(stage_id, num_stages, num_microbatches)
    first, last = stage_id == 0, stage_id == num_stages - 1
    where, others = _positions(stage_id, num_stages, num_microbatches, instructions)

    def one(kind: type, m: int, required: bool) -> int | None:
        found = where.get((kind, m), [])
        expected = 1 if required else 0
        if len(found) != expected:
            raise ScheduleError(
                f"stage {stage_id}: expected {'exactly one' if required else 'no'} {kind(m)!r}, "
                f"found {len(found)} (at {found})"
            )
        return found[0] if found else None

    def order(earlier: type, later: type, m: int, i: int | None, j: int | None) -> None:
        if i is not None and j is not None and not i < j:
            raise ScheduleError(
                f"stage {stage_id}: {earlier(m)!r} (#{i}) must come before {later(m)!r} (#{j})"
            )

    for m in range(num_microbatches):
        fwd = one(Forward, m, True)
        bwd = one(Backward, m, training)
        order(Forward, Backward, m, fwd, bwd)
        order(LoadMicrobatch, Forward, m, one(LoadMicrobatch, m, first or last), fwd)
        order(RecvActivation, Forward, m, one(RecvActivation, m, not first), fwd)
        order(Forward, SendActivation, m, fwd, one(SendActivation, m, not last))
        order(RecvGrad, Backward, m, one(RecvGrad, m, training and not last), bwd)
        order(Backward, SendGrad, m, bwd, one(SendGrad, m, training and not first))

    steps = others.get(OptimizerStep, [])
    if training and steps != [len(instructions) - 1]:
        raise ScheduleError(
            f"stage {stage_id}: a training step needs exactly one OptimizerStep() as the last "
            f"instruction, found it at {steps} of {len(instructions)}"
        )
    if not training and steps:
        raise ScheduleError(f"stage {stage_id}: forward-only list has OptimizerStep() at {steps}")


def _channel(stage_id: int, op) -> tuple[int, int, str]:
    """(sender, receiver, kind) of the FIFO queue that ``op`` on ``stage_id`` joins."""
    peer = stage_id + peer_offset(op)
    kind = "activation" if isinstance(op, (SendActivation, RecvActivation)) else "grad"
    return (stage_id, peer, kind) if is_send(op) else (peer, stage_id, kind)


@dataclass
class _Posted:
    """One posted op waiting in (or matched in) its channel queue."""

    stage: int
    index: int
    op: object
    time: float


def simulate(schedules: Sequence[Sequence[Instruction]], costs: CostModel | None = None) -> SimulationResult:
    """Run the stage lists of one step together and time them.

    Args:
        schedules: ``schedules[s]`` is stage ``s``'s instruction list.
        costs: Prices instructions; any object with ``of(stage_id, instruction)``.
            Defaults to :class:`Costs` ``()`` (unit compute, free p2p and bookkeeping).

    Returns:
        The timing of every instruction and the derived makespan, busy times
        and bubble fraction.

    Raises:
        ScheduleError: If a list is malformed, two paired ops carry different
            microbatches, or the stages deadlock (the message lists every
            unfinished stage and the instruction it is blocked on).
    """
    costs = Costs() if costs is None else costs
    lists = [list(stage) for stage in schedules]
    num_stages = len(lists)
    if num_stages == 0:
        raise ScheduleError("no stages to simulate")
    microbatches = [
        item.microbatch
        for stage in lists
        for instr in stage
        for item in (p2p_ops(instr) or (instr,))
        if isinstance(item, MICROBATCH_TYPES)
    ]
    if not microbatches:
        raise ScheduleError("no microbatch instructions in any stage")
    # Microbatch ids are 0..M-1, so the largest id fixes M; validation reports gaps.
    num_microbatches = max(max(microbatches) + 1, 1)
    training = any(isinstance(instr, (Backward, OptimizerStep)) for stage in lists for instr in stage)
    for s, stage in enumerate(lists):
        validate_stage_list(s, num_stages, num_microbatches, stage, training=training)

    # channel -> (posted sends, posted receives); the k-th of each pair up.
    queues: dict[tuple[int, int, str], tuple[list[_Posted], list[_Posted]]] = {}
    pc = [0] * num_stages
    clock = [0.0] * num_stages
    waiting: list[list[tuple[list[_Posted], int]] | None] = [None] * num_stages
    events: list[list[TimelineEvent]] = [[] for _ in range(num_stages)]

    def post(s: int, idx: int, op) -> tuple[list[_Posted], int]:
        sends, recvs = queues.setdefault(_channel(s, op), ([], []))
        mine, theirs = (sends, recvs) if is_send(op) else (recvs, sends)
        k = len(mine)
        mine.append(_Posted(s, idx, op, clock[s]))
        if k < len(theirs) and theirs[k].op != matching_op(op):
            # Name the send first whichever side was posted last, so messages read the same.
            send, recv = (mine[k], theirs[k]) if is_send(op) else (theirs[k], mine[k])
            sender, receiver, kind = _channel(s, op)
            raise ScheduleError(
                f"microbatch mismatch on the {kind} channel stage {sender} -> stage {receiver} "
                f"(FIFO pair #{k}): {send.op!r} on stage {send.stage} (instruction #{send.index}) "
                f"meets {recv.op!r} on stage {recv.stage} (instruction #{recv.index})"
            )
        return theirs, k

    while True:
        progressed = False
        for s in range(num_stages):
            while pc[s] < len(lists[s]):
                instr = lists[s][pc[s]]
                ops = p2p_ops(instr)
                start = clock[s]
                if ops:
                    if waiting[s] is None:
                        waiting[s] = [post(s, pc[s], op) for op in ops]
                        progressed = True
                    if any(k >= len(theirs) for theirs, k in waiting[s]):
                        break
                    cost = costs.of(s, instr)
                    # Post time is the same for all ops of this instruction: clock[s].
                    end = max(max(start, theirs[k].time) + cost for theirs, k in waiting[s])
                    waiting[s] = None
                else:
                    end = start + costs.of(s, instr)
                events[s].append(TimelineEvent(s, instr, start, end))
                clock[s] = end
                pc[s] += 1
                progressed = True
        if all(pc[s] == len(lists[s]) for s in range(num_stages)):
            break
        if not progressed:
            blocked = "; ".join(
                f"stage {s} blocked at #{pc[s]} {lists[s][pc[s]]!r}"
                for s in range(num_stages)
                if pc[s] < len(lists[s])
            )
            raise ScheduleError(f"deadlock: no stage can progress; {blocked}")

    timeline = tuple(event for stage_events in events for event in stage_events)
    busy = tuple(
        sum(e.end - e.start for e in stage_events if isinstance(e.instruction, COMPUTE_TYPES))
        for stage_events in events
    )
    compute = [e for e in timeline if isinstance(e.instruction, COMPUTE_TYPES)]
    span = max(e.end for e in compute) - min(e.start for e in compute) if compute else 0.0
    bubble = 1.0 - sum(busy) / (num_stages * span) if span > 0 else 0.0
    makespan = max((e.end for e in timeline), default=0.0)
    return SimulationResult(makespan=makespan, busy=busy, bubble_fraction=bubble, timeline=timeline)


def render_text_timeline(result: SimulationResult, num_stages: int, width: int | None = None) -> str:
    """Draw the compute instructions of a simulation as text, one row per stage.

    Time is cut into columns of one unit (the shortest compute duration, or
    coarser if ``width`` or a 400-column cap demands). A column shows the
    compute instruction covering its midpoint: its label (``F3``, ``B0``) in
    its first column, ``-`` in later ones; idle columns are dots.

    Args:
        result: What :func:`simulate` returned.
        num_stages: Number of rows to draw.
        width: Optional maximum number of characters per row after the ``sK |`` prefix.

    Returns:
        ``num_stages`` lines joined by newlines, e.g. ``s0 |F0 F1 B0 B1 ...``.
    """
    compute = [e for e in result.timeline if isinstance(e.instruction, COMPUTE_TYPES)]
    labels = {
        id(e): ("F" if isinstance(e.instruction, Forward) else "B") + str(e.instruction.microbatch) for e in compute
    }
    cell = max((len(label) for label in labels.values()), default=1) + 1
    durations = [e.end - e.start for e in compute if e.end > e.start]
    unit = min(durations, default=1.0)
    end_time = max((e.end for e in compute), default=0.0)
    max_columns = 400 if width is None else max(1, width // cell)
    # The small tolerance keeps float noise from adding an empty trailing column.
    columns = math.ceil(end_time / unit - 1e-9) if end_time > 0 else 0
    if columns > max_columns:
        unit = end_time / max_columns
        columns = max_columns
    per_stage: list[list[TimelineEvent]] = [[] for _ in range(num_stages)]
    for e in compute:
        if 0 <= e.stage < num_stages:
            per_stage[e.stage].append(e)
    prefix_width = len(f"s{num_stages - 1}")
    rows = []
    for s, stage_events in enumerate(per_stage):
        cells, shown = [], set()
        for c in range(columns):
            mid = (c + 0.5) * unit
            hit = next((e for e in stage_events if e.start <= mid < e.end), None)
            if hit is None:
                cells.append("." * (cell - 1) + " ")
            elif id(hit) in shown:
                cells.append("-" * (cell - 1) + " ")
            else:
                shown.add(id(hit))
                cells.append(labels[id(hit)].ljust(cell))
        rows.append(f"s{s}".ljust(prefix_width) + " |" + "".join(cells).rstrip())
    return "\n".join(rows)
