"""The instruction profile file: time and energy of each compute instruction at each clock.

The format is Merak-Zeus's (and what zeus's and lowtime's tools read): a CSV with the columns
``rank,dp_rank,pp_rank,tp_rank,stage,instruction,frequency,time,energy`` (MHz, seconds and
joules for one instruction on one microbatch, averaged over the profiled repetitions), one
row per rank, instruction and clock, in a file named
``merak+{model}+{partition_method}+dp{dp}+pp{pp}+tp{tp}+mbs{mbs}.csv``.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections import defaultdict
from dataclasses import dataclass

from merak.core.files import write_text_atomic

COLUMNS = ["rank", "dp_rank", "pp_rank", "tp_rank", "stage", "instruction", "frequency", "time", "energy"]


class ProfileError(ValueError):
    """A profile file that cannot be used; the message says what is missing or wrong."""


@dataclass(frozen=True)
class ProfileRow:
    """One measured (rank, instruction, clock)."""

    rank: int
    dp_rank: int
    pp_rank: int
    tp_rank: int
    instruction: str
    frequency: int
    time: float
    energy: float

    @property
    def stage(self) -> int:
        return self.pp_rank


@dataclass(frozen=True)
class Option:
    """Running one instruction at ``frequency``: it takes ``time`` seconds and ``energy`` joules."""

    frequency: int
    time: float
    energy: float


def profile_file_name(*, model: str, partition_method: str, dp: int, pp: int, tp: int, micro_batch_size: int) -> str:
    """The profile's file name, as Merak-Zeus names it."""
    return f"merak+{model}+{partition_method}+dp{dp}+pp{pp}+tp{tp}+mbs{micro_batch_size}.csv"


@dataclass(frozen=True)
class Overheads:
    """What a step takes besides its compute instructions, measured by the profile run.

    Attributes:
        instruction: seconds the host adds around each instruction on a path (transfers, launches,
            listeners): the measured critical path less the profiled instructions', per instruction on it.
        step: seconds from the end of the last compute instruction to the end of the step (gradient
            reduction and optimizer step).
    """

    instruction: float
    step: float


def overheads_path(profile_path: str) -> str:
    """Where the overheads of the profile at ``profile_path`` are kept (beside it)."""
    return os.path.splitext(profile_path)[0] + ".overheads.json"


def write_overheads(profile_path: str, overheads: Overheads) -> None:
    """Write ``overheads`` beside the profile (atomically)."""
    write_text_atomic(overheads_path(profile_path),
                      json.dumps({"instruction_overhead_s": overheads.instruction,
                                  "step_overhead_s": overheads.step}, indent=1) + "\n")


def read_overheads(profile_path: str) -> Overheads | None:
    """The overheads measured with the profile at ``profile_path``; None when there is no such file.

    Raises:
        ProfileError: the file exists but does not hold two numbers >= 0.
    """
    path = overheads_path(profile_path)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        values = float(data["instruction_overhead_s"]), float(data["step_overhead_s"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ProfileError(f"{path} is not an overheads file ({error})") from None
    if not all(math.isfinite(v) and v >= 0 for v in values):
        raise ProfileError(f"{path}: overheads must be numbers >= 0, got {values}")
    return Overheads(*values)


def write_profile(path: str, rows: list[ProfileRow]) -> None:
    """Write ``rows`` (atomically) with the columns in :data:`COLUMNS`."""
    lines = [",".join(COLUMNS)]
    for row in sorted(rows, key=lambda r: (r.rank, r.instruction != "forward", r.instruction, -r.frequency)):
        lines.append(f"{row.rank},{row.dp_rank},{row.pp_rank},{row.tp_rank},{row.stage},{row.instruction},"
                     f"{row.frequency},{row.time!r},{row.energy!r}")
    write_text_atomic(path, "\n".join(lines) + "\n")


def read_profile(path: str) -> dict[tuple[int, str], list[Option]]:
    """Read a profile into ``{(stage, instruction): [Option, ...]}`` sorted by clock, highest first.

    Rows of the same stage, instruction and clock from several ranks (dp, tp) are averaged.

    Raises:
        ProfileError: the file is missing, lacks a column, or has a value that is not a
            positive number (the message names the line).
    """
    if not os.path.isfile(path):
        raise ProfileError(f"profile {path!r} does not exist")
    sums: dict[tuple[int, str, int], list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    with open(path, newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in ("stage", "instruction", "frequency", "time", "energy")
                   if c not in (reader.fieldnames or [])]
        if missing:
            raise ProfileError(f"profile {path!r} lacks the column(s) {', '.join(missing)}; "
                               f"expected {','.join(COLUMNS)}")
        for line, record in enumerate(reader, start=2):
            try:
                stage, frequency = int(record["stage"]), int(float(record["frequency"]))
                seconds, joules = float(record["time"]), float(record["energy"])
            except (TypeError, ValueError):
                raise ProfileError(f"{path}:{line}: stage, frequency, time and energy must be numbers, got "
                                   f"{record}") from None
            if stage < 0 or frequency <= 0 or not (math.isfinite(seconds) and seconds > 0) \
                    or not (math.isfinite(joules) and joules > 0):
                raise ProfileError(f"{path}:{line}: stage must be >= 0 and frequency, time and energy positive, "
                                   f"got {record}")
            entry = sums[(stage, record["instruction"].strip(), frequency)]
            entry[0] += seconds
            entry[1] += joules
            entry[2] += 1
    if not sums:
        raise ProfileError(f"profile {path!r} has no rows")
    options: dict[tuple[int, str], list[Option]] = defaultdict(list)
    for (stage, name, frequency), (seconds, joules, count) in sums.items():
        options[(stage, name)].append(Option(frequency, seconds / count, joules / count))
    return {key: sorted(values, key=lambda o: -o.frequency) for key, values in sorted(options.items())}


def check_coverage(options: dict[tuple[int, str], list[Option]], needed: set[tuple[int, str]], path: str) -> None:
    """Raise ProfileError unless ``options`` has every (stage, instruction) in ``needed``."""
    missing = sorted(needed - set(options))
    if missing:
        stages = sorted({s for s, _ in options})
        shown = ", ".join(f"stage {s} {name}" for s, name in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ProfileError(f"profile {path!r} has no rows for {shown}{more} (it covers stages {stages}); "
                           "profile with the same pipeline degree and train_schedule as the plan")
