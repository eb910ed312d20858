"""Timelines of pipeline instructions: conversion, Chrome traces, charts, measured costs, summaries."""

from __future__ import annotations

import json

import pytest

from merak.pipeline.instructions import (
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
)
from merak.pipeline.schedules import build_schedule
from merak.pipeline.simulate import Costs, simulate
from merak.pipeline.timeline import (
    KINDS,
    MeasuredCosts,
    TimedInstruction,
    draw_comparison,
    draw_timeline,
    events_from_simulation,
    kind_of,
    label_of,
    summarize,
    write_chrome_trace,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SCHEDULE_NAMES = ("1f1b", "pre_recompute_1f1b")


def stage_lists(name: str, num_stages: int = 4, num_microbatches: int = 8) -> list[list]:
    return [build_schedule(name=name, stage_id=s, num_stages=num_stages, num_microbatches=num_microbatches)
            for s in range(num_stages)]


def simulated(name: str, num_stages: int = 4, num_microbatches: int = 8, costs=None):
    costs = Costs(forward=1, backward=2) if costs is None else costs
    result = simulate(stage_lists(name, num_stages, num_microbatches), costs)
    return result, events_from_simulation(result)


@pytest.mark.parametrize(("instruction", "kind", "label"), [
    (Forward(3), "forward", "F3"),
    (Forward(3, chunk=1), "forward", "F3.1"),
    (PreCheckpointForward(3), "pre_checkpoint_forward", "PF3"),
    (RecomputeForward(3), "recompute", "R3"),
    (Backward(3), "backward", "B3"),
    (BackwardInput(3), "backward_input", "BI3"),
    (BackwardWeight(3), "backward_weight", "W3"),
    (LoadMicrobatch(3), "load", "load 3"),
    (SendActivation(2), "send", "send A2"),
    (SendGrad(2), "send", "send G2"),
    (RecvActivation(3), "recv", "recv A3"),
    (RecvGrad(3, chunk=1), "recv", "recv G3.1"),
    (Exchange((SendActivation(4), RecvGrad(1))), "exchange", "x A4 G1"),
    (ReduceTiedGrads(), "reduce_tied_grads", "reduce tied"),
    (ReduceGrads(), "reduce_grads", "reduce"),
    (OptimizerStep(), "optimizer_step", "step"),
])
def test_kind_and_label_of_every_instruction(instruction, kind, label):
    assert kind_of(instruction) == kind
    assert kind in KINDS
    assert label_of(instruction) == label


def test_kind_of_rejects_non_instructions():
    with pytest.raises(TypeError, match="not a pipeline instruction"):
        kind_of("F3")


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_events_from_simulation_preserve_count_order_and_times(name):
    result, events = simulated(name)
    assert len(events) == len(result.timeline)
    for event, original in zip(events, result.timeline):
        assert (event.stage, event.rank, event.start, event.end) == (original.stage, -1, original.start, original.end)
        assert event.kind == kind_of(original.instruction)
        assert event.label == label_of(original.instruction)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_chrome_trace_has_one_complete_event_per_instruction(tmp_path, name):
    _, events = simulated(name)
    path = tmp_path / "trace.json"
    write_chrome_trace(events, path, time_unit_s=0.01, metadata={"schedule": name})
    trace = json.loads(path.read_text())
    assert trace["displayTimeUnit"] == "ms"
    assert trace["otherData"] == {"schedule": name}
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(events)
    for record, event in zip(complete, events):
        assert record["name"] == event.label and record["cat"] == event.kind
        assert record["pid"] == event.stage and record["tid"] == 0
        assert record["ts"] == pytest.approx(event.start * 0.01 * 1e6)
        assert record["dur"] == pytest.approx((event.end - event.start) * 0.01 * 1e6)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {s: f"stage {s}" for s in range(4)}
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]  # no temporary file left


def test_chrome_trace_uses_rank_as_thread_and_empty_metadata(tmp_path):
    events = [TimedInstruction(stage=1, rank=5, kind="forward", label="F0", start=2.0, end=2.5)]
    path = tmp_path / "measured.json"
    write_chrome_trace(events, path)
    trace = json.loads(path.read_text())
    (record,) = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert (record["pid"], record["tid"], record["ts"], record["dur"]) == (1, 5, 2e6, 5e5)
    assert trace["otherData"] == {}


def png_height(path) -> int:
    image = pytest.importorskip("matplotlib.image")
    return image.imread(path).shape[0]


