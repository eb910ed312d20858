"""Pipeline schedules and the schedule simulator (pure Python, no torch)."""

from __future__ import annotations

import pytest

from merak.pipeline.instructions import (
    COMPUTE_TYPES,
    Backward,
    BackwardInput,
    BackwardWeight,
    Exchange,
    Forward,
    LoadMicrobatch,
    OptimizerStep,
    PreCheckpointForward,
    RecomputeForward,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    p2p_ops,
)
from merak.pipeline.schedules import (
    ALIASES,
    SCHEDULES,
    build_forward_only_schedule,
    build_schedule,
    schedule_info,
    schedule_names,
)
from merak.pipeline.simulate import (
    Costs,
    Deadlock,
    ScheduleError,
    instruction_label,
    render_text_timeline,
    simulate,
    validate_stage_list,
)
from merak.pipeline.transfers import group_transfers

TAIL = [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]


def all_stages(name: str, num_stages: int, num_microbatches: int, num_chunks: int = 1) -> list[list]:
    return [
        build_schedule(name=name, stage_id=s, num_stages=num_stages, num_microbatches=num_microbatches,
                       num_chunks=num_chunks)
        for s in range(num_stages)
    ]


def placed_stages(name: str, num_stages: int, num_microbatches: int) -> list[list]:
    """The lists as the schedule function places the transfers, before they are grouped."""
    build = schedule_info(name).build
    return [build(s, num_stages, num_microbatches) for s in range(num_stages)]


def position(stage, op) -> int:
    """Index of the instruction of ``stage`` that is, or holds, ``op``."""
    return next(i for i, instruction in enumerate(stage) if op == instruction or op in p2p_ops(instruction))


def labels(instructions) -> str:
    """The compute instructions of one stage as short labels: ``F0 PF1 R0 B0 BI1 W1 F2.1``."""
    return " ".join(instruction_label(i) for i in instructions if isinstance(i, COMPUTE_TYPES))


def compute_order(instructions) -> str:
    return " ".join(
        f"{'F' if isinstance(i, Forward) else 'B'}{i.microbatch}"
        for i in instructions
        if isinstance(i, (Forward, Backward))
    )


def test_registry_names():
    assert schedule_names(aliases=False) == list(SCHEDULES)
    assert {"gpipe", "1f1b", "ds_default"} <= set(schedule_names())


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "ds_default"])
def test_every_shape_simulates_with_textbook_bubble(name):
    # Unit compute, free p2p: every stage does 2M units of work and the last
    # microbatch's backward leaves stage 0 after 2(M + S - 1) units, so the
    # bubble is (S - 1) / (M + S - 1) for all three schedules.
    for num_stages in range(1, 9):
        for num_microbatches in range(1, 33):
            stages = all_stages(name, num_stages, num_microbatches)
            result = simulate(stages, Costs(forward=1.0, backward=1.0, p2p=0.0))
            for stage in stages:
                forwards = sorted(i.microbatch for i in stage if isinstance(i, Forward))
                backwards = sorted(i.microbatch for i in stage if isinstance(i, Backward))
                assert forwards == backwards == list(range(num_microbatches))
                assert stage[-3:] == TAIL
            assert result.busy == tuple([2.0 * num_microbatches] * num_stages)
            assert result.makespan == 2 * (num_microbatches + num_stages - 1)
            expected = (num_stages - 1) / (num_microbatches + num_stages - 1)
            assert result.bubble_fraction == pytest.approx(expected)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "ds_default"])
def test_loads_and_edge_stages(name):
    num_stages, num_microbatches = 4, 6
    for s, stage in enumerate(all_stages(name, num_stages, num_microbatches)):
        ops = [op for instr in stage for op in (p2p_ops(instr) or (instr,))]
        loads = [i for i, instr in enumerate(stage) if isinstance(instr, LoadMicrobatch)]
        if s in (0, num_stages - 1):
            assert len(loads) == num_microbatches
            for i in loads:
                assert stage[i + 1] == Forward(stage[i].microbatch)
        else:
            assert loads == []
        if s == 0:
            assert not any(isinstance(op, (RecvActivation, SendGrad)) for op in ops)
        if s == num_stages - 1:
            assert not any(isinstance(op, (SendActivation, RecvGrad)) for op in ops)


def test_single_stage_loads_before_every_forward():
    for name in schedule_names():
        if schedule_info(name).chunked:
            # Interleaving needs at least two stages to place chunks on.
            with pytest.raises(ValueError, match=r"num_stages >= 2"):
                all_stages(name, 1, 4, num_chunks=2)
            continue
        # M=4: shifted_critical_path needs M >= 4.
        (stage,) = all_stages(name, 1, 4)
        assert [type(i) for i in stage[:2]] == [LoadMicrobatch, Forward], name
        assert sum(isinstance(i, LoadMicrobatch) for i in stage) == 4
        assert not any(p2p_ops(i) for i in stage)
        # A single stage has no drain bubble to fill: nothing is pre-checkpointed.
        assert not any(isinstance(i, (PreCheckpointForward, RecomputeForward)) for i in stage), name


