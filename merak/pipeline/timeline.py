"""Timelines of pipeline instructions: simulated or measured, exported and drawn.

A :class:`TimedInstruction` is one instruction of one stage placed in time. The
same records come from :func:`merak.pipeline.simulate.simulate` (model time
units, see :func:`events_from_simulation`) and from timing a real run
(seconds), so both can be

- written as a Chrome trace-event file (:func:`write_chrome_trace`), which
  ``chrome://tracing`` and Perfetto open;
- drawn as a PNG Gantt chart, one row per stage (:func:`draw_timeline`), or
  several charts stacked for comparison, e.g. predicted above measured
  (:func:`draw_comparison`);
- summarised as busy time per kind and bubble fraction (:func:`summarize`);
- turned back into a cost model for the simulator (:class:`MeasuredCosts`),
  so a measured run predicts how other schedules would fare on the same model.

Drawing needs matplotlib (the ``dev`` extra); nothing else here does.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

from merak.pipeline.instructions import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Exchange,
    Forward,
    Instruction,
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
from merak.pipeline.simulate import SimulationResult, instruction_label

__all__ = [
    "COMPUTE_KINDS", "KINDS", "MeasuredCosts", "TimedInstruction", "draw_comparison", "draw_timeline",
    "events_from_simulation", "kind_of", "label_of", "summarize", "write_chrome_trace",
]

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]

KINDS = (
    "forward", "pre_checkpoint_forward", "recompute", "backward", "backward_input", "backward_weight",
    "load", "send", "recv", "exchange", "reduce_tied_grads", "reduce_grads", "optimizer_step",
)
COMPUTE_KINDS = KINDS[:6]
# Communication that a stage waits on; sends are posted and complete in the background.
WAIT_KINDS = ("recv", "exchange")

_KIND_OF_TYPE: dict[type, str] = {
    Forward: "forward", PreCheckpointForward: "pre_checkpoint_forward", RecomputeForward: "recompute",
    Backward: "backward", BackwardInput: "backward_input", BackwardWeight: "backward_weight",
    LoadMicrobatch: "load", SendActivation: "send", SendGrad: "send", RecvActivation: "recv",
    RecvGrad: "recv", Exchange: "exchange", ReduceTiedGrads: "reduce_tied_grads",
    ReduceGrads: "reduce_grads", OptimizerStep: "optimizer_step",
}

# Okabe-Ito colours: distinguishable with the common forms of colour blindness.
KIND_COLORS = {
    "forward": "#0072B2", "pre_checkpoint_forward": "#56B4E9", "recompute": "#E69F00",
    "backward": "#009E73", "backward_input": "#D55E00", "backward_weight": "#CC79A7",
}
# Label colour per bar colour, picked for contrast.
_TEXT_COLORS = {
    "forward": "white", "pre_checkpoint_forward": "black", "recompute": "black",
    "backward": "white", "backward_input": "white", "backward_weight": "black",
}
_WAIT_COLOR = "#999999"
_DPI = 100
_LABEL_FONT_SIZE = 7


@dataclass(frozen=True)
class TimedInstruction:
    """One instruction of one stage, placed in time.

    Attributes:
        stage: Pipeline stage (the row of a chart).
        rank: Global rank that ran it; -1 for simulated events.
        kind: One of :data:`KINDS`.
        label: Short text such as ``F3``, ``B2.1`` or ``recv A3`` (:func:`label_of`).
        start: Start time: seconds for measured runs, model units for simulated ones.
        end: End time, in the unit of ``start``.
    """

    stage: int
    rank: int
    kind: str
    label: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        """``end - start``."""
        return self.end - self.start


def kind_of(instruction: Instruction) -> str:
    """Return the kind (one of :data:`KINDS`) of a pipeline instruction.

    Args:
        instruction: Any instruction from :mod:`merak.pipeline.instructions`.

    Returns:
        E.g. ``"forward"`` for Forward, ``"recv"`` for RecvActivation and RecvGrad.

    Raises:
        TypeError: If ``instruction`` is not a pipeline instruction.
    """
    try:
        return _KIND_OF_TYPE[type(instruction)]
    except KeyError:
        raise TypeError(f"not a pipeline instruction: {instruction!r}") from None


def _p2p_text(op) -> str:
    """``A3`` for an activation, ``G3`` for a gradient (chunk as a suffix: ``A3.1``)."""
    letter = "A" if isinstance(op, (SendActivation, RecvActivation)) else "G"
    chunk = f".{op.chunk}" if op.chunk else ""
    return f"{letter}{op.microbatch}{chunk}"


def label_of(instruction: Instruction) -> str:
    """Return a short label of an instruction for charts and traces.

    Compute instructions use :func:`~merak.pipeline.simulate.instruction_label`
    (``F3``, ``PF3``, ``R3``, ``B3``, ``BI3``, ``W3``, chunk as a suffix:
    ``F3.1``); the others read ``recv A3``, ``send G2``, ``x A4 G1`` (an
    Exchange, its ops in order), ``load 3``, ``reduce tied``, ``reduce`` and
    ``step``.

    Args:
        instruction: Any instruction from :mod:`merak.pipeline.instructions`.

    Returns:
        The label.

    Raises:
        TypeError: If ``instruction`` is not a pipeline instruction.
    """
    kind = kind_of(instruction)
    if kind in COMPUTE_KINDS:
        return instruction_label(instruction)
    if kind in ("send", "recv"):
        return f"{kind} {_p2p_text(instruction)}"
    if kind == "exchange":
        return " ".join(["x"] + [_p2p_text(op) for op in instruction.ops])
    if kind == "load":
        chunk = f".{instruction.chunk}" if instruction.chunk else ""
        return f"load {instruction.microbatch}{chunk}"
    return {"reduce_tied_grads": "reduce tied", "reduce_grads": "reduce", "optimizer_step": "step"}[kind]


def events_from_simulation(result: SimulationResult) -> list[TimedInstruction]:
    """Convert a simulation's timeline to timed instructions (rank -1, model time units).

    Args:
        result: What :func:`merak.pipeline.simulate.simulate` returned.

    Returns:
        One event per simulated instruction, in the order of ``result.timeline``.
    """
    return [TimedInstruction(stage=e.stage, rank=-1, kind=kind_of(e.instruction), label=label_of(e.instruction),
                             start=e.start, end=e.end)
            for e in result.timeline]


def _write_atomic(path: PathLike, write: Callable[[IO[bytes]], None]) -> None:
    """Write a file so readers see the old one or the new one, never half of one."""
    path = os.fspath(path)
    # Same directory as the target, so os.replace stays a rename on one file system.
    temporary = f"{path}.tmp.{os.getpid()}"
    try:
        with open(temporary, "wb") as handle:
            write(handle)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def _chrome_events(events: Sequence[TimedInstruction], time_unit_s: float) -> list[dict[str, Any]]:
    """The trace-event list: process names and sort order per stage, then one X event per instruction."""
    scale = time_unit_s * 1e6
    stages = sorted({e.stage for e in events})
    trace: list[dict[str, Any]] = []
    for stage in stages:
        trace.append({"name": "process_name", "ph": "M", "pid": stage, "tid": 0, "args": {"name": f"stage {stage}"}})
        # Without a sort index viewers may order stages by first appearance.
        trace.append({"name": "process_sort_index", "ph": "M", "pid": stage, "tid": 0,
                      "args": {"sort_index": stage}})
    for e in events:
        trace.append({"name": e.label, "cat": e.kind, "ph": "X", "pid": e.stage, "tid": max(e.rank, 0),
                      "ts": e.start * scale, "dur": e.duration * scale, "args": {"rank": e.rank}})
    return trace


def write_chrome_trace(events: Sequence[TimedInstruction], path: PathLike, *, time_unit_s: float = 1.0,
                       metadata: dict | None = None, extra_events: Sequence[dict] = ()) -> None:
    """Write events as a Chrome trace-event JSON file (chrome://tracing, Perfetto).

    Each stage is a process (``pid`` = stage, named ``stage N``) and each rank a
    thread in it (``tid`` = rank, 0 for simulated events); each instruction is
    one complete event (``"ph": "X"``) named by its label, with its kind as the
    category. The file is written atomically.

    Args:
        events: The instructions to write.
        path: Output file.
        time_unit_s: Seconds per unit of the events' times: 1.0 for measured
            events; for simulated ones, what one model unit should read as.
        metadata: Stored as ``otherData`` (e.g. schedule, stages, microbatches).
        extra_events: Chrome trace events written as they are (e.g. data-parallel reductions, which
            run beside the instructions).
    """
    payload = {"traceEvents": [*_chrome_events(events, time_unit_s), *extra_events], "displayTimeUnit": "ms",
               "otherData": dict(metadata or {})}
    _write_atomic(path, lambda handle: handle.write(json.dumps(payload).encode("utf-8")))
    logger.debug("wrote %d trace events to %s", len(events), path)


def _matplotlib():
    """Import matplotlib's object API lazily: only drawing needs it, and it is an optional dependency."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as error:
        raise ImportError("drawing timelines needs matplotlib; install merak[dev] or `pip install matplotlib`") \
            from error
    return Figure, FigureCanvasAgg, Patch


def _num_rows(events: Sequence[TimedInstruction]) -> int:
    """Rows a chart needs: up to the highest stage seen (at least one)."""
    return max((e.stage for e in events), default=0) + 1


def _figure_width(panels: Sequence[Sequence[TimedInstruction]]) -> float:
    """Inches: wide enough to label the busiest row, clamped to 8..40."""
    per_row: dict[tuple[int, int], int] = defaultdict(int)
    for index, events in enumerate(panels):
        for e in events:
            if e.kind in COMPUTE_KINDS:
                per_row[(index, e.stage)] += 1
    return min(40.0, max(8.0, 2.0 + 0.45 * max(per_row.values(), default=0)))


def _panel_height(events: Sequence[TimedInstruction]) -> float:
    """Inches for one panel: a fixed strip per stage plus title and axis."""
    return 1.1 + 0.45 * _num_rows(events)


def _fits(duration: float, label: str, inches_per_unit: float) -> bool:
    """Whether ``label`` fits inside a bar of ``duration`` (estimated from the font size, no rendering)."""
    text_inches = len(label) * _LABEL_FONT_SIZE * 0.6 / 72 + 0.05
    return duration * inches_per_unit >= text_inches


def _draw_panel(ax, events: Sequence[TimedInstruction], *, title: str, time_label: str,
                axes_inches: float) -> set[str]:
    """Draw one timeline into ``ax``; return the kinds drawn (``"communication"`` for waits)."""
    rows = _num_rows(events)
    # Measured times are absolute clock readings; the chart starts at the earliest event.
    origin = min((e.start for e in events), default=0.0)
    extent = max((e.end for e in events), default=1.0) - origin
    extent = extent if extent > 0 else 1.0
    inches_per_unit = axes_inches / extent
    drawn: set[str] = set()
    for e in events:
        if e.duration <= 0:
            continue
        if e.kind in WAIT_KINDS:
            ax.barh(e.stage, e.duration, left=e.start - origin, height=0.2, color=_WAIT_COLOR, linewidth=0)
            drawn.add("communication")
        elif e.kind in COMPUTE_KINDS:
            ax.barh(e.stage, e.duration, left=e.start - origin, height=0.7, color=KIND_COLORS[e.kind],
                    edgecolor="white", linewidth=0.4)
            drawn.add(e.kind)
            if _fits(e.duration, e.label, inches_per_unit):
                ax.text(e.start - origin + e.duration / 2, e.stage, e.label, ha="center", va="center",
                        fontsize=_LABEL_FONT_SIZE, color=_TEXT_COLORS[e.kind])
    ax.set_xlim(0.0, extent)
    ax.set_ylim(rows - 0.5, -0.5)  # stage 0 on top
    ax.set_yticks(range(rows), [f"stage {s}" for s in range(rows)])
    ax.set_xlabel(time_label)
    if title:
        ax.set_title(title)
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    ax.set_axisbelow(True)
    return drawn


def _legend_handles(drawn: set[str], patch_type) -> list:
    """Legend entries for the kinds drawn, in :data:`KINDS` order, communication last."""
    handles = [patch_type(color=KIND_COLORS[kind], label=kind) for kind in COMPUTE_KINDS if kind in drawn]
    if "communication" in drawn:
        handles.append(patch_type(color=_WAIT_COLOR, label="recv / exchange"))
    return handles


def _render(panels: Sequence[tuple[str, Sequence[TimedInstruction]]], path: PathLike, time_label: str) -> None:
    """Draw panels stacked vertically, with one shared legend, and write the PNG atomically."""
    figure_type, canvas_type, patch_type = _matplotlib()
    width = _figure_width([events for _, events in panels])
    heights = [_panel_height(events) for _, events in panels]
    figure = figure_type(figsize=(width, sum(heights) + 0.6), dpi=_DPI, layout="constrained")
    canvas_type(figure)
    axes = figure.subplots(len(panels), 1, squeeze=False, height_ratios=heights)[:, 0]
    # Labels sit at a fixed font size, so whether one fits depends on the axes' width in inches;
    # the stage names on the left take about an inch.
    axes_inches = max(width - 1.2, 1.0)
    drawn: set[str] = set()
    for ax, (title, events) in zip(axes, panels):
        drawn |= _draw_panel(ax, events, title=title, time_label=time_label, axes_inches=axes_inches)
    handles = _legend_handles(drawn, patch_type)
    if handles:
        figure.legend(handles=handles, loc="outside upper center", ncols=len(handles), frameon=False)
    _write_atomic(path, lambda handle: figure.savefig(handle, format="png", dpi=_DPI))
    logger.debug("wrote timeline chart (%d panels) to %s", len(panels), path)


def draw_timeline(events: Sequence[TimedInstruction], path: PathLike, *, title: str = "",
                  time_label: str = "seconds") -> None:
    """Draw a PNG Gantt chart of one timeline, one row per stage (stage 0 on top).

    Compute instructions are bars coloured by kind and labelled when wide
    enough; receives and exchanges (time a stage waits on its neighbours) are
    thin grey bars; sends, loads and step-end bookkeeping are not drawn. Events
    of several ranks of one stage (data-parallel replicas) share its row: pass
    one rank per stage for a clean chart. Time starts at the earliest event.
    The file is written atomically.

    Args:
        events: The instructions to draw.
        path: Output PNG file.
        title: Chart title.
        time_label: Name of the time axis (e.g. ``"seconds"``, ``"model units"``).

    Raises:
        ImportError: If matplotlib is not installed.
    """
    _render([(title, events)], path, time_label)


def draw_comparison(panels: Sequence[tuple[str, Sequence[TimedInstruction]]], path: PathLike, *,
                    time_label: str = "seconds") -> None:
    """Draw several timelines stacked vertically in one PNG, sharing one colour legend.

    Each panel is drawn as by :func:`draw_timeline`, under its own title and on
    its own time axis (e.g. ``[("predicted", simulated), ("measured", measured)]``).

    Args:
        panels: ``(title, events)`` pairs, drawn top to bottom.
        path: Output PNG file.
        time_label: Name of every panel's time axis.

    Raises:
        ValueError: If ``panels`` is empty.
        ImportError: If matplotlib is not installed.
    """
    if not panels:
        raise ValueError("draw_comparison needs at least one (title, events) panel")
    _render(list(panels), path, time_label)


class MeasuredCosts:
    """A cost model for :func:`merak.pipeline.simulate.simulate` built from measured events.

    An instruction costs the median duration of its kind on its stage. Compute
    kinds must have been measured on the stage. Point-to-point and bookkeeping
    kinds cost 0.0 unless ``include_other=True``: a measured receive includes
    the time spent waiting for its partner, which the simulator derives itself,
    so pricing it would count the wait twice.

    A measured Backward after a checkpointed Forward already includes its
    recomputation, so :meth:`backward_recompute` is always 0.0. Hence the
    costs predict other schedules well only when they use the same forward and
    backward kinds with the same checkpointing as the measured run. A stage
    whose backwards differ in recomputation (with checkpointing on, the
    backwards of pre_recompute_1f1b after a plain Forward recompute and those
    after a RecomputeForward do not) gets the median of the mixed durations.

    Attributes:
        include_other: Whether non-compute kinds are priced from measurements.
    """

    def __init__(self, samples: Mapping[tuple[int, str], Sequence[float]], *, include_other: bool = False):
        """Build the model from durations per ``(stage, kind)``.

        Args:
            samples: Measured durations of each kind on each stage.
            include_other: Price non-compute kinds too (median; 0.0 if never seen).
        """
        self.include_other = include_other
        self._medians = {key: statistics.median(values) for key, values in samples.items() if values}

    @classmethod
    def from_events(cls, events: Iterable[TimedInstruction], *, include_other: bool = False) -> MeasuredCosts:
        """Collect the durations of measured (or simulated) events per stage and kind.

        Args:
            events: Timed instructions of one or more steps, any ranks.
            include_other: Price non-compute kinds too (median; 0.0 if never seen).

        Returns:
            The cost model.
        """
        samples: dict[tuple[int, str], list[float]] = defaultdict(list)
        for e in events:
            samples[(e.stage, e.kind)].append(e.duration)
        return cls(samples, include_other=include_other)

    @property
    def medians(self) -> dict[tuple[int, str], float]:
        """Median duration per ``(stage, kind)`` measured."""
        return dict(self._medians)

    def of(self, stage_id: int, instruction: Instruction) -> float:
        """Return the duration of ``instruction`` on stage ``stage_id``.

        Args:
            stage_id: The stage running the instruction.
            instruction: The instruction to price.

        Returns:
            The median measured duration of its kind there; 0.0 for non-compute
            kinds unless ``include_other`` (then 0.0 only if never measured).

        Raises:
            KeyError: If a compute kind was never measured on the stage.
        """
        kind = kind_of(instruction)
        if kind not in COMPUTE_KINDS:
            return self._medians.get((stage_id, kind), 0.0) if self.include_other else 0.0
        try:
            return self._medians[(stage_id, kind)]
        except KeyError:
            seen = sorted(k for s, k in self._medians if s == stage_id and k in COMPUTE_KINDS)
            raise KeyError(f"no measured {kind!r} durations on stage {stage_id} to price {instruction!r} "
                           f"(measured there: {', '.join(seen) or 'nothing'}); measure a schedule that runs "
                           f"this kind on this stage") from None

    def backward_recompute(self, stage_id: int) -> float:
        """Return 0.0: a measured backward already includes its recomputation."""
        del stage_id
        return 0.0


def _compute_span(events: Sequence[TimedInstruction]) -> float:
    """From the first compute start to the last compute end (0.0 without compute)."""
    compute = [e for e in events if e.kind in COMPUTE_KINDS]
    if not compute:
        return 0.0
    return max(e.end for e in compute) - min(e.start for e in compute)


def _stage_summary(stage: int, events: Sequence[TimedInstruction], global_span: float) -> dict[str, Any]:
    """Busy time per kind (averaged over the stage's ranks), own compute span and bubble of one stage."""
    # Data-parallel replicas run the same stage side by side; average them so busy <= span.
    replicas = len({e.rank for e in events}) or 1
    busy: dict[str, float] = defaultdict(float)
    for e in events:
        busy[e.kind] += e.duration / replicas
    compute_busy = sum(t for kind, t in busy.items() if kind in COMPUTE_KINDS)
    bubble = 1.0 - compute_busy / global_span if global_span > 0 else 0.0
    return {"stage": stage, "ranks": sorted({e.rank for e in events}),
            "busy": {kind: busy[kind] for kind in KINDS if kind in busy}, "compute_busy": compute_busy,
            "span": _compute_span(events), "bubble_fraction": bubble}


def summarize(events: Sequence[TimedInstruction]) -> dict[str, Any]:
    """Summarise a timeline as plain data (JSON-ready).

    Bubble is measured against the compute span of all stages together (first
    compute start to last compute end), as
    :attr:`~merak.pipeline.simulate.SimulationResult.bubble_fraction` is, so for
    simulated events the two agree. Stages without events are left out.

    Args:
        events: Timed instructions of one step.

    Returns:
        ``{"num_stages", "span", "bubble_fraction", "stages"}`` where ``stages``
        lists per stage ``{"stage", "ranks", "busy"`` (time per kind),
        ``"compute_busy", "span"`` (the stage's own compute span) and
        ``"bubble_fraction"`` (``1 - compute_busy / span of all stages``)``}``.
    """
    by_stage: dict[int, list[TimedInstruction]] = defaultdict(list)
    for e in events:
        by_stage[e.stage].append(e)
    span = _compute_span(events)
    stages = [_stage_summary(stage, by_stage[stage], span) for stage in sorted(by_stage)]
    bubble = statistics.fmean(s["bubble_fraction"] for s in stages) if stages and span > 0 else 0.0
    return {"num_stages": len(stages), "span": span, "bubble_fraction": bubble, "stages": stages}
