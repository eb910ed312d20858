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
``sends="rendezvous"`` check, which every registered schedule passes (``tests/unit``). Where they would,
groups are split or sends delayed, one repair at a time; the repairs grow with the step, so after each the
simulation goes on from where it stopped (:class:`_Rendezvous`) rather than running the step again, which
made the grouping cost grow with the square of the step (minutes per rank for pp=8 at 128 microbatches).

Pure Python, no torch.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

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

logger = logging.getLogger(__name__)

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


_NOWHERE = (0, -1)  # the placement of a message's end that no rank posts


def _in_posting_order(instruction: Instruction, stage_id: int, num_stages: int,
                      placed: dict | _Placements) -> Instruction:
    """``instruction`` (of ``stage_id``) with its operations in the order both ranks of each pair post
    them: per pair of ranks and direction, by the sender's group, then the receiver's (``placed``:
    :func:`_placements`). A lone transfer or a compute comes back as it is."""
    ops = p2p_ops(instruction)
    if len(ops) < 2:
        return instruction

    def order(op: P2POp) -> tuple:
        pair, message = _key(op, stage_id, num_stages)
        return pair, (placed.get((pair, message, True), _NOWHERE)[1], placed.get((pair, message, False), _NOWHERE)[1])

    return _group(sorted(ops, key=order))


def _sorted_groups(grouped: list[list[Instruction]]) -> list[list[Instruction]]:
    """Every group's operations in the order both ranks of each pair post them (:func:`_in_posting_order`)."""
    num_stages = len(grouped)
    placed = _placements(grouped)
    return [[_in_posting_order(instruction, s, num_stages, placed) for instruction in stage]
            for s, stage in enumerate(grouped)]


def _placements(grouped: list[list[Instruction]]) -> dict[tuple, tuple[int, int]]:
    """``(pair, message, is_send) -> (rank, index of the group that posts it)`` for every transfer."""
    num_stages = len(grouped)
    return {(*_key(op, s, num_stages), is_send(op)): (s, index)
            for s, stage in enumerate(grouped) for index, instruction in enumerate(stage)
            for op in p2p_ops(instruction)}


def _split_waiting_groups(grouped: list[list[Instruction]], stuck: Deadlock | _Stuck,
                          where: dict | _Placements) -> list[_Edit]:
    """Split each group that waits for a description from a sender that has not reached its send: its
    sends, the receives whose descriptions have come and those that cross its sends, first; the other
    receives in a group after it. (A group posts nothing before it has the description of
    everything it receives.) ``where``: :func:`_placements` of ``grouped`` as it was before any split.
    Returns the splits (none: nothing to split)."""
    num_stages = len(grouped)
    edits = []
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
            edits.append(_Edit(s, position, position + 1, position + 2))
    return edits


def _delay_a_send(grouped: list[list[Instruction]], stuck: Deadlock | _Stuck, receive_times: dict, latest: bool,
                  reached: dict | _Placements) -> list[_Edit]:
    """Move one send that holds its group, with its group's later sends to the same peer, after the rest
    of the group (in a group of their own), or, when they are the whole group, into the next point of its
    rank (or a point of their own at the end). Of the sends whose receivers have not reached them, the one
    whose receiver asks for it latest (``latest``; else earliest). ``reached``: :func:`_placements` of
    ``grouped``. Returns the one change as a list (empty: there is no such send)."""
    num_stages = len(grouped)
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
        return []
    _, rank, send = (max if latest else min)(candidates, key=lambda c: c[0])
    stage, position = grouped[rank], stuck.positions[rank]
    ops = list(p2p_ops(stage[position]))
    pair = _pair_of(send, rank, num_stages)
    moving = [op for op in ops[ops.index(send):] if is_send(op) and _pair_of(op, rank, num_stages) == pair]
    kept = [op for op in ops if op not in moving]
    if kept:  # the rest of the group goes first, the sends in a group of their own after it
        stage[position:position + 1] = [_group(kept), _group(moving)]
        return [_Edit(rank, position, position + 1, position + 2)]
    del stage[position]
    at = position
    while at < len(stage) and p2p_ops(stage[at]):  # the rest of its own point
        at += 1
    while at < len(stage) and not p2p_ops(stage[at]):  # what runs before the next point
        at += 1
    if at < len(stage):
        stage[at] = _group([*moving, *p2p_ops(stage[at])])
        return [_Edit(rank, position, at + 2, at + 1)]
    stage.append(_group(moving))
    return [_Edit(rank, position, len(stage), len(stage))]


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
    grouped, receive_times = _first_groups(lists)
    repaired = _repair_resuming(grouped, receive_times)
    if repaired is not None:
        return repaired
    return _repair_from_scratch(grouped, receive_times)