def test_1f1b_exact_compute_order():
    stages = all_stages("1f1b", 4, 8)
    assert compute_order(stages[0]) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    assert compute_order(stages[1]) == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7"
    assert compute_order(stages[3]) == " ".join(f"F{m} B{m}" for m in range(8))


def test_gpipe_order_and_no_exchange():
    for placed, stage in zip(placed_stages("gpipe", 3, 4), all_stages("gpipe", 3, 4)):
        assert compute_order(stage) == "F0 F1 F2 F3 B0 B1 B2 B3"
        assert not any(isinstance(i, Exchange) for i in placed)


def test_1f1b_uses_exchanges():
    for num_stages in range(2, 6):
        for num_microbatches in range(num_stages + 1, num_stages + 4):
            stages = all_stages("1f1b", num_stages, num_microbatches)
            assert any(isinstance(i, Exchange) for stage in stages for i in stage)
            # Only stages with a neighbour on the same side batch with it.
            for stage in stages:
                for instr in stage:
                    if isinstance(instr, Exchange):
                        assert len(instr.ops) == 2


def test_ds_default_is_1f1b_without_exchanges():
    for num_stages in range(1, 7):
        for num_microbatches in (1, 2, num_stages, 2 * num_stages + 1):
            ds = placed_stages("ds_default", num_stages, num_microbatches)
            ref = all_stages("1f1b", num_stages, num_microbatches)
            for s in range(num_stages):
                assert not any(isinstance(i, Exchange) for i in ds[s])
                assert compute_order(ds[s]) == compute_order(ref[s])


def test_ds_default_orders_by_parity():
    stages = placed_stages("ds_default", 4, 8)
    odd, even = stages[1], stages[2]
    # Stage 2 (even) sends its activation before receiving the gradient.
    i = even.index(SendActivation(2))
    assert even[i + 1] == RecvGrad(1)
    # Stage 1 (odd) receives the gradient before sending the activation.
    j = odd.index(RecvGrad(0))
    assert odd[j + 1] == SendActivation(2)


@pytest.mark.parametrize("num_stages,num_microbatches", [(1, 1), (2, 5), (4, 3), (8, 16)])
def test_forward_only(num_stages, num_microbatches):
    stages = [
        build_forward_only_schedule(stage_id=s, num_stages=num_stages, num_microbatches=num_microbatches)
        for s in range(num_stages)
    ]
    result = simulate(stages)
    for stage in stages:
        assert compute_order(stage) == " ".join(f"F{m}" for m in range(num_microbatches))
        assert not any(isinstance(i, (Backward, OptimizerStep, RecvGrad, SendGrad)) for i in stage)
    # Inference takes M + S - 1 unit steps.
    assert result.makespan == num_microbatches + num_stages - 1


def test_costs_and_custom_cost_model():
    stages = all_stages("1f1b", 2, 4)
    slow = simulate(stages, Costs(forward=1.0, backward=2.0, p2p=0.5, other=0.25))
    assert slow.busy == (12.0, 12.0)
    assert slow.makespan > 2 * (4 + 2 - 1)

    class PerStage:
        def of(self, stage_id, instruction):
            if isinstance(instruction, (Forward, Backward)):
                return 2.0 if stage_id == 1 else 1.0
            return 0.0

    result = simulate(stages, PerStage())
    assert result.busy == (8.0, 16.0)
    events = [e for e in result.timeline if e.stage == 1 and isinstance(e.instruction, Forward)]
    assert all(e.end - e.start == 2.0 for e in events)


def test_timeline_covers_every_instruction():
    stages = all_stages("ds_default", 3, 4)
    result = simulate(stages)
    assert len(result.timeline) == sum(len(s) for s in stages)
    for s, stage in enumerate(stages):
        assert [e.instruction for e in result.timeline if e.stage == s] == stage


def test_deadlock_is_reported():
    stage0 = [LoadMicrobatch(0), Forward(0), RecvGrad(0), SendActivation(0), Backward(0), *TAIL]
    stage1 = [RecvActivation(0), LoadMicrobatch(0), Forward(0), Backward(0), SendGrad(0), *TAIL]
    # Both stages block on a receive whose send comes later on the other stage:
    # a deadlock whatever the send model.
    pattern = (r"deadlock.*stage 0 blocked at #2 RecvGrad\(0\) \(waiting for a description\); "
               r"stage 1 blocked at #0 RecvActivation\(0\) \(waiting for a description\)")
    for sends in ("eager", "rendezvous"):
        with pytest.raises(ScheduleError, match=pattern):
            simulate([stage0, stage1], sends=sends)


def test_rendezvous_send_deadlock_is_reported_but_eager_sends_pass():
    # Stage 0 sends both activations before receiving a gradient; stage 1 sends
    # gradient 0 before receiving activation 1. Blocking (rendezvous) sends meet
    # head to head; posted (eager) sends, as the executor's, do not.
    stage0 = [LoadMicrobatch(0), Forward(0), SendActivation(0), LoadMicrobatch(1), Forward(1), SendActivation(1),
              RecvGrad(0), Backward(0), RecvGrad(1), Backward(1), *TAIL]
    stage1 = [RecvActivation(0), LoadMicrobatch(0), Forward(0), Backward(0), SendGrad(0),
              RecvActivation(1), LoadMicrobatch(1), Forward(1), Backward(1), SendGrad(1), *TAIL]
    with pytest.raises(ScheduleError, match=r"deadlock.*stage 0 blocked at #5 SendActivation\(1\); "
                                            r"stage 1 blocked at #4 SendGrad\(0\)"):
        simulate([stage0, stage1], sends="rendezvous")
    result = simulate([stage0, stage1])
    assert result.makespan == 6.0
    assert simulate([stage0, stage1], sends="eager") == result


