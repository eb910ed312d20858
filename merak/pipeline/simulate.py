"""Simulate the instruction lists of all pipeline stages together.

The simulator is an event model of one training (or inference) step. Each
stage runs its list in order. Compute and other instructions occupy the stage
for their cost. Sends are posted and complete in the background, as the
executor's are (it waits for them when the step ends); a receive blocks the
stage until its partner send has been posted, plus the transfer cost. An
:class:`~merak.pipeline.instructions.Exchange` blocks until all of its
receives have arrived. Partners are paired first-in first-out per pair of
ranks and direction, whatever they carry, as the transports match them (no
tags), so a schedule that passes here cannot pair the wrong tensors at run
time.

``sends="rendezvous"`` is NCCL's model, and the ``MERAK_P2P_RENDEZVOUS=1``
transport's: a send waits for its receive, and an Exchange (one batched group)
for all its ops, the stage blocked meanwhile. A schedule that is deadlock-free
under it is deadlock-free whatever buffering the backend has.

Decoding lists (:mod:`merak.pipeline.decode_schedule`) run through the same
model: their own list check, ``DecodeForward`` timed as a forward and counted as
compute, and the tokens' transfers from the last stage to the first paired on a
channel of their own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from merak.pipeline.decode_schedule import validate_decode_list
from merak.pipeline.instructions import (
    BACKWARD_TYPES,
    COMPUTE_TYPES,
    DECODE_TYPES,
    MICROBATCH_TYPES,
    P2P_TYPES,
    TOKEN_TYPES,
    Backward,
    BackwardInput,
    BackwardWeight,
    DecodeForward,
    Exchange,
    Forward,
    Instruction,
    OptimizerStep,
    PreCheckpointForward,
    RecomputeForward,
    is_send,
    matching_op,
    p2p_ops,
    peer_of,
)
from merak.pipeline.validate import ScheduleError, validate_stage_list

__all__ = ["CostModel", "Costs", "Deadlock", "ScheduleError", "SimulationResult", "TimelineEvent",
           "render_text_timeline",
           "simulate", "validate_stage_list"]

SEND_MODES = ("eager", "rendezvous")
# What keeps a stage busy: training's compute, and decoding's forwards.
_BUSY_TYPES = COMPUTE_TYPES + (DecodeForward,)


class CostModel(Protocol):
    """Anything that prices an instruction of a stage (e.g. measured per-stage costs).

    A model may also define ``backward_recompute(stage_id) -> float``: the time a
    backward spends recomputing checkpointed layers after a plain Forward.
    """

    def of(self, stage_id: int, instruction: Instruction) -> float:
        """Return the duration of ``instruction`` on stage ``stage_id``."""
        ...


@dataclass(frozen=True)
class Costs:
    """Uniform instruction costs, the same on every stage.

    Attributes:
        forward: Duration of one Forward, PreCheckpointForward or DecodeForward.
        backward: Duration of one Backward without recomputation
            (BackwardInput plus BackwardWeight together).
        recompute: Duration of recomputing the whole stage forward
            (RecomputeForward); None: the forward's cost.
        backward_input: Duration of a BackwardInput; None: half the backward.
        checkpoint_ratios: Per stage, the fraction of its forward that a plain
            Forward checkpoints; its backward recomputes that fraction.
        p2p: Transfer time of one point-to-point op, counted from the moment
            both partners have been posted.
        other: Duration of LoadMicrobatch, ReduceTiedGrads, ReduceGrads and
            OptimizerStep.
    """

    forward: float = 1.0
    backward: float = 1.0
    recompute: float | None = None
    backward_input: float | None = None
    checkpoint_ratios: tuple[float, ...] = ()
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
        half = self.backward / 2 if self.backward_input is None else self.backward_input
        if isinstance(instruction, (Forward, PreCheckpointForward, DecodeForward)):
            return self.forward
        if isinstance(instruction, RecomputeForward):
            return self.forward if self.recompute is None else self.recompute
        if isinstance(instruction, Backward):
            return self.backward
        if isinstance(instruction, BackwardInput):
            return half
        if isinstance(instruction, BackwardWeight):
            return self.backward - half
        if isinstance(instruction, (Exchange,) + P2P_TYPES + TOKEN_TYPES):
            return self.p2p
        return self.other

    def backward_recompute(self, stage_id: int) -> float:
        """Recomputation inside a backward that follows a plain Forward on ``stage_id``."""
        ratio = self.checkpoint_ratios[stage_id] if stage_id < len(self.checkpoint_ratios) else 0.0
        return ratio * (self.forward if self.recompute is None else self.recompute)


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
        busy: Per stage, the total compute time (recomputation included).
        bubble_fraction: ``1 - sum(busy) / (S * span)`` where ``span`` runs
            from the first compute start to the last compute end of all
            stages, so zero-cost bookkeeping does not count as bubble.
        timeline: Every instruction of every stage, stage by stage in program order.
    """

    makespan: float
    busy: tuple[float, ...]
    bubble_fraction: float
    timeline: tuple[TimelineEvent, ...]


