"""Turn the transfers of a schedule's lists into batched groups that cannot deadlock on NCCL.

A schedule places each send and receive at some *point* of a stage's list: between two other
instructions. The executor posts everything at one point as one batched group
(:class:`~merak.pipeline.instructions.Exchange`), and the transport matches messages between two ranks
by posting order alone, per direction, as NCCL does. This module makes both sides agree on that order:

* each point's transfers become one group (one ``Exchange``; a lone transfer stays as it is);
* for every pair of ranks and direction, the messages get one order that both the sender's and the
  receiver's points respect, and each group posts them in it. A pair of messages that one side's points
  put in one order and the other side's in the opposite cannot be ordered; that is a schedule bug,
  reported as a :class:`~merak.pipeline.validate.ScheduleError`.

Whether the grouped lists can deadlock under rendezvous semantics (a send completes only when its
receive runs, a group blocks until all its operations have met their partners) is then the simulator's
``sends="rendezvous"`` check, which every registered schedule passes (``tests/unit``).

Pure Python, no torch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from merak.pipeline.instructions import (
    P2P_TYPES,
    Exchange,
    Instruction,
    P2POp,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    is_send,
    p2p_ops,
    peer_of,
    virtual_stage,
)
from merak.pipeline.validate import ScheduleError

if TYPE_CHECKING:
    from merak.pipeline.simulate import Deadlock

Message = tuple[str, int, int]  # (kind, sending virtual stage, microbatch)


def message_of(op: P2POp, stage_id: int, num_stages: int) -> Message:
    """The message ``op`` (run on ``stage_id``) sends or receives; both ends name it the same."""
    mine = virtual_stage(stage_id, op.chunk, num_stages)
    if isinstance(op, SendActivation):
        return "activation", mine, op.microbatch
    if isinstance(op, RecvActivation):
        return "activation", mine - 1, op.microbatch
    if isinstance(op, SendGrad):
        return "grad", mine, op.microbatch
    if isinstance(op, RecvGrad):
        return "grad", mine + 1, op.microbatch
    raise TypeError(f"not a point-to-point instruction: {op!r}")


def _runs(flat: Sequence[Instruction]) -> list[int]:
    """Per instruction of ``flat``, the index of the run of consecutive transfers it belongs to (-1 for
    other instructions)."""
    runs, run, inside = [], -1, False
    for instruction in flat:
        transfer = isinstance(instruction, P2P_TYPES)
        if transfer and not inside:
            run += 1
        inside = transfer
        runs.append(run if transfer else -1)
    return runs


def _pair_of(op: P2POp, stage_id: int, num_stages: int) -> tuple[int, int]:
    peer, _ = peer_of(op, stage_id, num_stages)
    return (stage_id, peer) if is_send(op) else (peer, stage_id)


@functools.lru_cache(maxsize=1 << 16)
def _key(op: P2POp, stage_id: int, num_stages: int) -> tuple[tuple[int, int], Message]:
    """``(pair, message)`` of ``op`` run on ``stage_id``: asked for every transfer at every repair."""
    return _pair_of(op, stage_id, num_stages), message_of(op, stage_id, num_stages)


def _crossing(flat: list[list[Instruction]]) -> tuple | None:
    """The first two messages between one pair of ranks that the two ranks post at points in opposite
    orders, as ``(rank a, op x on a, op y on a, rank b, op x on b, op y on b)`` where rank ``a`` posts x
    at an earlier point than y and rank ``b`` at a later one; None when there is none."""
    num_stages = len(flat)
    # {lower rank, higher rank} -> message -> {rank: (point, op)}
    found: dict[tuple[int, int], dict[Message, dict[int, tuple[int, P2POp]]]] = {}
    for s, stage in enumerate(flat):
        for op, run in zip(stage, _runs(stage)):
            if run >= 0:
                pair = tuple(sorted(_pair_of(op, s, num_stages)))
                found.setdefault(pair, {}).setdefault(message_of(op, s, num_stages), {})[s] = (run, op)
    for (a, b), messages in sorted(found.items()):
        both = sorted(((ends[a], ends[b]) for ends in messages.values() if a in ends and b in ends),
                      key=lambda e: (e[0][0], e[1][0]))
        latest = None  # the message posted latest on b among those posted at earlier points on a
        start = 0
        for index, ((point_a, _), (point_b, _)) in enumerate(both):
            while both[start][0][0] < point_a:  # points before this one on a become candidates
                if latest is None or both[start][1][0] > latest[1][0]:
                    latest = both[start]
                start += 1
            if latest is not None and latest[1][0] > point_b:
                (_, x_a), (_, x_b) = latest
                (_, y_a), (_, y_b) = both[index]
                return a, x_a, y_a, b, x_b, y_b
    return None


def _post_times(lists: Sequence[Sequence[Instruction]]) -> dict[tuple[int, P2POp], float]:
    """When each transfer is reached in the schedule's own timeline (unit costs, buffered sends, every
    transfer on its own)."""
    from merak.pipeline.simulate import simulate

    flat = [[op for instruction in stage for op in (p2p_ops(instruction) or (instruction,))] for stage in lists]
    times = {}
    for event in simulate(flat).timeline:
        for op in p2p_ops(event.instruction):
            times[(event.stage, op)] = event.start
    return times


def _untangle(lists: Sequence[Sequence[Instruction]], times: dict) -> list[list[Instruction]]:
    """The lists with every transfer on its own, and sends moved so that no two ranks post their messages
    to each other in opposite orders at different points.

    Of two crossing messages, one is a send of each rank (two receives posted first on both sides would
    deadlock with any buffering); one of the sends joins the point of the receive its rank posts after
    it: the one that then reaches its receiver no later than the receiver asks for it, in the schedule's
    own timeline (``times``)."""
    num_stages = len(lists)
    flat = [[op for instruction in stage for op in (p2p_ops(instruction) or (instruction,))] for stage in lists]
    while (crossing := _crossing(flat)) is not None:
        a, x_a, y_a, b, x_b, y_b = crossing
        if is_send(x_a) == is_send(y_a):
            raise ScheduleError(
                f"ranks {a} and {b} post {message_of(x_a, a, num_stages)} and {message_of(y_a, a, num_stages)} "
                f"in opposite orders: messages in one direction must be posted in one order")
        if not is_send(x_a):
            raise ScheduleError(
                f"ranks {a} and {b} each wait for a message before sending the one the other waits for: "
                f"{x_a!r} on rank {a}, {y_b!r} on rank {b}")
        # Rank a sends x before it receives y; rank b sends y before it receives x.
        if times[(a, y_a)] <= times[(b, x_b)]:
            rank, send, anchor = a, x_a, y_a
        else:
            rank, send, anchor = b, y_b, x_b
        stage = flat[rank]
        stage.remove(send)
        stage.insert(stage.index(anchor) + 1, send)
    return flat


def _group(ops: Sequence[P2POp]) -> Instruction:
    return ops[0] if len(ops) == 1 else Exchange(tuple(ops))


def _sorted_groups(grouped: list[list[Instruction]]) -> list[list[Instruction]]:
    """Every group's operations in the order both ranks of each pair post them: per pair of ranks and
    direction, by the sender's group, then the receiver's."""
    num_stages = len(grouped)
    placed = _placements(grouped)
    where = {(pair, message): [placed.get((pair, message, True), (0, -1))[1],
                               placed.get((pair, message, False), (0, -1))[1]]
             for pair, message, _ in placed}  # (pair, message) -> [sender's group index, receiver's]
    result = []
    for s, stage in enumerate(grouped):
        out = []
        for instruction in stage:
            ops = p2p_ops(instruction)
            if len(ops) > 1:
                instruction = _group(sorted(ops, key=lambda op, s=s: (_key(op, s, num_stages)[0],
                                                                      where[_key(op, s, num_stages)])))
            out.append(instruction)
        result.append(out)
    return result


def _placements(grouped: list[list[Instruction]]) -> dict[tuple, tuple[int, int]]:
    """``(pair, message, is_send) -> (rank, index of the group that posts it)`` for every transfer."""
    num_stages = len(grouped)
    return {(*_key(op, s, num_stages), is_send(op)): (s, index)
            for s, stage in enumerate(grouped) for index, instruction in enumerate(stage)
            for op in p2p_ops(instruction)}


def _split_waiting_groups(grouped: list[list[Instruction]], stuck: Deadlock) -> bool:
    """Split each group that waits for a description from a sender that has not reached its send: its
    sends, the receives whose descriptions have come and those that cross its sends, first; the other
    receives in a group after it. (A group posts nothing before it has the description of
    everything it receives.) True if any split."""
    num_stages = len(grouped)
    where = _placements(grouped)
    changed = False
    for s, phase in enumerate(stuck.phases):
        if phase != "descriptions":
            continue
        position = stuck.positions[s]
        ops = p2p_ops(grouped[s][position])

        def described(op, s=s) -> bool:
            sender, index = where[(*_key(op, s, num_stages), True)]
            return stuck.positions[sender] >= index

        # A receive whose sender posts it in the group where it receives one of this group's sends stays:
        # split on one side, that pair would wait on itself (NCCL runs one peer's operations in order).
        receiving = {where[(*_key(op, s, num_stages), False)]
                     for op in ops if is_send(op)}

        def crossing(op, s=s, receiving=receiving) -> bool:
            return where[(*_key(op, s, num_stages), True)] in receiving

        first = [op for op in ops if is_send(op) or described(op) or crossing(op)]
        rest = [op for op in ops if op not in first]
        if first and rest:
            grouped[s][position:position + 1] = [_group(first), _group(rest)]
            changed = True
    return changed


def _delay_a_send(grouped: list[list[Instruction]], stuck: Deadlock, receive_times: dict, latest: bool) -> bool:
    """Move one send that holds its group, with its group's later sends to the same peer, after the rest
    of the group (in a group of their own), or, when they are the whole group, into the next point of its
    rank (or a point of their own at the end). Of the sends whose receivers have not reached them, the one
    whose receiver asks for it latest (``latest``; else earliest). False if there is none."""
    num_stages = len(grouped)
    reached = _placements(grouped)
    candidates = []
    for s, phase in enumerate(stuck.phases):
        if phase != "transfer":
            continue
        for op in p2p_ops(grouped[s][stuck.positions[s]]):
            key = _key(op, s, num_stages)
            receiver, index = reached[(*key, False)]
            if is_send(op) and stuck.positions[receiver] < index:
                candidates.append((receive_times.get(key, 0.0), s, op))
    if not candidates:
        return False
    _, rank, send = (max if latest else min)(candidates, key=lambda c: c[0])
    stage, position = grouped[rank], stuck.positions[rank]
    ops = list(p2p_ops(stage[position]))
    pair = _pair_of(send, rank, num_stages)
    moving = [op for op in ops[ops.index(send):] if is_send(op) and _pair_of(op, rank, num_stages) == pair]
    kept = [op for op in ops if op not in moving]
    if kept:  # the rest of the group goes first, the sends in a group of their own after it
        stage[position:position + 1] = [_group(kept), _group(moving)]
        return True
    del stage[position]
    at = position
    while at < len(stage) and p2p_ops(stage[at]):  # the rest of its own point
        at += 1
    while at < len(stage) and not p2p_ops(stage[at]):  # what runs before the next point
        at += 1
    if at < len(stage):
        stage[at] = _group([*moving, *p2p_ops(stage[at])])
    else:
        stage.append(_group(moving))
    return True


def group_transfers(lists: Sequence[Sequence[Instruction]]) -> list[list[Instruction]]:
    """The stages' lists with their transfers in groups both peers post alike, and that run under
    rendezvous semantics.

    Args:
        lists: ``lists[s]`` is stage ``s``'s instruction list (one step of every stage).

    Returns:
        New lists with the same computes in the same order. Each point's transfers become one group
        (an ``Exchange``, or a lone transfer), ordered per pair of ranks and direction; then, while the
        simulator finds a deadlock under rendezvous semantics, a group that waits for a description its
        sender has not reached is split (its sends go first), or else a send that holds its group moves
        to its rank's next point.

    Raises:
        ScheduleError: the transfers cannot be put in one order both sides keep, or no such change ends
            the deadlock.
    """
    from merak.pipeline.simulate import Deadlock, simulate

    num_stages = len(lists)
    times = _post_times(lists)
    receive_times = {_key(op, s, num_stages): time
                     for (s, op), time in times.items() if not is_send(op)}
    flat = _untangle(lists, times)
    grouped = []
    for stage in flat:
        out, point = [], []
        for instruction in [*stage, None]:
            if isinstance(instruction, P2P_TYPES):
                point.append(instruction)
                continue
            if point:
                out.append(_group(point))
                point = []
            if instruction is not None:
                out.append(instruction)
        grouped.append(out)
    grouped = _sorted_groups(grouped)
    failure = None
    # Delaying the send whose receiver asks for it latest moves the fewest; in the rare shape where that
    # ends in a cycle of waiting receives, the earliest-first order is tried.
    for latest in (True, False):
        attempt = [list(stage) for stage in grouped]
        for _ in range(4 * sum(len(stage) for stage in attempt)):
            try:
                # Each repair is simulated unchecked; the lists that run are checked once, at the end.
                simulate(attempt, sends="rendezvous", check=False)
                simulate(attempt, sends="rendezvous")
                return attempt
            except Deadlock as stuck:
                failure = stuck
                if not (_split_waiting_groups(attempt, stuck) or
                        _delay_a_send(attempt, stuck, receive_times, latest)):
                    break
                attempt = _sorted_groups(attempt)
    raise ScheduleError(f"the schedule's transfers cannot be grouped to run under rendezvous semantics: {failure}")