def test_simulate_rejects_unknown_send_model():
    with pytest.raises(ValueError, match=r"sends='buffered'.*eager.*rendezvous"):
        simulate(all_stages("1f1b", 2, 2), sends="buffered")


def test_fifo_mismatch_is_reported():
    stage0 = [LoadMicrobatch(0), Forward(0), LoadMicrobatch(1), Forward(1), SendActivation(1), SendActivation(0)]
    stage1 = [RecvActivation(0), LoadMicrobatch(0), Forward(0), RecvActivation(1), LoadMicrobatch(1), Forward(1)]
    pattern = (r"message mismatch between ranks 0 -> 1 \(FIFO pair #0\): "
               r"SendActivation\(1\) on stage 0 \(instruction #4\) meets RecvActivation\(0\) on stage 1")
    for sends in ("eager", "rendezvous"):
        with pytest.raises(ScheduleError, match=pattern):
            simulate([stage0, stage1], sends=sends)


def test_an_exchange_waits_for_the_description_of_what_it_receives():
    # An Exchange on stage 0 sends activation 0 and receives gradient 0, which stage 1 sends only after it
    # has received activation 0: the group posts nothing before the gradient's description has come (its
    # sender reached its send), so both wait. Grouping the lists splits the Exchange, its send first.
    stage0 = [LoadMicrobatch(0), Forward(0), Exchange((SendActivation(0), RecvGrad(0))), Backward(0), *TAIL]
    stage1 = [RecvActivation(0), LoadMicrobatch(0), Forward(0), Backward(0), SendGrad(0), *TAIL]
    for sends in ("eager", "rendezvous"):
        with pytest.raises(Deadlock) as stuck:
            simulate([stage0, stage1], sends=sends)
        assert stuck.value.positions == [2, 0] and stuck.value.phases == ["descriptions", "transfer"]
    grouped = group_transfers([stage0, stage1])
    assert grouped[0][2:4] == [SendActivation(0), RecvGrad(0)]
    assert simulate(grouped).makespan == simulate(grouped, sends="rendezvous").makespan == 4.0


def test_missing_backward_is_reported():
    stages = all_stages("1f1b", 2, 4)
    missing = [list(s) for s in stages]
    missing[1] = [i for i in stages[1] if i != Backward(2)]
    with pytest.raises(ScheduleError, match=r"stage 1: microbatch 2 \(chunk 0\) needs exactly one of Backward "
                                            r"and BackwardInput\+BackwardWeight"):
        simulate(missing)
    doubled = [list(s) for s in stages]
    doubled[1].insert(doubled[1].index(Backward(2)) + 1, Backward(2))
    with pytest.raises(ScheduleError, match=r"stage 1: expected no or exactly one Backward\(2\), found 2"):
        simulate(doubled)


def test_send_to_missing_stage_is_reported():
    stages = [build_forward_only_schedule(stage_id=s, num_stages=2, num_microbatches=2) for s in range(2)]
    stages[1].append(SendActivation(1))
    with pytest.raises(ScheduleError, match=r"stage 1: instruction #6 SendActivation\(1\) talks to "
                                            r"non-existent virtual stage 2"):
        simulate(stages)
    with pytest.raises(ScheduleError, match=r"RecvActivation\(0\) talks to non-existent virtual stage -1"):
        simulate([[RecvActivation(0), LoadMicrobatch(0), Forward(0)]])


def test_validate_stage_list_structure():
    good = build_schedule(name="1f1b", stage_id=1, num_stages=3, num_microbatches=4)
    validate_stage_list(1, 3, 4, good)
    with pytest.raises(ScheduleError, match=r"OptimizerStep"):
        validate_stage_list(1, 3, 4, good[:-1])
    swapped = list(good)
    i, j = swapped.index(RecvActivation(0)), swapped.index(Forward(0))
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(ScheduleError, match=r"stage 1: RecvActivation\(0\) \(#\d+\) must come before "
                                            r"Forward\(0\) \(#\d+\)"):
        validate_stage_list(1, 3, 4, swapped)
    # A middle stage loads no data.
    with pytest.raises(ScheduleError, match=r"stage 1: expected no LoadMicrobatch\(0\), found 1 \(at \[0\]\)"):
        validate_stage_list(1, 3, 4, [LoadMicrobatch(0), *good])


def test_build_schedule_rejects_unknown_name():
    with pytest.raises(ValueError, match=r"'zb'.*1f1b.*ds_default.*gpipe") as info:
        build_schedule(name="zb", stage_id=0, num_stages=2, num_microbatches=2)
    for name in schedule_names():
        assert name in str(info.value)