def _first_groups(lists: Sequence[Sequence[Instruction]]) -> tuple[list[list[Instruction]], dict]:
    """The lists with each point's transfers as one group in posting order, before any deadlock is
    repaired, and when each receive is asked for in the schedule's own timeline (which repairs read)."""
    num_stages = len(lists)
    times = _post_times(lists)
    receive_times = {_key(op, s, num_stages): time
                     for (s, op), time in times.items() if not is_send(op)}
    return _sorted_groups([_points(stage) for stage in _untangle(lists, times)]), receive_times


def _points(stage: list[Instruction]) -> list[Instruction]:
    """``stage`` with each run of consecutive transfers (a point) as one group."""
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
    return out


def _repair_from_scratch(grouped: list[list[Instruction]], receive_times: dict) -> list[list[Instruction]]:
    """Repair deadlocks one at a time, simulating the whole step after each repair: the reference that
    :func:`_repair_resuming` reproduces, and what runs when that gives up (its cost grows with the square
    of the lists' length).

    Delaying the send whose receiver asks for it latest moves the fewest; in the rare shape where that
    ends in a cycle of waiting receives, the earliest-first order is tried."""
    from merak.pipeline.simulate import Deadlock, simulate

    failure = None
    for latest in (True, False):
        attempt = [list(stage) for stage in grouped]
        for _ in range(_repair_budget(attempt)):
            try:
                # Each repair is simulated unchecked; the lists that run are checked once, at the end.
                simulate(attempt, sends="rendezvous", check=False)
                simulate(attempt, sends="rendezvous")
                return attempt
            except Deadlock as stuck:
                failure = stuck
                if not (_split_waiting_groups(attempt, stuck, _placements(attempt)) or
                        _delay_a_send(attempt, stuck, receive_times, latest, _placements(attempt))):
                    break
                attempt = _sorted_groups(attempt)
    raise ScheduleError(f"the schedule's transfers cannot be grouped to run under rendezvous semantics: {failure}")


def _repair_budget(grouped: list[list[Instruction]]) -> int:
    """How many repairs one order of delays may make before it gives up."""
    return 4 * sum(len(stage) for stage in grouped)


def _repair_resuming(grouped: list[list[Instruction]], receive_times: dict) -> list[list[Instruction]] | None:
    """What :func:`_repair_from_scratch` returns, found with the same repairs in the same order, in time
    about linear in the lists' length (:func:`_resumed_repairs`), and simulated in full once, as the
    reference does. None when no repair ends the deadlock or anything fails (ill-formed lists): the
    caller then takes the reference path, which raises its error."""
    from merak.pipeline.simulate import Deadlock, simulate

    try:
        attempt = _resumed_repairs(grouped, receive_times, latest=True)
        if attempt is None:
            attempt = _resumed_repairs(grouped, receive_times, latest=False)
        if attempt is None:
            return None
    except (ScheduleError, _Mismatch, KeyError) as error:  # ill-formed lists: the reference reports them
        logger.debug("transfers: grouping again from scratch after %r", error)
        return None
    try:
        simulate(attempt, sends="rendezvous")
    except Deadlock as error:
        logger.warning("transfers: resumed simulation missed a deadlock (%s); grouping again from scratch", error)
        return None
    except ScheduleError as error:
        logger.debug("transfers: grouping again from scratch after %r", error)
        return None
    return attempt


def _resumed_repairs(grouped: list[list[Instruction]], receive_times: dict,
                     latest: bool) -> list[list[Instruction]] | None:
    """One order of delays of :func:`_repair_from_scratch` (``latest``), without simulating the step
    again after each repair: the simulation (:class:`_Rendezvous`) goes on from where it stopped, and
    only the groups whose order a repair can change are sorted again (:func:`_resort`). None if it gives
    up where the reference does."""
    attempt = [list(stage) for stage in grouped]
    where = _Placements(attempt)
    runner = _Rendezvous(attempt)
    for _ in range(_repair_budget(attempt)):
        stuck = runner.run()
        if stuck is None:
            return attempt
        edits = (_split_waiting_groups(attempt, stuck, where) or
                 _delay_a_send(attempt, stuck, receive_times, latest, where))
        if not edits:
            return None
        if not runner.resume(_resort(attempt, where, edits)):
            logger.debug("transfers: a repair changed what had already run; simulating the step again")
            runner = _Rendezvous(attempt)
    return None


class _Edit(NamedTuple):
    """A repair of one rank's list: ``grouped[stage][start:old_stop]`` became what now is
    ``grouped[stage][start:new_stop]`` (nothing else changed, what follows only moved)."""

    stage: int
    start: int
    old_stop: int
    new_stop: int


