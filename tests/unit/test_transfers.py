"""Grouped transfers: every schedule's lists run under rendezvous semantics (NCCL's unbuffered sends,
messages matched by order alone), at no cost to the schedule's own timeline."""

from __future__ import annotations

import pytest

from merak.pipeline.instructions import (
    Backward,
    Exchange,
    Forward,
    LoadMicrobatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    is_send,
    p2p_ops,
    peer_of,
)
from merak.pipeline.schedules import SCHEDULES, build_forward_only_schedule, build_schedule, schedule_info
from merak.pipeline.simulate import Costs, ScheduleError, simulate
from merak.pipeline.transfers import (
    _first_groups,
    _repair_from_scratch,
    _repair_resuming,
    group_transfers,
    message_of,
)

TAIL = [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]


def _shapes():
    """Every schedule at pp 2..8 with pp..4pp microbatches (interleaved: pp and 2pp microbatches with 2 and 3
    chunks, and the largest, 8 stages x 32 microbatches x 2 chunks: the repairs grow with microbatches x
    chunks, and 3pp or 4pp at 3 chunks adds seconds each without a new kind of repair)."""
    for name, info in SCHEDULES.items():
        for stages in range(2, 9):
            for microbatches in range(stages, 4 * stages + 1):
                if name == "shifted_critical_path" and microbatches < 4:
                    continue
                if info.chunked and microbatches not in (stages, 2 * stages):
                    continue
                for chunks in ((2, 3) if info.chunked else (1,)):
                    yield name, stages, microbatches, chunks
        if info.chunked:
            yield name, 8, 32, 2


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_runs_under_rendezvous_sends_and_keeps_its_timeline(name):
    costs = Costs(forward=1.0, backward=2.0, p2p=0.05)
    checked = 0
    for key, stages, microbatches, chunks in _shapes():
        if key != name:
            continue
        lists = [build_schedule(name=name, stage_id=s, num_stages=stages, num_microbatches=microbatches,
                                num_chunks=chunks) for s in range(stages)]
        simulate(lists, sends="rendezvous")
        info = schedule_info(name)
        placed = [info.build(s, stages, microbatches, *((chunks,) if info.chunked else ()))
                  for s in range(stages)]
        # Grouping moves a few sends, never the computes: the buffered timeline stays within 10 % of the
        # schedule's own (shifted_critical_path with few microbatches moves most: +5.4 % at pp=3, 4 microbatches).
        assert simulate(lists, costs).makespan <= simulate(placed, costs).makespan * 1.10, (stages, microbatches)
        checked += 1
    assert checked > 0


@pytest.mark.parametrize("stages,microbatches", [(2, 2), (4, 3), (8, 16)])
def test_forward_only_lists_run_under_rendezvous_sends(stages, microbatches):
    simulate([build_forward_only_schedule(stage_id=s, num_stages=stages, num_microbatches=microbatches)
              for s in range(stages)], sends="rendezvous")


def test_schedules_that_relied_on_buffered_sends_deadlock_as_placed():
    """The five schedules the grouping exists for: as their functions place the transfers, rendezvous
    sends deadlock (as they would on NCCL); grouped, they run."""
    for name in ("pre_recompute_1f1b", "last_no_recompute_1f1b", "shifted_critical_path", "interleaved_1f1b",
                 "zb_h1"):
        info = schedule_info(name)
        placed = [info.build(s, 4, 8, *((2,) if info.chunked else ())) for s in range(4)]
        simulate(placed)
        with pytest.raises(ScheduleError, match="deadlock"):
            simulate(placed, sends="rendezvous")
        simulate(group_transfers(placed), sends="rendezvous")


def test_both_peers_post_their_messages_in_one_order():
    """Per pair of ranks and direction, the sender's sends and the receiver's receives name the same
    messages in the same order (what NCCL matches by), interleaved at pp=2 included."""
    for name, stages, microbatches, chunks in [("interleaved_1f1b", 2, 4, 2), ("interleaved_1f1b", 4, 8, 3),
                                               ("zb_h1", 4, 8, 1), ("shifted_critical_path", 4, 8, 1)]:
        lists = [build_schedule(name=name, stage_id=s, num_stages=stages, num_microbatches=microbatches,
                                num_chunks=chunks) for s in range(stages)]
        sent, received = {}, {}
        for s, stage in enumerate(lists):
            for op in (op for instruction in stage for op in p2p_ops(instruction)):
                peer, _ = peer_of(op, s, stages)
                pair = (s, peer) if is_send(op) else (peer, s)
                (sent if is_send(op) else received).setdefault(pair, []).append(message_of(op, s, stages))
        assert sent == received, name


