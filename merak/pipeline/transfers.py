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

from collections.abc import Sequence

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
    """When each transfer is reached in the schedule's own timeline (unit costs, buffered sends)."""
    from merak.pipeline.simulate import simulate

    times = {}
    for event in simulate(lists).timeline:
        for op in p2p_ops(event.instruction):
            times[(event.stage, op)] = event.start
    return times


def _blocked_sends(flat: list[list[Instruction]]) -> list[tuple[int, P2POp]] | None:
    """Run the lists under rendezvous semantics, each point's transfers one group that blocks its rank
    until every one of them has met its partner; None when every rank finishes, else ``(rank, send)``
    for the sends of the groups that are stuck, whose receives are not posted."""
    num_stages = len(flat)
    groups = []  # per rank, per point: [(op, (pair, message))]
    for s, stage in enumerate(flat):
        runs: dict[int, list] = {}
        for op, run in zip(stage, _runs(stage)):
            if run >= 0:
                runs.setdefault(run, []).append((op, (_pair_of(op, s, num_stages), message_of(op, s, num_stages))))
        groups.append([runs[r] for r in sorted(runs)])
    current = [0] * num_stages
    done: set = set()
    while True:
        posted = {(name, is_send(op)) for s in range(num_stages) if current[s] < len(groups[s])
                  for op, name in groups[s][current[s]]}
        progressed = False
        for s in range(num_stages):
            if current[s] == len(groups[s]):
                continue
            group = groups[s][current[s]]
            done.update(name for op, name in group if (name, not is_send(op)) in posted)
            if all(name in done for _, name in group):
                current[s] += 1
                progressed = True
        if all(current[s] == len(groups[s]) for s in range(num_stages)):
            return None
        if not progressed:
            return [(s, op) for s in range(num_stages) if current[s] < len(groups[s])
                    for op, name in groups[s][current[s]] if is_send(op) and name not in done]


def _delay(flat: list[list[Instruction]], rank: int, send: P2POp) -> None:
    """Move ``send`` to its rank's next point, with the sends to the same peer that its point posts after
    it (so messages in one direction keep their order)."""
    num_stages = len(flat)
    stage, runs = flat[rank], _runs(flat[rank])
    index = stage.index(send)
    run = runs[index]
    pair = _pair_of(send, rank, num_stages)
    moving = [op for op, r in zip(stage[index:], runs[index:]) if r == run and is_send(op)
              and _pair_of(op, rank, num_stages) == pair]
    for op in moving:
        stage.remove(op)
    at = index
    while at < len(stage) and isinstance(stage[at], P2P_TYPES):  # the rest of its own point
        at += 1
    while at < len(stage) and not isinstance(stage[at], P2P_TYPES):  # what runs before the next point
        at += 1
    stage[at:at] = moving  # into the next point, or a point of their own at the end


def _untangle(lists: Sequence[Sequence[Instruction]]) -> list[list[Instruction]]:
    """The lists with every transfer on its own, and sends moved to later points until the lists run
    under rendezvous semantics.

    First, two ranks must not post their messages to each other in opposite orders. Of two crossing
    messages, one is a send of each rank (two receives posted first on both sides would deadlock with
    any buffering); one of the sends joins the point of the receive its rank posts after it: the one that
    then reaches its receiver no later than the receiver asks for it, in the schedule's own timeline.
    Then waits around a ring of ranks (interleaved schedules) are broken the same way: of the sends that
    hold their groups, the one that delays its receiver least moves to its rank's next point."""
    num_stages = len(lists)
    flat = [[op for instruction in stage for op in (p2p_ops(instruction) or (instruction,))] for stage in lists]
    times = _post_times(lists)
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
    receive_times = {}
    for (s, op), time in times.items():
        if not is_send(op):
            receive_times[(_pair_of(op, s, num_stages), message_of(op, s, num_stages))] = time
    for _ in range(sum(len(stage) for stage in flat)):
        stuck = _blocked_sends(flat)
        if stuck is None:
            return flat
        # The send whose receiver asks for it latest loses least by waiting for its rank's next point.
        rank, send = max(stuck, key=lambda item: receive_times.get(
            (_pair_of(item[1], item[0], num_stages), message_of(item[1], item[0], num_stages)), 0.0))
        _delay(flat, rank, send)
    raise ScheduleError("the schedule's transfers deadlock under rendezvous semantics however sends are delayed")


def group_transfers(lists: Sequence[Sequence[Instruction]]) -> list[list[Instruction]]:
    """The stages' lists with every point's transfers in one group, in the order both peers agree on.

    Args:
        lists: ``lists[s]`` is stage ``s``'s instruction list (one step of every stage).

    Returns:
        New lists: the same instructions, a send moved to a later point where two ranks would otherwise
        post their messages to each other in opposite orders, each point's transfers gathered into one
        ``Exchange`` (a point with one transfer keeps it bare), ordered per pair of ranks and direction.

    Raises:
        ScheduleError: the lists' transfers cannot be put in one order both sides keep (see
            :func:`_untangle`).
    """
    num_stages = len(lists)
    flat = _untangle(lists)
    # (sender rank, receiver rank) -> message -> its position in the order both ranks post
    points: dict[tuple[int, int], dict[Message, list[int]]] = {}
    for s, stage in enumerate(flat):
        for op, run in zip(stage, _runs(stage)):
            if run >= 0:
                pair = _pair_of(op, s, num_stages)
                ends = points.setdefault(pair, {}).setdefault(message_of(op, s, num_stages), [-1, -1])
                ends[0 if is_send(op) else 1] = run
    order = {(pair, message): rank
             for pair, messages in points.items()
             for rank, (_, _, message) in enumerate(sorted((*ends, message) for message, ends in messages.items()))}
    grouped = []
    for s, stage in enumerate(flat):
        out, run_ops = [], []
        for instruction, run in zip([*stage, None], [*_runs(stage), -1]):
            if run >= 0 and (not run_ops or run == run_ops[-1][0]):
                run_ops.append((run, instruction))
                continue
            if run_ops:
                ops = sorted((op for _, op in run_ops),
                             key=lambda op, s=s: (_pair_of(op, s, num_stages),
                                                  order[(_pair_of(op, s, num_stages), message_of(op, s, num_stages))]))
                out.append(ops[0] if len(ops) == 1 else Exchange(tuple(ops)))
                run_ops = []
            if run >= 0:
                run_ops.append((run, instruction))
            elif instruction is not None:
                out.append(instruction)
        grouped.append(out)
    return grouped