@pytest.mark.parametrize(
    "stage_id,num_stages,num_microbatches,pattern",
    [(2, 2, 4, r"stage_id.*2"), (-1, 2, 4, r"-1"), (0, 0, 4, r"num_stages.*0"), (0, 2, 0, r"num_microbatches.*0")],
)
def test_build_schedule_rejects_bad_numbers(stage_id, num_stages, num_microbatches, pattern):
    with pytest.raises(ValueError, match=pattern):
        build_schedule(name="1f1b", stage_id=stage_id, num_stages=num_stages, num_microbatches=num_microbatches)
    with pytest.raises(ValueError, match=pattern):
        build_forward_only_schedule(stage_id=stage_id, num_stages=num_stages, num_microbatches=num_microbatches)


def test_render_text_timeline():
    result = simulate(all_stages("1f1b", 4, 8))
    text = render_text_timeline(result, 4)
    rows = text.splitlines()
    assert len(rows) == 4
    assert rows[0].startswith("s0 |F0 F1 F2 F3")
    assert "B0" in rows[3] and "F7" in rows[3]
    assert "." in rows[0]
    assert render_text_timeline(result, 4) == text
    narrow = render_text_timeline(result, 4, width=30)
    assert all(len(row) <= len("s0 |") + 30 for row in narrow.splitlines())


def test_simulate_cli_prints_bubble_and_timeline(capsys):
    from merak.pipeline.cli import main

    assert main(["--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--backward", "1"]) == 0
    out = capsys.readouterr().out
    assert "makespan 22, bubble 27.3%" in out
    rows = out.splitlines()[1:]
    assert [row[:4] for row in rows] == ["s0 |", "s1 |", "s2 |", "s3 |"]
    assert rows[0].startswith("s0 |F0 F1 F2 F3 .. .. .. B0")
    assert main(["--stages", "0"]) == 2


# --- Merak, interleaved and zero-bubble schedules ---------------------------------------------

SWEEP_MICROBATCHES = (1, 2, 3, 4, 5, 7, 8, 16, 32)
RENDEZVOUS_SAFE = ("1f1b", "ds_default", "gpipe")
RECOMPUTING = ("pre_recompute_1f1b", "last_no_recompute_1f1b", "shifted_critical_path",
               *ALIASES)


def shape_error(name: str, num_stages: int, num_microbatches: int, num_chunks: int) -> str | None:
    """The ValueError a schedule documents for this shape (a regex), or None if it accepts it."""
    key = ALIASES.get(name, name)
    if key == "shifted_critical_path" and num_microbatches < max(4, num_stages):
        return r"shifted_critical_path needs num_microbatches >= max\(4, num_stages\)"
    if key == "interleaved_1f1b":
        if num_stages < 2 or num_chunks < 2:
            return r"interleaved_1f1b needs num_stages >= 2 and num_chunks >= 2"
        if num_microbatches % num_stages:
            return r"interleaved_1f1b needs num_microbatches to be a multiple of num_stages"
    if not schedule_info(name).chunked and num_chunks != 1:
        return r"runs one model chunk per stage"
    return None


def in_flight_peak(stage, release=(Backward, BackwardWeight)) -> int:
    """Most microbatches (per chunk) whose forward ran and whose ``release`` has not yet, on one stage."""
    live, peak = 0, 0
    for instr in stage:
        if isinstance(instr, (Forward, PreCheckpointForward)):
            live += 1
            peak = max(peak, live)
        elif isinstance(instr, release):
            live -= 1
    return peak


def test_registry_flags_and_aliases():
    assert set(ALIASES) == {"early_recompute_1f1b", "full_critical_path"}
    assert schedule_names() == list(SCHEDULES) + list(ALIASES)
    assert schedule_names()[0] == "1f1b"
    for alias, target in ALIASES.items():
        assert target in SCHEDULES
        assert schedule_info(alias) is SCHEDULES[target]
    # The last stage of these keeps full activations; shifted needs stage-aware ratios.
    assert [n for n, i in SCHEDULES.items() if not i.last_stage_checkpoints] == [
        "last_no_recompute_1f1b", "shifted_critical_path"]
    assert [n for n, i in SCHEDULES.items() if i.needs_checkpoint_ratio] == ["shifted_critical_path"]
    assert [n for n, i in SCHEDULES.items() if i.chunked] == ["interleaved_1f1b"]
    with pytest.raises(ValueError, match=r"unknown pipeline schedule 'early_recompute'.*early_recompute_1f1b"):
        schedule_info("early_recompute")