def test_a_crossing_pair_of_sends_is_grouped_by_delaying_the_harmless_send():
    # Stage 0 sends both activations before receiving gradient 0; stage 1 sends gradient 0 before it
    # receives activation 1. Unbuffered, both sends wait for receives posted behind them.
    stage0 = [LoadMicrobatch(0), Forward(0), SendActivation(0), LoadMicrobatch(1), Forward(1), SendActivation(1),
              RecvGrad(0), Backward(0), RecvGrad(1), Backward(1), *TAIL]
    stage1 = [RecvActivation(0), LoadMicrobatch(0), Forward(0), Backward(0), SendGrad(0),
              RecvActivation(1), LoadMicrobatch(1), Forward(1), Backward(1), SendGrad(1), *TAIL]
    grouped = group_transfers([stage0, stage1])
    simulate(grouped, sends="rendezvous")
    # Stage 1 reaches its receive of activation 1 right after sending gradient 0, while stage 0 needs
    # gradient 0 only after its second forward: stage 1's send joins that receive, as 1F1B's exchange.
    assert [i for i in grouped[1] if isinstance(i, Exchange)] == [Exchange((RecvActivation(1), SendGrad(0)))]
    assert Exchange((SendActivation(1), RecvGrad(0))) in grouped[0]  # adjacent already: one point
    for placed, stage in zip([stage0, stage1], grouped):
        assert [i for i in stage if not p2p_ops(i)] == [i for i in placed if not p2p_ops(i)]


def test_messages_posted_in_opposite_orders_in_one_direction_are_an_error():
    # Forward-only lists: stage 0 sends activation 1 before activation 0; stage 1 receives 0 first.
    stage0 = [LoadMicrobatch(0), Forward(0), LoadMicrobatch(1), Forward(1), SendActivation(1), LoadMicrobatch(2),
              Forward(2), SendActivation(0), SendActivation(2)]
    stage1 = [RecvActivation(m) if k == 0 else (LoadMicrobatch(m) if k == 1 else Forward(m))
              for m in range(3) for k in range(3)]
    with pytest.raises(ScheduleError, match="mismatch|opposite orders"):
        group_transfers([stage0, stage1])


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_resumed_repairs_give_the_reference_lists(name):
    """The repairs that go on from where the simulation stopped make the lists that simulating the whole
    step after each repair makes, without falling back to it."""
    info = schedule_info(name)
    for stages in (2, 3, 4):
        for microbatches in (stages, 2 * stages, 4 * stages):
            if name == "shifted_critical_path" and microbatches < 4:
                continue
            placed = [info.build(s, stages, microbatches, *((2,) if info.chunked else ())) for s in range(stages)]
            resumed = _repair_resuming(*_first_groups(placed))
            assert resumed is not None, (stages, microbatches)
            assert resumed == _repair_from_scratch(*_first_groups(placed)), (stages, microbatches)


def test_grouping_work_grows_linearly_with_the_microbatches(monkeypatch):
    """Repairs grow with the microbatches; each must not cost a simulation of the whole step again (that
    took 2 minutes per rank for interleaved pp=8 at 128 microbatches). Counted, not timed: how often the
    grouping and the simulator look at an instruction's transfers, and how many full simulations run."""
    import merak.pipeline.simulate as simulate_module
    import merak.pipeline.transfers as transfers_module

    looks, simulations = [0], [0]
    real_p2p_ops, real_simulate = transfers_module.p2p_ops, simulate_module.simulate

    def counted_p2p_ops(instruction):
        looks[0] += 1
        return real_p2p_ops(instruction)

    def counted_simulate(*args, **kwargs):
        simulations[0] += 1
        return real_simulate(*args, **kwargs)

    monkeypatch.setattr(transfers_module, "p2p_ops", counted_p2p_ops)
    monkeypatch.setattr(simulate_module, "p2p_ops", counted_p2p_ops)
    monkeypatch.setattr(simulate_module, "simulate", counted_simulate)
    info = schedule_info("interleaved_1f1b")
    work = {}
    for microbatches in (16, 64):
        lists = [info.build(s, 8, microbatches, 2) for s in range(8)]
        looks[0] = simulations[0] = 0
        grouped = group_transfers(lists)
        assert grouped != lists  # there were repairs to make
        work[microbatches] = looks[0], simulations[0]
    (looks_16, simulations_16), (looks_64, simulations_64) = work[16], work[64]
    assert looks_16 > 0
    # 4 times the microbatches: linear work is about 4 times (whole-step simulation per repair: 26 times).
    assert looks_64 <= 5 * looks_16, work
    assert simulations_64 == simulations_16, work
