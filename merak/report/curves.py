"""Loss curves: each run's ``loss.png`` and a sweep's comparison of its jobs.

A run's picture shows, from its ``metrics.jsonl``, the training loss of every logged step, the
held-out evaluation loss where the run evaluated, and the learning rate on a second axis. A sweep's
picture shows the training loss of every job (and its evaluation loss, dashed, in the same colour).

Every picture also holds what it shows as PNG text under :data:`METADATA_KEY`: per line its label,
number of points and steps (as ``[first, last, stride]`` ranges, a few numbers even for long runs),
so tools and tests can check a picture's content without reading pixels (:func:`drawn_steps`).

Drawing needs matplotlib (an optional dependency, the ``dev`` extra): without it, the writers log
a warning and write no picture; nothing else of a run depends on it.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import IO

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
PICTURE = "loss.png"
METADATA_KEY = "merak.curves"
_DPI = 110
_MARK_BELOW = 60  # lines of fewer points get a marker on each one, so a short run's points are visible


@dataclass
class Series:
    """One drawn line: its label and its (step, value) points."""

    label: str
    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    def add(self, step, value) -> None:
        """Append a point; missing and non-finite values (a skipped step's loss) are left out."""
        if isinstance(step, int) and isinstance(value, (int, float)) and math.isfinite(value):
            self.steps.append(step)
            self.values.append(float(value))


@dataclass
class RunCurves:
    """What a run's ``metrics.jsonl`` holds to draw."""

    train_loss: Series = field(default_factory=lambda: Series("train loss"))
    eval_loss: Series = field(default_factory=lambda: Series("eval loss"))
    learning_rate: Series = field(default_factory=lambda: Series("learning rate"))


def read_run_curves(metrics_path: str | os.PathLike) -> RunCurves:
    """The series of a ``metrics.jsonl``: training lines carry ``loss`` and ``learning_rate``,
    evaluation lines ``eval_loss``. A line cut short (a crashed run) ends the reading."""
    curves = RunCurves()
    with open(metrics_path, encoding="utf-8") as handle:
        for line in handle:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                break
            if not isinstance(entry, dict):
                continue
            step = entry.get("step")
            if "loss" in entry:
                curves.train_loss.add(step, entry["loss"])
                curves.learning_rate.add(step, entry.get("learning_rate"))
            if "eval_loss" in entry:
                curves.eval_loss.add(step, entry["eval_loss"])
    return curves


def step_ranges(steps: Iterable[int]) -> list[list[int]]:
    """``steps`` as ``[first, last, stride]`` runs (``[[1, 1000, 1]]`` for steps 1 to 1000)."""
    ranges: list[list[int]] = []
    for step in steps:
        if ranges:
            first, last, stride = ranges[-1]
            if first == last and step > last:  # a run's second point sets its stride
                ranges[-1] = [first, step, step - first]
                continue
            if step - last == stride:
                ranges[-1][1] = step
                continue
        ranges.append([step, step, 1])
    return ranges


def expand_ranges(ranges: Iterable[Sequence[int]]) -> list[int]:
    """The steps that :func:`step_ranges` wrote as ranges."""
    return [step for first, last, stride in ranges for step in range(first, last + 1, stride)]


def _describe(series: Series, **extra) -> dict:
    return {"label": series.label, "points": len(series.steps), "steps": step_ranges(series.steps), **extra}


def _matplotlib():
    """matplotlib's object API, imported when a picture is drawn: it is an optional dependency, and
    the object API (not pyplot) leaves the global backend of a process that imports merak alone."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError("drawing loss curves needs matplotlib; install merak[dev] or `pip install matplotlib`") \
            from error
    return Figure, FigureCanvasAgg


def _new_axes(title: str):
    figure_type, canvas_type = _matplotlib()
    figure = figure_type(figsize=(8, 4.5), dpi=_DPI, layout="constrained")
    canvas_type(figure)
    axes = figure.subplots()
    axes.xaxis.set_major_locator(_integer_locator())  # steps: no 1.5 on a short run's axis
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.grid(True, alpha=0.3)
    if title:
        axes.set_title(title)
    return figure, axes


def _integer_locator():
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


def _plot(axes, series: Series, **style) -> list:
    if len(series.steps) < _MARK_BELOW:
        style.setdefault("marker", ".")
    return axes.plot(series.steps, series.values, label=series.label, **style)


def _save(figure, path: str | os.PathLike, description: dict) -> None:
    metadata = {METADATA_KEY: json.dumps(description, separators=(",", ":"))}
    _write_atomic(path, lambda handle: figure.savefig(handle, format="png", dpi=_DPI, metadata=metadata))


def _write_atomic(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> None:
    """Readers (a user refreshing the picture during a sweep) see the old file or the new one."""
    path = os.fspath(path)
    temporary = f"{path}.tmp.{os.getpid()}"  # same directory: os.replace stays a rename
    try:
        with open(temporary, "wb") as handle:
            write(handle)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def draw_run(curves: RunCurves, path: str | os.PathLike, *, title: str = "") -> dict:
    """Draw one run's curves into the PNG ``path``: training loss, evaluation loss (where present) and
    the learning rate on a second axis.

    Returns:
        The description embedded in the picture: ``{"kind": "run", "series": [{"label", "points",
        "steps"}, ...]}``, one entry per drawn line.

    Raises:
        ImportError: If matplotlib is not installed.
    """
    figure, axes = _new_axes(title)
    lines = _plot(axes, curves.train_loss, color="C0", linewidth=1.2)
    drawn = [curves.train_loss]
    if curves.eval_loss.steps:
        lines += _plot(axes, curves.eval_loss, color="C1", linewidth=1.2, marker="o", markersize=4)
        drawn.append(curves.eval_loss)
    if curves.learning_rate.steps:
        rate_axes = axes.twinx()
        rate_axes.set_ylabel("learning rate")
        rate_axes.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        lines += _plot(rate_axes, curves.learning_rate, color="0.45", linewidth=1.0, linestyle="--")
        drawn.append(curves.learning_rate)
    # Above the plot, not on it: the learning rate's axes would draw over a legend in the loss axes.
    figure.legend(handles=lines, loc="outside upper center", ncols=len(lines), frameon=False, fontsize="small")
    description = {"kind": "run", "series": [_describe(series) for series in drawn]}
    _save(figure, path, description)
    return description


def draw_sweep(jobs: Sequence[tuple[str, RunCurves]], path: str | os.PathLike, *, title: str = "") -> dict:
    """Draw the jobs of a sweep into the PNG ``path``: each job's training loss in its own colour and
    its evaluation loss (where present) dashed in the same colour.

    Args:
        jobs: ``(label, curves)`` per job, in the legend's order.

    Returns:
        The description embedded in the picture: ``{"kind": "sweep", "series": [{"job", "label",
        "points", "steps"}, ...]}``, one entry per drawn line.

    Raises:
        ImportError: If matplotlib is not installed.
    """
    figure, axes = _new_axes(title)
    described = []
    for index, (label, curves) in enumerate(jobs):
        colour = f"C{index % 10}"
        train = Series(f"{label}: train", curves.train_loss.steps, curves.train_loss.values)
        _plot(axes, train, color=colour, linewidth=1.2)
        described.append(_describe(train, job=label))
        if curves.eval_loss.steps:
            evaluation = Series(f"{label}: eval", curves.eval_loss.steps, curves.eval_loss.values)
            _plot(axes, evaluation, color=colour, linewidth=1.0, linestyle="--", marker="o", markersize=3)
            described.append(_describe(evaluation, job=label))
    if described:  # beside the plot: a sweep of many jobs has a long legend
        figure.legend(loc="outside right upper", fontsize="x-small", frameon=False)
    description = {"kind": "sweep", "series": described}
    _save(figure, path, description)
    return description


def write_run_curves(output_dir: str | os.PathLike, *, title: str = "") -> dict | None:
    """Write ``loss.png`` beside the run's ``metrics.jsonl`` (the reporting rank calls this once the
    run stops, finished or not).

    Returns:
        The picture's description (see :func:`draw_run`), or None when none was written: no
        training step to draw, or no matplotlib (a warning says so).
    """
    metrics_path = os.path.join(output_dir, METRICS_FILE)
    if not os.path.isfile(metrics_path):
        return None
    curves = read_run_curves(metrics_path)
    if not curves.train_loss.steps:
        return None
    return _drawn_or_warned(lambda: draw_run(curves, os.path.join(output_dir, PICTURE), title=title),
                            os.path.join(output_dir, PICTURE))


def write_sweep_curves(sweep_dir: str | os.PathLike, jobs: Sequence[tuple[str, str | os.PathLike]], *,
                       title: str = "") -> dict | None:
    """Write ``loss.png`` in ``sweep_dir`` comparing the jobs ``(label, output directory)`` that
    logged a training step.

    Returns:
        The picture's description (see :func:`draw_sweep`), or None when none was written.
    """
    drawn = []
    for label, output_dir in jobs:
        metrics_path = os.path.join(output_dir, METRICS_FILE)
        if os.path.isfile(metrics_path):
            curves = read_run_curves(metrics_path)
            if curves.train_loss.steps:
                drawn.append((label, curves))
    if not drawn:
        return None
    path = os.path.join(sweep_dir, PICTURE)
    return _drawn_or_warned(lambda: draw_sweep(drawn, path, title=title), path)


def _drawn_or_warned(draw: Callable[[], dict], path: str) -> dict | None:
    """A picture is a by-product: failing to draw one is worth a warning, never a failed run."""
    try:
        description = draw()
    except ImportError as error:
        logger.warning("no %s: %s", path, error)
        return None
    except (OSError, ValueError) as error:
        logger.warning("could not draw %s: %s", path, error)
        return None
    logger.debug("wrote %s", path)
    return description


def read_description(path: str | os.PathLike) -> dict:
    """The description a loss picture holds (see the module docstring). Reading needs Pillow, which
    matplotlib installs.

    Raises:
        KeyError: If the PNG holds no description (not drawn by this module).
    """
    from PIL import Image

    with Image.open(path) as image:
        return json.loads(image.text[METADATA_KEY])


def drawn_steps(path: str | os.PathLike) -> dict[str, list[int]]:
    """The steps of every line of a loss picture, by label."""
    return {series["label"]: expand_ranges(series["steps"]) for series in read_description(path)["series"]}


__all__ = ["METADATA_KEY", "PICTURE", "RunCurves", "Series", "draw_run", "draw_sweep", "drawn_steps",
           "expand_ranges", "read_description", "read_run_curves", "step_ranges", "write_run_curves",
           "write_sweep_curves"]