@pytest.mark.parametrize("num_stages", range(1, 9))
@pytest.mark.parametrize("name", schedule_names())
def test_every_schedule_validates_and_simulates(name, num_stages):
    costs = Costs(forward=1.0, backward=2.0)
    chunk_counts = (2, 3) if schedule_info(name).chunked else (1,)
    built = 0
    # S and 2S too, so that interleaving (M a multiple of S) runs at every S >= 2.
    for num_microbatches in sorted({*SWEEP_MICROBATCHES, num_stages, 2 * num_stages}):
        for num_chunks in chunk_counts:
            if num_chunks > 2 and num_microbatches > 2 * num_stages:
                continue  # more microbatches are swept at 2 chunks; 3 adds seconds of grouping, no new case
            error = shape_error(name, num_stages, num_microbatches, num_chunks)
            if error is not None:
                for s in range(num_stages):
                    with pytest.raises(ValueError, match=error):
                        build_schedule(name=name, stage_id=s, num_stages=num_stages,
                                       num_microbatches=num_microbatches, num_chunks=num_chunks)
                continue
            built += 1
            stages = all_stages(name, num_stages, num_microbatches, num_chunks)
            everything = [(c, m) for c in range(num_chunks) for m in range(num_microbatches)]
            for s, stage in enumerate(stages):
                validate_stage_list(s, num_stages, num_microbatches, stage, num_chunks=num_chunks)
                assert stage[-3:] == TAIL
                forwards = sorted((i.chunk, i.microbatch) for i in stage
                                  if isinstance(i, (Forward, PreCheckpointForward)))
                backwards = sorted((i.chunk, i.microbatch) for i in stage
                                   if isinstance(i, (Backward, BackwardInput)))
                assert forwards == backwards == everything
            result = simulate(stages, costs)
            # Every stage computes M*V forwards and backwards, plus one forward per recompute.
            recomputes = [sum(isinstance(i, RecomputeForward) for i in stage) for stage in stages]
            per_chunk = 3.0 * num_microbatches * num_chunks
            assert result.busy == tuple(per_chunk + r for r in recomputes)
            assert result.makespan >= max(result.busy)
            assert 0.0 <= result.bubble_fraction < 1.0
            assert len(result.timeline) == sum(len(stage) for stage in stages)
            if ALIASES.get(name, name) in RENDEZVOUS_SAFE:
                # Safe whatever buffering the backend has; with free p2p, no slower either.
                assert simulate(stages, costs, sends="rendezvous").makespan == result.makespan
                slow_p2p = Costs(forward=1.0, backward=2.0, p2p=0.25)
                assert (simulate(stages, slow_p2p, sends="rendezvous").makespan
                        >= simulate(stages, slow_p2p).makespan)
    # Only interleaving on a single stage has no valid shape at all.
    assert (built == 0) == (schedule_info(name).chunked and num_stages == 1)


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_alias_builds_the_same_lists_as_its_target(alias):
    for num_stages in (1, 2, 4, 8):
        for num_microbatches in (4, 8, 16):
            if shape_error(alias, num_stages, num_microbatches, 1):
                continue
            assert all_stages(alias, num_stages, num_microbatches) == \
                all_stages(ALIASES[alias], num_stages, num_microbatches)


def test_pre_recompute_exact_compute_order():
    stages = all_stages("pre_recompute_1f1b", 4, 8)
    assert labels(stages[0]) == "F0 F1 F2 F3 B0 F4 B1 PF5 B2 PF6 B3 PF7 B4 R5 B5 R6 B6 R7 B7"
    assert labels(stages[1]) == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 PF6 B4 PF7 B5 R6 B6 R7 B7"
    assert labels(stages[3]) == " ".join(f"F{m} B{m}" for m in range(8))


@pytest.mark.parametrize("num_stages,num_microbatches", [(2, 1), (3, 2), (4, 8), (5, 3), (8, 16)])
def test_pre_recompute_checkpoints_exactly_the_drain(num_stages, num_microbatches):
    ref = all_stages("1f1b", num_stages, num_microbatches)
    for s, stage in enumerate(all_stages("pre_recompute_1f1b", num_stages, num_microbatches)):
        drain = min(num_stages - s - 1, num_microbatches)
        assert [i.microbatch for i in stage if isinstance(i, PreCheckpointForward)] == \
            list(range(num_microbatches - drain, num_microbatches))
        # Apart from the forward kinds and the recomputes, it is 1F1B's order.
        plain = labels(stage).replace("PF", "F").split()
        assert " ".join(x for x in plain if not x.startswith("R")) == labels(ref[s])


def test_shifted_critical_path_exact_compute_order():
    stages = all_stages("shifted_critical_path", 4, 8)
    assert labels(stages[1]) == "PF0 F1 F2 R0 B0 F3 B1 F4 B2 F5 B3 PF6 B4 PF7 B5 R6 B6 R7 B7"
    assert labels(stages[2]) == "PF0 PF1 F2 R0 B0 R1 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7"
    assert labels(stages[3]) == " ".join(f"F{m} B{m}" for m in range(8))


@pytest.mark.parametrize("num_stages,num_microbatches", [(2, 4), (3, 5), (5, 5), (8, 8), (8, 32)])
def test_shifted_critical_path_shape(num_stages, num_microbatches):
    stages = all_stages("shifted_critical_path", num_stages, num_microbatches)
    m = num_microbatches
    steady = " ".join(f"F{i + 1} B{i}" for i in range(2, m - 1))
    assert labels(stages[-2]) == f"PF0 PF1 F2 R0 B0 R1 B1 {steady} B{m - 1}"
    if num_stages >= 3:
        third = labels(stages[-3]).split()
        assert third[0] == "PF0"
        assert third[third.index("B0") - 1] == "R0"