def _channel(stage_id: int, num_stages: int, op) -> tuple[int, int]:
    """(sending rank, receiving rank) of the FIFO queue ``op`` joins: messages between two ranks are
    matched by posting order alone, whatever they carry (NCCL has no tags)."""
    peer, _ = peer_of(op, stage_id, num_stages)
    return (stage_id, peer) if is_send(op) else (peer, stage_id)


@dataclass
class _Posted:
    """One op in its channel queue: reached at ``time`` (a send's description is out), its tensors
    posted at ``posted`` (None until its group has every description it receives)."""

    stage: int
    index: int
    op: object
    time: float
    posted: float | None = None


class Deadlock(ScheduleError):
    """No stage can progress. ``positions[s]``: the index of the instruction stage ``s`` is blocked at
    (its list's length when it finished); ``phases[s]``: ``"descriptions"`` (its group waits for the
    description of a payload it receives, which its sender has not reached), ``"transfer"`` (its group is
    posted and waits for partners), or None (finished)."""

    def __init__(self, message: str, positions: list[int], phases: list[str | None]) -> None:
        super().__init__(message)
        self.positions = positions
        self.phases = phases


def _chain_shape(lists) -> tuple[int, int]:
    """(num_microbatches, num_chunks) from the largest ids used (validation reports gaps)."""
    items = [item for stage in lists for instr in stage for item in (p2p_ops(instr) or (instr,))
             if isinstance(item, MICROBATCH_TYPES)]
    if not items:
        raise ScheduleError("no microbatch instructions in any stage")
    return max(i.microbatch for i in items) + 1, max(i.chunk for i in items) + 1