def test_draw_timeline_writes_png_taller_with_more_stages(tmp_path):
    pytest.importorskip("matplotlib")
    heights = []
    for num_stages in (2, 4):
        _, events = simulated("1f1b", num_stages=num_stages)
        path = tmp_path / f"s{num_stages}.png"
        draw_timeline(events, path, title=f"1f1b S={num_stages}", time_label="model units")
        assert path.read_bytes()[:8] == PNG_MAGIC
        heights.append(png_height(path))
    assert heights[1] > heights[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s2.png", "s4.png"]


def test_draw_comparison_stacks_panels(tmp_path):
    pytest.importorskip("matplotlib")
    _, predicted = simulated("1f1b")
    _, pre_recompute = simulated("pre_recompute_1f1b")
    single, double = tmp_path / "one.png", tmp_path / "two.png"
    draw_comparison([("predicted", predicted)], single, time_label="model units")
    draw_comparison([("predicted", predicted), ("measured", pre_recompute)], double, time_label="model units")
    assert double.read_bytes()[:8] == PNG_MAGIC
    assert png_height(double) > png_height(single)


def test_draw_comparison_needs_panels(tmp_path):
    with pytest.raises(ValueError, match="at least one"):
        draw_comparison([], tmp_path / "none.png")


# With checkpointing, pre_recompute_1f1b mixes backwards with and without recomputation on one
# stage, which one median per kind cannot reproduce; 1f1b's backwards all recompute alike.
@pytest.mark.parametrize(("name", "checkpoint_ratios"), [
    ("1f1b", ()), ("pre_recompute_1f1b", ()), ("1f1b", (0.5,) * 4),
])
def test_measured_costs_reproduce_the_makespan(name, checkpoint_ratios):
    costs = Costs(forward=1, backward=2, p2p=0.0, checkpoint_ratios=checkpoint_ratios)
    result, events = simulated(name, costs=costs)
    replay = simulate(stage_lists(name), MeasuredCosts.from_events(events))
    assert replay.makespan == pytest.approx(result.makespan)
    assert replay.bubble_fraction == pytest.approx(result.bubble_fraction)


def test_measured_costs_take_medians_per_stage_and_kind():
    events = [TimedInstruction(0, 0, "forward", "F0", 0.0, 1.0),
              TimedInstruction(0, 0, "forward", "F1", 1.0, 4.0),
              TimedInstruction(0, 0, "forward", "F2", 4.0, 6.0),
              TimedInstruction(1, 1, "forward", "F0", 0.0, 5.0),
              TimedInstruction(0, 0, "recv", "recv G0", 6.0, 6.5)]
    costs = MeasuredCosts.from_events(events)
    assert costs.of(0, Forward(7)) == 2.0
    assert costs.of(1, Forward(0)) == 5.0
    assert costs.of(0, RecvGrad(0)) == 0.0
    assert costs.backward_recompute(0) == 0.0
    priced = MeasuredCosts.from_events(events, include_other=True)
    assert priced.of(0, RecvGrad(3)) == 0.5
    assert priced.of(0, OptimizerStep()) == 0.0  # never measured


def test_measured_costs_missing_compute_kind_raises_key_error():
    costs = MeasuredCosts.from_events([TimedInstruction(0, -1, "forward", "F0", 0.0, 1.0)])
    with pytest.raises(KeyError, match="'backward' durations on stage 0.*measured there: forward"):
        costs.of(0, Backward(0))
    with pytest.raises(KeyError, match="on stage 1.*nothing"):
        costs.of(1, Forward(0))


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_summarize_bubble_matches_simulation(name):
    result, events = simulated(name)
    summary = summarize(events)
    json.dumps(summary)  # plain data
    assert summary["num_stages"] == 4
    assert summary["bubble_fraction"] == pytest.approx(result.bubble_fraction)
    for stage in summary["stages"]:
        assert stage["compute_busy"] == pytest.approx(result.busy[stage["stage"]])
        assert stage["busy"]["backward"] == pytest.approx(2 * 8)
        assert 0.0 <= stage["bubble_fraction"] < 1.0


def test_summarize_averages_data_parallel_replicas():
    events = [TimedInstruction(0, rank, "forward", "F0", 0.0, 1.0) for rank in (0, 2)]
    events += [TimedInstruction(1, rank, "backward", "B0", 1.0, 3.0) for rank in (1, 3)]
    summary = summarize(events)
    assert summary["span"] == 3.0
    assert [s["compute_busy"] for s in summary["stages"]] == [1.0, 2.0]
    assert summary["bubble_fraction"] == pytest.approx(0.5)
    assert summarize([])["stages"] == []