@pytest.mark.parametrize("name", ["shifted_critical_path", "last_no_recompute_1f1b"])
@pytest.mark.parametrize("num_stages,num_microbatches", [(1, 4), (2, 4), (4, 8), (8, 16)])
def test_last_stage_never_recomputes(name, num_stages, num_microbatches):
    last = all_stages(name, num_stages, num_microbatches)[-1]
    assert not any(isinstance(i, (PreCheckpointForward, RecomputeForward)) for i in last)
    assert labels(last) == labels(all_stages("1f1b", num_stages, num_microbatches)[-1])


def test_last_no_recompute_recomputes_microbatch_0_before_the_last_stage():
    stages = all_stages("last_no_recompute_1f1b", 4, 8)
    assert labels(stages[2]) == "PF0 F1 R0 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 PF7 B6 R7 B7"
    assert labels(stages[0]) == labels(all_stages("pre_recompute_1f1b", 4, 8)[0])


@pytest.mark.parametrize("name", RECOMPUTING)
def test_recompute_comes_before_blocking_on_the_gradient(name):
    seen = 0
    for num_stages in range(2, 9):
        for num_microbatches in (1, 2, 4, 5, 8, 16):
            if shape_error(name, num_stages, num_microbatches, 1):
                continue
            for s, stage in enumerate(all_stages(name, num_stages, num_microbatches)):
                compute = [i for i in stage if isinstance(i, COMPUTE_TYPES)]
                for idx, instr in enumerate(stage):
                    if not isinstance(instr, RecomputeForward):
                        continue
                    seen += 1
                    m = instr.microbatch
                    assert stage.index(PreCheckpointForward(m)) < idx
                    if s < num_stages - 1:
                        assert idx < position(stage, RecvGrad(m)), (name, num_stages, num_microbatches, s, m)
                    # Its backward is the very next compute: the recomputed activations are used at once.
                    assert compute[compute.index(instr) + 1] == Backward(m)
    assert seen > 0


@pytest.mark.parametrize("num_stages,num_microbatches", [(2, 4), (4, 8), (4, 16), (8, 16), (8, 32)])
def test_zb_h1_makespan_and_memory(num_stages, num_microbatches):
    costs = Costs(forward=1.0, backward=2.0)  # so BackwardInput = BackwardWeight = 1
    zb = all_stages("zb_h1", num_stages, num_microbatches)
    assert simulate(zb, costs).makespan == num_microbatches * 3 + (num_stages - 1)
    one_f_one_b = all_stages("1f1b", num_stages, num_microbatches)
    assert simulate(one_f_one_b, costs).makespan == num_microbatches * 3 + (num_stages - 1) * 3
    for s, stage in enumerate(zb):
        # At most S microbatches held between Forward and BackwardWeight: 1F1B's first-stage peak.
        assert in_flight_peak(stage, release=BackwardWeight) <= num_stages
        assert in_flight_peak(stage, release=BackwardWeight) >= in_flight_peak(one_f_one_b[s])
        # Without the weight halves it is 1F1B's order.
        halves = labels(stage).replace("BI", "B").split()
        assert " ".join(x for x in halves if not x.startswith("W")) == labels(one_f_one_b[s])
        assert not any(isinstance(i, Backward) for i in stage)
    assert in_flight_peak(zb[0], release=BackwardWeight) == num_stages


def test_zb_h1_exact_compute_order():
    stages = all_stages("zb_h1", 4, 8)
    assert labels(stages[0]) == "F0 F1 F2 F3 BI0 W0 F4 BI1 W1 F5 BI2 W2 F6 BI3 W3 F7 BI4 W4 BI5 W5 BI6 W6 BI7 W7"
    assert labels(stages[3]) == ("F0 BI0 F1 BI1 F2 BI2 F3 BI3 W0 F4 BI4 W1 F5 BI5 W2 F6 BI6 W3 F7 BI7 W4 "
                                 "W5 W6 W7")


@pytest.mark.parametrize("num_stages,num_microbatches,num_chunks",
                         [(2, 4, 2), (4, 8, 2), (4, 16, 2), (8, 16, 2), (4, 8, 4)])
def test_interleaved_shrinks_the_bubble_by_the_chunk_count(num_stages, num_microbatches, num_chunks):
    # Each chunk holds 1/V of the model, so its forward and backward cost 1/V of a whole stage's.
    chunked = Costs(forward=1.0 / num_chunks, backward=2.0 / num_chunks)
    interleaved = simulate(all_stages("interleaved_1f1b", num_stages, num_microbatches, num_chunks), chunked)
    plain = simulate(all_stages("1f1b", num_stages, num_microbatches), Costs(forward=1.0, backward=2.0))
    assert interleaved.makespan < plain.makespan
    assert interleaved.makespan == pytest.approx(num_microbatches * 3 + (num_stages - 1) * 3 / num_chunks)
    assert plain.makespan == num_microbatches * 3 + (num_stages - 1) * 3
    assert interleaved.busy == pytest.approx(plain.busy)