class _Placements:
    """:func:`_placements` kept up to date through repairs, at a cost that does not grow with what
    follows the repair: the transfers of a group share one cell ``[rank, index]``, and a repair only
    renumbers the cells after it. Reads as the dict does (``[key]`` and ``get``)."""

    def __init__(self, grouped: list[list[Instruction]]) -> None:
        self.grouped = grouped
        self.cell_of: dict[tuple, list[int]] = {}
        self.cells = [[self._cell(s, index) for index in range(len(stage))] for s, stage in enumerate(grouped)]

    def __getitem__(self, key: tuple) -> tuple[int, int]:
        rank, index = self.cell_of[key]
        return rank, index

    def get(self, key: tuple, default: tuple[int, int] | None = None) -> tuple[int, int] | None:
        cell = self.cell_of.get(key)
        return default if cell is None else (cell[0], cell[1])

    def take(self, edit: _Edit) -> None:
        """Follow ``edit``, already made to the lists: place the groups it made, renumber those after."""
        cells = self.cells[edit.stage]
        cells[edit.start:edit.old_stop] = [self._cell(edit.stage, index)
                                           for index in range(edit.start, edit.new_stop)]
        if edit.new_stop != edit.old_stop:
            for index in range(edit.new_stop, len(cells)):
                if cells[index] is not None:
                    cells[index][1] = index

    def _cell(self, stage_id: int, index: int) -> list[int] | None:
        ops = p2p_ops(self.grouped[stage_id][index])
        if not ops:
            return None
        cell = [stage_id, index]
        num_stages = len(self.grouped)
        for op in ops:
            self.cell_of[(*_key(op, stage_id, num_stages), is_send(op))] = cell
        return cell


def _resort(grouped: list[list[Instruction]], where: _Placements, edits: list[_Edit]) -> dict[int, int]:
    """After ``edits``, what :func:`_sorted_groups` would do, without sorting every group: bring
    ``where`` up to date and sort again the groups the edits made and the groups holding their partners.

    No other group can change order: a group orders its operations with one peer by where their partners
    are on that peer, and an edit moves the groups after it by one place, which keeps their order; only
    partners in the groups it made can change places with others.

    Returns:
        Per rank whose list changed, the first index that did.
    """
    num_stages = len(grouped)
    changed: dict[int, int] = {}
    for edit in edits:
        where.take(edit)
        changed[edit.stage] = min(changed.get(edit.stage, edit.start), edit.start)
    touched = set()  # (rank, index) of the groups to sort again
    for edit in edits:
        for index in range(edit.start, edit.new_stop):
            for op in p2p_ops(grouped[edit.stage][index]):
                touched.add((edit.stage, index))
                pair, message = _key(op, edit.stage, num_stages)
                partner = where.get((pair, message, not is_send(op)))
                if partner is not None:
                    touched.add(partner)
    for s, index in touched:
        instruction = grouped[s][index]
        ordered = _in_posting_order(instruction, s, num_stages, where)
        if ordered != instruction:
            grouped[s][index] = ordered
            changed[s] = min(changed.get(s, index), index)
    return changed


class _Stuck(NamedTuple):
    """Where the stages stop, as :class:`~merak.pipeline.simulate.Deadlock` reports it."""

    positions: list[int]
    phases: list[str | None]


class _Mismatch(Exception):
    """Two ranks' k-th messages on one channel differ (the simulator's "message mismatch")."""


# One posted operation: [message, posted]; posted once its group has every description it receives.
_Entry = list
# A posted operation of a waiting group: (entry, its side of the channel, the other side, its index on both
# sides, is a send, the peer rank).
_Slot = tuple[_Entry, list, list, int, bool, int]


