"""Pipeline schedules and the schedule simulator (pure Python, no torch)."""

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
    p2p_ops,
)
from merak.pipeline.schedules import (
    SCHEDULES,
    build_forward_only_schedule,
    build_schedule,
    schedule_names,
)
from merak.pipeline.simulate import (
    Costs,
    ScheduleError,
    render_text_timeline,
    simulate,
    validate_stage_list,
)

TAIL = [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]


def all_stages(name: str, num_stages: int, num_microbatches: int) -> list[list]:
    return [
        build_schedule(name=name, stage_id=s, num_stages=num_stages, num_microbatches=num_microbatches)
        for s in range(num_stages)
    ]


def compute_order(instructions) -> str:
    return " ".join(
        f"{'F' if isinstance(i, Forward) else 'B'}{i.microbatch}"
        for i in instructions
        if isinstance(i, (Forward, Backward))
    )


def test_registry_names():
    assert schedule_names() == list(SCHEDULES)
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
        (stage,) = all_stages(name, 1, 3)
        assert [type(i) for i in stage[:2]] == [LoadMicrobatch, Forward]
        assert sum(isinstance(i, LoadMicrobatch) for i in stage) == 3
        assert not any(p2p_ops(i) for i in stage)


def test_1f1b_exact_compute_order():
    stages = all_stages("1f1b", 4, 8)
    assert compute_order(stages[0]) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    assert compute_order(stages[1]) == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7"
    assert compute_order(stages[3]) == " ".join(f"F{m} B{m}" for m in range(8))


def test_gpipe_order_and_no_exchange():
    for stage in all_stages("gpipe", 3, 4):
        assert compute_order(stage) == "F0 F1 F2 F3 B0 B1 B2 B3"
        assert not any(isinstance(i, Exchange) for i in stage)


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
            ds = all_stages("ds_default", num_stages, num_microbatches)
            ref = all_stages("1f1b", num_stages, num_microbatches)
            for s in range(num_stages):
                assert not any(isinstance(i, Exchange) for i in ds[s])
                assert compute_order(ds[s]) == compute_order(ref[s])


def test_ds_default_orders_by_parity():
    stages = all_stages("ds_default", 4, 8)
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
    with pytest.raises(ScheduleError, match=r"deadlock.*stage 0.*RecvGrad\(microbatch=0\).*stage 1.*RecvActivation"):
        simulate([stage0, stage1])


def test_fifo_mismatch_is_reported():
    stage0 = [LoadMicrobatch(0), Forward(0), LoadMicrobatch(1), Forward(1), SendActivation(1), SendActivation(0)]
    stage1 = [RecvActivation(0), LoadMicrobatch(0), Forward(0), RecvActivation(1), LoadMicrobatch(1), Forward(1)]
    pattern = r"mismatch.*stage 0 -> stage 1.*SendActivation\(microbatch=1\).*RecvActivation\(microbatch=0\)"
    with pytest.raises(ScheduleError, match=pattern):
        simulate([stage0, stage1])


def test_exchange_ops_match_individually():
    # An Exchange on stage 0 is served by two separate blocking ops on stage 1.
    stage0 = [LoadMicrobatch(0), Forward(0), Exchange((SendActivation(0), RecvGrad(0))), Backward(0), *TAIL]
    stage1 = [RecvActivation(0), LoadMicrobatch(0), Forward(0), Backward(0), SendGrad(0), *TAIL]
    result = simulate([stage0, stage1])
    assert result.makespan == 4.0


def test_missing_backward_is_reported():
    stages = all_stages("1f1b", 2, 4)
    stages[1] = [i for i in stages[1] if i != Backward(2)]
    with pytest.raises(ScheduleError, match=r"stage 1: expected exactly one Backward\(microbatch=2\), found 0"):
        simulate(stages)


def test_send_to_missing_stage_is_reported():
    stages = [build_forward_only_schedule(stage_id=s, num_stages=2, num_microbatches=2) for s in range(2)]
    stages[1].append(SendActivation(1))
    with pytest.raises(ScheduleError, match=r"stage 1.*SendActivation\(microbatch=1\).*non-existent stage 2"):
        simulate(stages)
    with pytest.raises(ScheduleError, match=r"RecvActivation\(microbatch=0\).*non-existent stage -1"):
        simulate([[RecvActivation(0), LoadMicrobatch(0), Forward(0)]])


def test_validate_stage_list_structure():
    good = build_schedule(name="1f1b", stage_id=1, num_stages=3, num_microbatches=4)
    validate_stage_list(1, 3, 4, good)
    with pytest.raises(ScheduleError, match=r"OptimizerStep"):
        validate_stage_list(1, 3, 4, good[:-1])
    swapped = list(good)
    i, j = swapped.index(RecvActivation(0)), swapped.index(Forward(0))
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(ScheduleError, match=r"RecvActivation\(microbatch=0\).*before Forward\(microbatch=0\)"):
        validate_stage_list(1, 3, 4, swapped)
    with pytest.raises(ScheduleError, match=r"LoadMicrobatch\(microbatch=0\)"):
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
