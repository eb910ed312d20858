"""``wall_clock_breakdown``: the measured timeline of a step, and the simulator's prediction beside it.

Every rank records the start and end of each instruction of the last training step (the session
keeps that record across the evaluation steps that follow it);
rank 0 gathers one rank per stage (data- and tensor-parallel rank 0), writes
a Chrome trace (``timeline.json``), a picture (``timeline.png``), and a
picture of the same schedule simulated with the measured per-instruction
costs above the measured one (``timeline_vs_simulated.png``). Times come
from each process's monotonic clock, which all processes of one machine
share; across machines the rows are aligned only to within clock offsets.
"""

from __future__ import annotations

import logging
import os

from merak.distributed.groups import gather_from_all
from merak.pipeline.schedules import build_schedule
from merak.pipeline.simulate import simulate
from merak.pipeline.timeline import (
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

logger = logging.getLogger(__name__)


def measured_events(executor, *, stage: int, rank: int) -> list[TimedInstruction]:
    """The executor's recorded last training step as timeline events."""
    return [TimedInstruction(stage=stage, rank=rank, kind=kind_of(instr), label=label_of(instr), start=start, end=end)
            for instr, start, end in executor.timeline]


def write_timelines(engine, *, schedule: str, output_dir: str, rank: int) -> dict | None:
    """Gather the last step's timeline of one rank per stage; rank 0 writes the files.

    Returns:
        On rank 0, the timeline summary (busy time per kind and bubble per stage); None elsewhere.
    """
    state = engine.state
    coords = state.coordinates
    recorded = coords.dp == 0 and coords.tp == 0
    mine = measured_events(engine.executor, stage=engine.stage_id, rank=rank) if recorded else []
    reductions = engine.reduction_timeline() if recorded else []
    everyone = gather_from_all((mine, reductions))
    if rank != 0:
        return None
    events = sorted((e for part, _ in everyone for e in part), key=lambda e: (e.stage, e.start))
    if not events:
        logger.warning("wall_clock_breakdown: no instruction was recorded")
        return None
    origin = min(e.start for e in events)
    events = [TimedInstruction(e.stage, e.rank, e.kind, e.label, e.start - origin, e.end - origin) for e in events]
    overlapped = [{**r, "start": r["start"] - origin, "end": r["end"] - origin} for _, part in everyone for r in part]
    write_chrome_trace(events, os.path.join(output_dir, "timeline.json"),
                       metadata={"schedule": schedule, "num_stages": engine.num_stages},
                       extra_events=[_reduction_trace_event(r) for r in overlapped])
    lists = [build_schedule(name=schedule, stage_id=s, num_stages=engine.num_stages,
                            num_microbatches=engine.num_microbatches, num_chunks=engine.num_chunks)
             for s in range(engine.num_stages)]
    predicted = events_from_simulation(simulate(lists, MeasuredCosts.from_events(events)))
    try:
        draw_timeline(events, os.path.join(output_dir, "timeline.png"), title=f"{schedule}: measured last step")
        draw_comparison([("simulated with the measured instruction costs", predicted), ("measured", events)],
                        os.path.join(output_dir, "timeline_vs_simulated.png"))
    except ImportError as error:
        logger.warning("wall_clock_breakdown: no timeline pictures (%s); timeline.json was written", error)
    summary = summarize(events)
    if overlapped:
        summary["dp_reductions"] = reductions_beside_backward(events, overlapped)
    logger.info("timeline of the last step: bubble %.1f%% of %.3f s; wrote timeline.json and pictures to %s",
                100 * summary["bubble_fraction"], summary["span"], output_dir)
    return summary


def _reduction_trace_event(reduction: dict) -> dict:
    """A data-parallel bucket reduction as a Chrome trace event, on its own row (thread) of its stage."""
    return {"name": f"dp reduce bucket {reduction['bucket']}", "cat": "dp_reduction", "ph": "X",
            "pid": reduction["stage"], "tid": f"rank {reduction['rank']} dp reductions",
            "ts": reduction["start"] * 1e6, "dur": max(0.0, reduction["end"] - reduction["start"]) * 1e6,
            "args": {"bytes": reduction["bytes"], "chunk": reduction["chunk"]}}


_BACKWARD_KINDS = ("backward", "backward_input", "backward_weight")


def reductions_beside_backward(events: list[TimedInstruction], reductions: list[dict]) -> list[dict]:
    """Per stage: its bucket reductions (start and end: launched during the backward, waited for at the
    step's end) and when its last backward pass ended, so that the overlap can be read off."""
    stages = []
    for stage in sorted({r["stage"] for r in reductions}):
        backward_ends = [e.end for e in events if e.stage == stage and e.kind in _BACKWARD_KINDS]
        last_end = max(backward_ends, default=None)
        mine = sorted((r for r in reductions if r["stage"] == stage), key=lambda r: r["start"])
        stages.append({"stage": stage, "last_backward_end": last_end, "buckets": mine,
                       "started_before_last_backward_end": sum(last_end is not None and r["start"] < last_end
                                                               for r in mine)})
    return stages