def test_interleaved_beats_1f1b_at_4_stages_8_microbatches():
    interleaved = simulate(all_stages("interleaved_1f1b", 4, 8, 2), Costs(forward=0.5, backward=1.0))
    plain = simulate(all_stages("1f1b", 4, 8), Costs(forward=1.0, backward=2.0))
    assert interleaved.makespan < plain.makespan
    assert interleaved.bubble_fraction < plain.bubble_fraction


def test_interleaved_chunks_and_order():
    stages = all_stages("interleaved_1f1b", 4, 8, 2)
    # Groups of S microbatches go through chunk 0, then chunk 1; backwards mirror it.
    assert labels(stages[3]).split()[:6] == ["F0", "F1", "F2", "F3", "F0.1", "B0.1"]
    assert labels(stages[0]).split()[-4:] == ["B4", "B5", "B6", "B7"]
    for s, stage in enumerate(stages):
        ops = [op for instr in stage for op in (p2p_ops(instr) or (instr,))]
        # Chunk 1 of stage 0 receives from stage 3's chunk 0; chunk 0 of stage 3 sends on.
        assert sum(isinstance(op, RecvActivation) and op.chunk == 1 for op in ops) == 8
        assert sum(isinstance(op, SendActivation) and op.chunk == 0 for op in ops) == 8
        # Only the ends of the chain of virtual stages load data.
        loads = {(op.chunk, op.microbatch) for op in ops if isinstance(op, LoadMicrobatch)}
        expected = {(0, m) for m in range(8)} if s == 0 else set()
        expected |= {(1, m) for m in range(8)} if s == 3 else set()
        assert loads == expected
        # Warm-up is 2(S - s - 1) + (V - 1) S forwards; the first steady step's forward
        # comes before the first backward.
        first_backward = [isinstance(i, Backward) for i in stage if isinstance(i, COMPUTE_TYPES)].index(True)
        assert first_backward == 2 * (4 - s - 1) + 4 + 1


@pytest.mark.parametrize("num_stages,num_microbatches,num_chunks,pattern", [
    (1, 4, 2, r"num_stages >= 2"),
    (4, 6, 2, r"multiple of num_stages: 6 % 4 != 0"),
    (4, 8, 1, r"num_chunks >= 2.*num_chunks=1"),
    (4, 8, 0, r"num_chunks >= 2"),
])
def test_interleaved_rejects_bad_shapes(num_stages, num_microbatches, num_chunks, pattern):
    with pytest.raises(ValueError, match=pattern):
        build_schedule(name="interleaved_1f1b", stage_id=0, num_stages=num_stages,
                       num_microbatches=num_microbatches, num_chunks=num_chunks)


def test_interleaved_needs_an_explicit_chunk_count():
    # build_schedule's default is one chunk, which interleaving rejects.
    with pytest.raises(ValueError, match=r"num_chunks >= 2"):
        build_schedule(name="interleaved_1f1b", stage_id=0, num_stages=4, num_microbatches=8)


@pytest.mark.parametrize("name", [n for n in schedule_names() if not schedule_info(n).chunked])
def test_non_chunked_schedules_reject_chunks(name):
    with pytest.raises(ValueError, match=rf"schedule '{name}' runs one model chunk per stage, got num_chunks=2"):
        build_schedule(name=name, stage_id=0, num_stages=4, num_microbatches=8, num_chunks=2)
    # One chunk is the same as not asking.
    assert build_schedule(name=name, stage_id=0, num_stages=4, num_microbatches=8, num_chunks=1) == \
        build_schedule(name=name, stage_id=0, num_stages=4, num_microbatches=8)


def test_pre_recompute_moves_recomputation_off_the_critical_path():
    costs = Costs(forward=1.0, backward=2.0, checkpoint_ratios=(1.0,) * 4)
    pre = simulate(all_stages("pre_recompute_1f1b", 4, 8), costs)
    plain = simulate(all_stages("1f1b", 4, 8), costs)
    assert pre.makespan < plain.makespan
    # Same amount of recomputation in total: only where it happens changed.
    assert sum(pre.busy) == sum(plain.busy)
    # Without checkpointing there is nothing to move, and pre-recompute only adds work.
    free = Costs(forward=1.0, backward=2.0)
    assert simulate(all_stages("1f1b", 4, 8), free).makespan < plain.makespan


def test_costs_price_recompute_and_split_backwards():
    costs = Costs(forward=1.0, backward=2.0, recompute=0.5, checkpoint_ratios=(0.5,))
    # A plain Forward checkpoints half the stage: its backward recomputes 0.5 * 0.5.
    plain = [LoadMicrobatch(0), Forward(0), Backward(0), *TAIL]
    assert simulate([plain], costs).makespan == 3.25
    split = [LoadMicrobatch(0), Forward(0), BackwardInput(0), BackwardWeight(0), *TAIL]
    assert simulate([split], costs).makespan == 3.25
    assert simulate([split], Costs(forward=1.0, backward=2.0, backward_input=1.5)).timeline[2].end == 2.5
    # A pre-checkpointed forward is recomputed in full, then the backward has nothing left to recompute.
    early = [LoadMicrobatch(0), PreCheckpointForward(0), RecomputeForward(0), Backward(0), *TAIL]
    result = simulate([early], costs)
    assert result.makespan == 3.5
    assert result.busy == (3.5,)