class _Rendezvous:
    """How far every stage's list runs under rendezvous semantics, as :func:`~merak.pipeline.simulate.
    simulate` (``sends="rendezvous"``) runs it, without the times, and able to go on after a repair.

    The rules are the simulator's: a group posts its operations on their channels' queues (matched
    first-in first-out per channel), is posted once every message it receives has been posted by its
    sender (its description is out), and completes once every partner is posted. None of these
    conditions ever turns false again, so where the stages stop does not depend on the order in which
    they are run: this runs a stage only when a peer has posted something since it last stopped.

    A repair changes lists at a stuck stage's position or later (:meth:`resume`); what had already run
    stays valid, and the stuck group is taken off its queues (its operations are their tails) and posted
    again as it now is.
    """

    def __init__(self, lists: list[list[Instruction]]) -> None:
        self.lists = lists
        self.num_stages = len(lists)
        self.pc = [0] * self.num_stages
        self.waiting: list[list[_Slot] | None] = [None] * self.num_stages
        self.queues: dict[tuple[int, int], tuple[list[_Entry], list[_Entry]]] = {}
        self.ready = set(range(self.num_stages))

    def run(self) -> _Stuck | None:
        """Run every stage as far as it goes. None if all finished, else where they stopped."""
        while self.ready:
            self._advance(self.ready.pop())
        lists, pc, waiting = self.lists, self.pc, self.waiting
        if all(pc[s] == len(lists[s]) for s in range(self.num_stages)):
            return None
        phases = [None if pc[s] == len(lists[s]) else
                  "descriptions" if waiting[s] is not None and not waiting[s][0][0][1] else "transfer"
                  for s in range(self.num_stages)]
        return _Stuck(list(pc), phases)

    def resume(self, changed: dict[int, int]) -> bool:
        """Take in changes of the lists (per rank, the first index that changed). False when one changed
        what its rank had already run past: this state is then no use."""
        for s, first in sorted(changed.items()):
            if first > self.pc[s]:
                continue
            if first < self.pc[s] or not self._post_again(s):
                return False
        return True

    def _advance(self, s: int) -> None:
        """Run stage ``s`` until it finishes or waits: for descriptions, or for partners to be posted."""
        stage, pc = self.lists[s], self.pc[s]
        while pc < len(stage):
            ops = p2p_ops(stage[pc])
            if ops:
                group = self.waiting[s]
                if group is None:
                    group = self.waiting[s] = self._post(s, ops)
                if not group[0][0][1] and not self._describe(group):
                    break
                if any(k >= len(theirs) or not theirs[k][1] for _, _, theirs, k, _, _ in group):
                    break
                self.waiting[s] = None
            pc += 1
        self.pc[s] = pc

    def _post(self, s: int, ops: Sequence[P2POp]) -> list[_Slot]:
        """Put stage ``s``'s group of ``ops`` on their channels' queues; its peers may now go on."""
        group = []
        for op in ops:
            pair, message = _key(op, s, self.num_stages)
            send = is_send(op)
            sends, receives = self.queues.setdefault(pair, ([], []))
            mine, theirs = (sends, receives) if send else (receives, sends)
            k = len(mine)
            entry = [message, False]
            mine.append(entry)
            if k < len(theirs) and theirs[k][0] != message:
                raise _Mismatch(f"ranks {pair}: {theirs[k][0]} meets {message}")
            peer = pair[1] if send else pair[0]
            self.ready.add(peer)
            group.append((entry, mine, theirs, k, send, peer))
        return group

    def _describe(self, group: list[_Slot]) -> bool:
        """Post ``group`` once every message it receives has been posted by its sender."""
        if any(k >= len(theirs) for _, _, theirs, k, send, _ in group if not send):
            return False
        for entry, _, _, _, _, peer in group:
            entry[1] = True
            self.ready.add(peer)
        return True

    def _post_again(self, s: int) -> bool:
        """Take stage ``s``'s waiting group off its queues and post the group now at its position.

        What had run stays valid when no peer can have acted on a change: an operation whose partner is
        posted is posted again at the same place on its channel, as the same message, and posted (its
        group described) again if it was; and if a peer may have completed on it, the group describes
        itself with no receive that the old group did not have (else its description could rest on what
        that peer did after). False otherwise."""
        old = self.waiting[s]
        self.ready.add(s)
        if old is None:
            return True
        for entry, mine, *_ in reversed(old):  # what a stage posts last is the tail of its queues
            if mine[-1] is not entry:
                return False
            mine.pop()
        self.waiting[s] = None
        stage, pc = self.lists[s], self.pc[s]
        ops = p2p_ops(stage[pc]) if pc < len(stage) else ()
        try:
            new = self._post(s, ops) if ops else []
        except _Mismatch:
            return False
        if new:
            self.waiting[s] = new
            self._describe(new)
        now = {(id(mine), k): entry for entry, mine, _, k, _, _ in new}
        seen = [(entry, mine, k) for entry, mine, theirs, k, _, _ in old if k < len(theirs)]
        for entry, mine, k in seen:
            again = now.get((id(mine), k))
            if again is None or again[0] != entry[0] or (entry[1] and not again[1]):
                return False
        if any(entry[1] for entry, _, _ in seen):
            before = {(id(mine), k): entry[0] for entry, mine, _, k, _, _ in old}
            if any(before.get((id(mine), k)) != entry[0] for entry, mine, _, k, send, _ in new if not send):
                return False
        return True
