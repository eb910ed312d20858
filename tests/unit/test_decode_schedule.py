"""The decode schedule: its lists pass the simulator (pairing, deadlock) and the list check."""

from __future__ import annotations

import pytest

from merak.pipeline.decode_schedule import decode_schedule, decode_step, validate_decode_list
from merak.pipeline.instructions import (
    DecodeForward,
    Forward,
    PickToken,
    RecvActivation,
    RecvToken,
    SendActivation,
    SendToken,
    matching_op,
    p2p_ops,
)
from merak.pipeline.simulate import Costs, ScheduleError, render_text_timeline, simulate


def lists(num_stages: int, num_steps: int) -> list[list]:
    return [decode_schedule(s, num_stages, num_steps) for s in range(num_stages)]


@pytest.mark.parametrize("num_stages", [1, 2, 4])
@pytest.mark.parametrize("num_steps", [1, 2, 7])
@pytest.mark.parametrize("sends", ["eager", "rendezvous"])
def test_decode_schedules_simulate(num_stages, num_steps, sends):
    forward, p2p = 1.0, 0.25
    result = simulate(lists(num_stages, num_steps), Costs(forward=forward, p2p=p2p), sends=sends)
    # One stage works at a time: per step S forwards and S-1 activation hops, then the token's hop back
    # to the first stage (none after the final step, none with one stage).
    hops = num_steps * (num_stages - 1) + (num_steps - 1 if num_stages > 1 else 0)
    assert result.makespan == pytest.approx(num_steps * num_stages * forward + hops * p2p)
    assert result.busy == tuple([num_steps * forward] * num_stages)
    assert result.bubble_fraction == pytest.approx(1 - num_steps * num_stages * forward / (num_stages * (
        num_steps * num_stages * forward + hops * p2p)))


def test_the_token_goes_from_the_last_stage_to_the_first():
    stages = lists(4, 3)
    assert stages[0] == [DecodeForward(0), SendActivation(0), RecvToken(0), DecodeForward(1), SendActivation(1),
                         RecvToken(1), DecodeForward(2), SendActivation(2)]
    assert stages[1] == [RecvActivation(0), DecodeForward(0), SendActivation(0), RecvActivation(1), DecodeForward(1),
                         SendActivation(1), RecvActivation(2), DecodeForward(2), SendActivation(2)]
    assert stages[3] == [RecvActivation(0), DecodeForward(0), PickToken(0), SendToken(0), RecvActivation(1),
                         DecodeForward(1), PickToken(1), SendToken(1), RecvActivation(2), DecodeForward(2),
                         PickToken(2)]
    assert matching_op(SendToken(1), 3, 4) == RecvToken(1) and matching_op(RecvToken(1), 0, 4) == SendToken(1)
    assert lists(1, 3) == [[DecodeForward(0), PickToken(0), DecodeForward(1), PickToken(1), DecodeForward(2),
                            PickToken(2)]]
    timeline = render_text_timeline(simulate(stages), 4)
    assert timeline.splitlines()[0].startswith("s0 |D0 .. .. .. D1")


@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_steps_make_the_schedule_and_an_early_end_is_a_shorter_schedule(num_stages):
    num_steps = 6
    for s in range(num_stages):
        steps = [decode_step(s, num_stages, t, num_steps) for t in range(num_steps)]
        assert [i for step in steps for i in step] == decode_schedule(s, num_stages, num_steps)
    # A sequence whose token t ends it runs steps 0..t+1 (step t+1 carries the stop marker, its token
    # is never sent): the transfers are those of the schedule of t + 2 steps.
    for stop in range(num_steps - 2):
        for s in range(num_stages):
            run = [i for t in range(stop + 2) for i in decode_step(s, num_stages, t, num_steps)]
            transfers = [op for i in run for op in p2p_ops(i) if op != SendToken(stop + 1)]
            shorter = [op for i in decode_schedule(s, num_stages, stop + 2) for op in p2p_ops(i)]
            assert transfers == shorter


@pytest.mark.parametrize("stage_id, broken, message", [
    (0, [SendActivation(0), DecodeForward(0), RecvToken(0), DecodeForward(1), SendActivation(1)],
     "SendActivation(0) must follow DecodeForward(0)"),
    (0, [DecodeForward(0), SendActivation(0), DecodeForward(1), RecvToken(0), SendActivation(1)],
     "RecvToken(0) must come before DecodeForward(1)"),
    (0, [DecodeForward(0), SendActivation(0), DecodeForward(1), SendActivation(1)],
     "expected exactly one RecvToken(0)"),
    (1, [RecvActivation(0), DecodeForward(0), PickToken(0), RecvActivation(1), DecodeForward(1), PickToken(1)],
     "expected exactly one SendToken(0)"),
    (1, [RecvActivation(0), DecodeForward(0), PickToken(0), SendToken(0), RecvActivation(1), DecodeForward(1),
         PickToken(1), SendToken(1)], "expected no SendToken(1)"),
    (1, [RecvActivation(0), DecodeForward(0), SendToken(0), PickToken(0), RecvActivation(1), DecodeForward(1),
         PickToken(1)], "SendToken(0) must follow PickToken(0)"),
    (1, [RecvActivation(0), DecodeForward(0), PickToken(0), SendToken(0), Forward(1)], "has no place"),
    (1, [RecvActivation(0), DecodeForward(0, chunk=1)], "one chunk per stage"),
    (1, [RecvActivation(1), DecodeForward(1), PickToken(1), RecvActivation(0), DecodeForward(0), PickToken(0),
         SendToken(0)], "DecodeForward(0) must come before DecodeForward(1)"),
])
def test_malformed_decoding_lists_are_rejected(stage_id, broken, message):
    with pytest.raises(ScheduleError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_decode_list(stage_id, 2, 2, broken)
    stages = lists(2, 2)
    stages[stage_id] = broken
    with pytest.raises(ScheduleError):
        simulate(stages)


def test_steps_out_of_range_are_refused():
    with pytest.raises(ValueError, match="step must be in"):
        decode_step(0, 2, 3, 3)
    with pytest.raises(ScheduleError, match="step outside"):
        validate_decode_list(0, 1, 1, [DecodeForward(0), PickToken(0), DecodeForward(1)])
