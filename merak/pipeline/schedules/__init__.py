"""Pipeline schedules: pure functions from (stage, S, M) to a stage's instruction list.

No torch here: schedules are plain data, checked by :mod:`merak.pipeline.simulate`
and run by the executor.
"""

from __future__ import annotations

from collections.abc import Callable

from merak.pipeline.instructions import Instruction
from merak.pipeline.schedules.common import check_pipeline_args, forward_run
from merak.pipeline.schedules.ds_default import ds_default_schedule
from merak.pipeline.schedules.gpipe import gpipe_schedule
from merak.pipeline.schedules.one_f_one_b import one_f_one_b_schedule

ScheduleFn = Callable[[int, int, int], list[Instruction]]

DEFAULT_SCHEDULE = "1f1b"

SCHEDULES: dict[str, ScheduleFn] = {
    "1f1b": one_f_one_b_schedule,
    "ds_default": ds_default_schedule,
    "gpipe": gpipe_schedule,
}


def schedule_names() -> list[str]:
    """Return the registered training schedule names, the default first."""
    return list(SCHEDULES)


def build_schedule(*, name: str, stage_id: int, num_stages: int, num_microbatches: int) -> list[Instruction]:
    """Build one stage's training-step instructions with a registered schedule.

    Args:
        name: A name from :func:`schedule_names`.
        stage_id: This stage, ``0 <= stage_id < num_stages``.
        num_stages: Number of pipeline stages.
        num_microbatches: Number of microbatches per step.

    Returns:
        The stage's instruction list.

    Raises:
        ValueError: If ``name`` is unknown (the message lists the valid names)
            or the numbers are out of range.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; valid names: {', '.join(schedule_names())}")
    check_pipeline_args(stage_id, num_stages, num_microbatches)
    return SCHEDULES[name](stage_id, num_stages, num_microbatches)


def build_forward_only_schedule(*, stage_id: int, num_stages: int, num_microbatches: int) -> list[Instruction]:
    """Build one stage's inference (forward-only) instructions.

    Per microbatch: receive the input (all but the first stage), load inputs or
    labels (first and last stage), forward, send the output (all but the last
    stage). No backward and no gradient or optimizer instructions.

    Args:
        stage_id: This stage, ``0 <= stage_id < num_stages``.
        num_stages: Number of pipeline stages.
        num_microbatches: Number of microbatches.

    Returns:
        The stage's instruction list.

    Raises:
        ValueError: If the numbers are out of range.
    """
    check_pipeline_args(stage_id, num_stages, num_microbatches)
    first, last = stage_id == 0, stage_id == num_stages - 1
    out: list[Instruction] = []
    for m in range(num_microbatches):
        out += forward_run(m, first=first, last=last)
    return out


__all__ = [
    "DEFAULT_SCHEDULE",
    "SCHEDULES",
    "build_forward_only_schedule",
    "build_schedule",
    "schedule_names",
]