def test_instruction_repr_and_labels():
    assert repr(Forward(3)) == "Forward(3)"
    assert repr(Forward(3, chunk=1)) == "Forward(3, chunk=1)"
    assert repr(RecomputeForward(2)) == "RecomputeForward(2)"
    assert Forward(3) == Forward(3, 0) != Forward(3, 1)
    got = [instruction_label(i) for i in (Forward(3), PreCheckpointForward(3), RecomputeForward(3), Backward(3),
                                          BackwardInput(3), BackwardWeight(3), Forward(3, chunk=1))]
    assert got == ["F3", "PF3", "R3", "B3", "BI3", "W3", "F3.1"]


def one_stage(*compute):
    """A single-stage training list (S=1, M=1): load, the compute given, the step end."""
    return [LoadMicrobatch(0), *compute, *TAIL]


@pytest.mark.parametrize("compute,pattern", [
    ((PreCheckpointForward(0), Backward(0)), r"stage 0: expected exactly one RecomputeForward\(0\), found 0"),
    ((Forward(0), RecomputeForward(0), Backward(0)), r"stage 0: expected no RecomputeForward\(0\), found 1"),
    ((PreCheckpointForward(0), Backward(0), RecomputeForward(0)),
     r"stage 0: RecomputeForward\(0\) \(#3\) must come before Backward\(0\) \(#2\)"),
    ((RecomputeForward(0), PreCheckpointForward(0), Backward(0)),
     r"stage 0: PreCheckpointForward\(0\) \(#2\) must come before RecomputeForward\(0\) \(#1\)"),
    ((Forward(0), PreCheckpointForward(0), RecomputeForward(0), Backward(0)),
     r"microbatch 0 \(chunk 0\) needs exactly one of Forward and PreCheckpointForward"),
    ((Forward(0), Backward(0), BackwardInput(0), BackwardWeight(0)),
     r"microbatch 0 \(chunk 0\) needs exactly one of Backward and BackwardInput\+BackwardWeight"),
    ((Forward(0), BackwardWeight(0), BackwardInput(0)),
     r"stage 0: BackwardInput\(0\) \(#3\) must come before BackwardWeight\(0\) \(#2\)"),
    ((Forward(0), BackwardInput(0)), r"stage 0: expected exactly one BackwardWeight\(0\), found 0"),
    ((Forward(0), Backward(0), BackwardWeight(0)), r"stage 0: expected no BackwardWeight\(0\), found 1"),
    ((BackwardInput(0), Forward(0), BackwardWeight(0)),
     r"stage 0: Forward\(0\) \(#2\) must come before BackwardInput\(0\) \(#1\)"),
    ((Forward(0), Backward(0), Forward(0, chunk=1)),
     r"stage 0: instruction #3 Forward\(0, chunk=1\) has chunk outside \[0, 0\]"),
])
def test_validation_errors_name_the_instruction(compute, pattern):
    with pytest.raises(ScheduleError, match=pattern):
        validate_stage_list(0, 1, 1, one_stage(*compute))


def test_validation_of_chunks():
    stages = all_stages("interleaved_1f1b", 2, 2, 2)
    for s, stage in enumerate(stages):
        validate_stage_list(s, 2, 2, stage, num_chunks=2)
    # Read as a one-chunk list, stage 0's first chunk-1 instruction is out of range.
    first = next(i for i, instr in enumerate(stages[0])
                 if any(getattr(item, "chunk", 0) == 1 for item in (p2p_ops(instr) or (instr,))))
    with pytest.raises(ScheduleError, match=rf"stage 0: instruction #{first} RecvActivation\(0, chunk=1\) has "
                                            r"chunk outside \[0, 0\]"):
        validate_stage_list(0, 2, 2, stages[0], num_chunks=1)
    with pytest.raises(ScheduleError, match=r"stage 0: instruction #\d+ Forward\(0, chunk=2\) has chunk "
                                            r"outside \[0, 1\]"):
        validate_stage_list(0, 2, 2, [*stages[0][:-3], Forward(0, chunk=2), *TAIL], num_chunks=2)
    # simulate infers the chunk count; a negative chunk is out of range there too.
    with pytest.raises(ScheduleError, match=r"Forward\(0, chunk=-1\) has chunk outside \[0, 0\]"):
        simulate([one_stage(Forward(0, chunk=-1), Backward(0))])
    # The last virtual stage (chunk 1 of stage 1) sends nowhere.
    broken = [list(s) for s in stages]
    broken[1].insert(0, SendActivation(0, 1))
    with pytest.raises(ScheduleError, match=r"stage 1: instruction #0 SendActivation\(0, chunk=1\) talks to "
                                            r"non-existent virtual stage 4 \(num_stages=2, chunks=2\)"):
        simulate(broken)


def test_forward_only_rejects_pre_checkpoint():
    stage = [LoadMicrobatch(0), PreCheckpointForward(0), RecomputeForward(0)]
    with pytest.raises(ScheduleError, match=r"stage 0: expected no PreCheckpointForward\(0\), found 1"):
        validate_stage_list(0, 1, 1, stage, training=False)