def simulate(schedules: Sequence[Sequence[Instruction]], costs: CostModel | None = None,
             sends: str = "eager", *, check: bool = True) -> SimulationResult:
    """Run the stage lists of one step together and time them.

    Args:
        schedules: ``schedules[s]`` is stage ``s``'s instruction list.
        costs: Prices instructions; any object with ``of(stage_id, instruction)``.
            Defaults to :class:`Costs` ``()`` (unit compute, free p2p and bookkeeping).
        sends: ``"eager"`` (posted sends complete in the background, as the
            executor's do) or ``"rendezvous"`` (a send blocks until received).
        check: validate each list first (off only for lists already validated and then regrouped).

    Returns:
        The timing of every instruction and the derived makespan, busy times
        and bubble fraction.

    Raises:
        ScheduleError: If a list is malformed, two paired ops carry different
            microbatches, or the stages deadlock (the message lists every
            unfinished stage and the instruction it is blocked on).
    """
    if sends not in SEND_MODES:
        raise ValueError(f"sends={sends!r}; use one of {SEND_MODES}")
    costs = Costs() if costs is None else costs
    recompute_cost = getattr(costs, "backward_recompute", None)
    lists = [list(stage) for stage in schedules]
    num_stages = len(lists)
    if num_stages == 0:
        raise ScheduleError("no stages to simulate")
    num_microbatches, num_chunks = _chain_shape(lists)
    training = any(isinstance(instr, BACKWARD_TYPES + (OptimizerStep,)) for stage in lists for instr in stage)
    decoding = any(isinstance(instr, DECODE_TYPES) for stage in lists for instr in stage)
    for s, stage in enumerate(lists if check else ()):
        if decoding:
            validate_decode_list(s, num_stages, num_microbatches, stage)
        else:
            validate_stage_list(s, num_stages, num_microbatches, stage, training=training, num_chunks=num_chunks)

    # channel -> (posted sends, posted receives); the k-th of each pair up.
    queues: dict[tuple[int, int], tuple[list[_Posted], list[_Posted]]] = {}
    pc = [0] * num_stages
    clock = [0.0] * num_stages
    waiting: list[list[tuple[object, list[_Posted], int]] | None] = [None] * num_stages
    events: list[list[TimelineEvent]] = [[] for _ in range(num_stages)]
    plain_forwards: set[tuple[int, int, int]] = set()  # (stage, chunk, microbatch) run as plain Forward

    def post(s: int, idx: int, op) -> tuple[object, _Posted, list[_Posted], int]:
        sends_q, recvs_q = queues.setdefault(_channel(s, num_stages, op), ([], []))
        mine, theirs = (sends_q, recvs_q) if is_send(op) else (recvs_q, sends_q)
        k = len(mine)
        entry = _Posted(s, idx, op, clock[s])
        mine.append(entry)
        if k < len(theirs) and theirs[k].op != matching_op(op, s, num_stages):
            # Name the send first whichever side was posted last, so messages read the same.
            send, recv = (mine[k], theirs[k]) if is_send(op) else (theirs[k], mine[k])
            sender, receiver = _channel(s, num_stages, op)
            raise ScheduleError(
                f"message mismatch between ranks {sender} -> {receiver} "
                f"(FIFO pair #{k}): {send.op!r} on stage {send.stage} (instruction #{send.index}) "
                f"meets {recv.op!r} on stage {recv.stage} (instruction #{recv.index})")
        return op, entry, theirs, k

    def blocks(op) -> bool:
        return sends == "rendezvous" or not is_send(op)

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
                    group = waiting[s]
                    if group[0][1].posted is None:
                        # A group's tensors are posted once the description of everything it receives
                        # has come: its senders have reached their groups.
                        receives = [(theirs, k) for op, _, theirs, k in group if not is_send(op)]
                        if any(k >= len(theirs) for theirs, k in receives):
                            break
                        posted = max([start] + [theirs[k].time for theirs, k in receives])
                        for _, entry, _, _ in group:
                            entry.posted = posted
                        progressed = True
                    posted = group[0][1].posted
                    pending = [(theirs, k) for op, _, theirs, k in group if blocks(op)]
                    if any(k >= len(theirs) or theirs[k].posted is None for theirs, k in pending):
                        break
                    cost = costs.of(s, instr)
                    end = max((max(posted, theirs[k].posted) + cost for theirs, k in pending), default=posted)
                    waiting[s] = None
                else:
                    end = start + costs.of(s, instr)
                    key = (s, getattr(instr, "chunk", 0), getattr(instr, "microbatch", -1))
                    if isinstance(instr, Forward):
                        plain_forwards.add(key)
                    elif isinstance(instr, (Backward, BackwardInput)) and key in plain_forwards \
                            and recompute_cost is not None:
                        end += recompute_cost(s)
                events[s].append(TimelineEvent(s, instr, start, end))
                clock[s] = end
                pc[s] += 1
                progressed = True
        if all(pc[s] == len(lists[s]) for s in range(num_stages)):
            break
        if not progressed:
            phases = [None if pc[s] == len(lists[s]) else
                      "descriptions" if waiting[s] is not None and waiting[s][0][1].posted is None else "transfer"
                      for s in range(num_stages)]
            blocked = "; ".join(
                f"stage {s} blocked at #{pc[s]} {lists[s][pc[s]]!r}"
                + (" (waiting for a description)" if phases[s] == "descriptions" else "")
                for s in range(num_stages)
                if pc[s] < len(lists[s]))
            raise Deadlock(f"deadlock: no stage can progress; {blocked}", list(pc), phases)

    timeline = tuple(event for stage_events in events for event in stage_events)
    busy = tuple(
        sum(e.end - e.start for e in stage_events if isinstance(e.instruction, _BUSY_TYPES))
        for stage_events in events)
    compute = [e for e in timeline if isinstance(e.instruction, _BUSY_TYPES)]
    span = max(e.end for e in compute) - min(e.start for e in compute) if compute else 0.0
    bubble = 1.0 - sum(busy) / (num_stages * span) if span > 0 else 0.0
    makespan = max((e.end for e in timeline), default=0.0)
    return SimulationResult(makespan=makespan, busy=busy, bubble_fraction=bubble, timeline=timeline)


def instruction_label(instruction: Instruction) -> str:
    """Short label of a compute instruction: F3, PF3, R3, B3, BI3, W3, D3 (decoding; chunk as a suffix: F3.1)."""
    prefix = {Forward: "F", PreCheckpointForward: "PF", RecomputeForward: "R", Backward: "B",
              BackwardInput: "BI", BackwardWeight: "W", DecodeForward: "D"}[type(instruction)]
    chunk = f".{instruction.chunk}" if instruction.chunk else ""
    return f"{prefix}{instruction.microbatch}{chunk}"


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
    compute = [e for e in result.timeline if isinstance(e.instruction, _BUSY_TYPES)]
    labels = {id(e): instruction_label(e.instruction) for e in compute}
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
