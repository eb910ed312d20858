"""Frequency plan files: zeus's format, read without ``eval``.

A plan file holds a Python literal: a list with one list per pipeline stage of
``(instruction, MHz)`` pairs, in the order the stage runs its compute instructions in one
step. zeus's ``PointSolution`` scheduler and merak's own server both serve it.
"""

from __future__ import annotations

import ast
import os

from merak.core.files import write_text_atomic
from merak.energy.dag import StepGraph

StagePlans = list[list[tuple[str, int]]]


class PlanError(ValueError):
    """A plan file that is malformed or does not fit the schedule it is used with."""


def format_plan(plans: StagePlans) -> str:
    """The file text: one stage per line."""
    lines = ",\n".join(" " + repr([(str(name), int(mhz)) for name, mhz in stage]) for stage in plans)
    return f"[\n{lines},\n]\n"


def write_plan(path: str, plans: StagePlans) -> None:
    """Write ``plans`` atomically (zeus wants the ``.py`` suffix)."""
    write_text_atomic(path, format_plan(plans))


def read_plan(path: str) -> StagePlans:
    """Parse a plan file with ``ast.literal_eval``.

    Every problem, whatever the file holds (binary data, nesting deeper than the parser goes), is
    a one-line PlanError naming the file.

    Raises:
        PlanError: missing file, not UTF-8, not a literal, or not a list of lists of ``(str, int)``.
    """
    if not os.path.isfile(path):
        why = "is not a file" if os.path.exists(path) else "does not exist"
        raise PlanError(f"plan file {path!r} {why}")
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except UnicodeDecodeError as error:
        raise PlanError(f"plan file {path!r} is not UTF-8 text (byte {error.object[error.start]:#04x} at offset "
                        f"{error.start}): not a plan.py that merak-energy plan wrote") from None
    except OSError as error:
        raise PlanError(f"plan file {path!r} cannot be read: {error.strerror or error}") from None
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as error:
        # literal_eval's message may quote a line of the file: keep the error to one line.
        why = " ".join(str(error).split())[:200]
        raise PlanError(f"plan file {path!r} is not a Python literal list of stage plans: {why}") from None
    if not isinstance(value, (list, tuple)) or not value:
        raise PlanError(f"plan file {path!r} must hold a non-empty list with one list per stage")
    plans: StagePlans = []
    for stage, entries in enumerate(value):
        if not isinstance(entries, (list, tuple)):
            raise PlanError(f"plan file {path!r}: stage {stage} is not a list of (instruction, MHz)")
        stage_plan = []
        for position, entry in enumerate(entries):
            if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], str)
                    and isinstance(entry[1], int) and not isinstance(entry[1], bool) and entry[1] > 0):
                raise PlanError(f"plan file {path!r}: stage {stage} entry {position} is {entry!r}, not "
                                "(instruction name, positive MHz)")
            stage_plan.append((entry[0], entry[1]))
        plans.append(stage_plan)
    return plans


def check_plan(plans: StagePlans, graph: StepGraph, *, source: str = "the plan") -> None:
    """Raise PlanError unless ``plans`` lists, per stage, exactly the graph's instruction names."""
    if len(plans) != graph.num_stages:
        raise PlanError(f"{source} has {len(plans)} stage plans but the pipeline has {graph.num_stages} stages")
    for stage, stage_plan in enumerate(plans):
        names = graph.stage_names(stage)
        planned = [name for name, _ in stage_plan]
        if len(planned) != len(names):
            raise PlanError(f"{source}: stage {stage} lists {len(planned)} instructions but the schedule runs "
                            f"{len(names)} per step (was it made for another microbatch count or schedule?)")
        for position, (want, got) in enumerate(zip(names, planned)):
            if want != got:
                raise PlanError(f"{source}: stage {stage} instruction #{position} is {got!r} but the schedule runs "
                                f"{want!r} there (was it made for another schedule?)")
