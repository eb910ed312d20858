"""Pipeline schedules: pure functions from (stage, S, M) to a stage's instruction list.

No torch here: schedules are plain data, checked by :mod:`merak.pipeline.simulate`
and run by the executor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from merak.pipeline.instructions import Instruction
from merak.pipeline.schedules.common import check_pipeline_args, forward_run
from merak.pipeline.schedules.ds_default import ds_default_schedule
from merak.pipeline.schedules.gpipe import gpipe_schedule
from merak.pipeline.schedules.interleaved import (
    DEFAULT_CHUNKS,
    interleaved_1f1b_schedule,
)
from merak.pipeline.schedules.last_no_recompute import last_no_recompute_1f1b_schedule
from merak.pipeline.schedules.one_f_one_b import one_f_one_b_schedule
from merak.pipeline.schedules.pre_recompute import pre_recompute_1f1b_schedule
from merak.pipeline.schedules.shifted_critical_path import (
    shifted_critical_path_schedule,
)
from merak.pipeline.schedules.zero_bubble import zb_h1_schedule

ScheduleFn = Callable[..., list[Instruction]]

DEFAULT_SCHEDULE = "1f1b"


@dataclass(frozen=True)
class ScheduleInfo:
    """A registered schedule and what the engine must know about it.

    Attributes:
        build: ``build(stage_id, num_stages, num_microbatches[, num_chunks])``.
        last_stage_checkpoints: False when the last stage must keep full
            activations (its checkpointing is switched off).
        needs_checkpoint_ratio: True when the schedule only makes sense with
            ``activation_checkpoint_ratio`` set (stage-aware recomputation).
        chunked: True when stages hold several model chunks (``num_chunks``).
    """

    build: ScheduleFn
    last_stage_checkpoints: bool = True
    needs_checkpoint_ratio: bool = False
    chunked: bool = False


SCHEDULES: dict[str, ScheduleInfo] = {
    "1f1b": ScheduleInfo(one_f_one_b_schedule),
    "ds_default": ScheduleInfo(ds_default_schedule),
    "gpipe": ScheduleInfo(gpipe_schedule),
    "pre_recompute_1f1b": ScheduleInfo(pre_recompute_1f1b_schedule),
    "last_no_recompute_1f1b": ScheduleInfo(last_no_recompute_1f1b_schedule, last_stage_checkpoints=False),
    "shifted_critical_path": ScheduleInfo(shifted_critical_path_schedule, last_stage_checkpoints=False,
                                          needs_checkpoint_ratio=True),
    "interleaved_1f1b": ScheduleInfo(interleaved_1f1b_schedule, chunked=True),
    "zb_h1": ScheduleInfo(zb_h1_schedule),
}
# Other names users know the same schedules by.
ALIASES = {"early_recompute_1f1b": "pre_recompute_1f1b", "full_critical_path": "shifted_critical_path"}


def schedule_names(*, aliases: bool = True) -> list[str]:
    """Return the training schedule names, the default first (then the aliases)."""
    return list(SCHEDULES) + (list(ALIASES) if aliases else [])


def schedule_info(name: str) -> ScheduleInfo:
    """The registered schedule called ``name`` (or one of its aliases).

    Raises:
        ValueError: If ``name`` is unknown (the message lists the valid names).
    """
    key = ALIASES.get(name, name)
    if key not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; valid names: {', '.join(schedule_names())}")
    return SCHEDULES[key]


def build_schedule(*, name: str, stage_id: int, num_stages: int, num_microbatches: int,
                   num_chunks: int = 1) -> list[Instruction]:
    """Build one stage's training-step instructions with a registered schedule.

    Args:
        name: A name from :func:`schedule_names`.
        stage_id: This stage, ``0 <= stage_id < num_stages``.
        num_stages: Number of pipeline stages.
        num_microbatches: Number of microbatches per step.
        num_chunks: Model chunks per stage; only chunked schedules accept more than 1.

    Returns:
        The stage's instruction list, its transfers grouped at each point in the order the peer posts
        them (:mod:`merak.pipeline.transfers`), so it runs on NCCL's unbuffered sends.

    Raises:
        ValueError: If ``name`` is unknown (the message lists the valid names)
            or the numbers are out of range for the schedule.
    """
    info = schedule_info(name)
    check_pipeline_args(stage_id, num_stages, num_microbatches)
    if not info.chunked and num_chunks != 1:
        raise ValueError(f"schedule {name!r} runs one model chunk per stage, got num_chunks={num_chunks}; "
                         f"use interleaved_1f1b for several")
    return list(_grouped(ALIASES.get(name, name), num_stages, num_microbatches, num_chunks)[stage_id])


@functools.lru_cache(maxsize=1024)
def _grouped(name: str, num_stages: int, num_microbatches: int, num_chunks: int) -> tuple[tuple[Instruction, ...], ...]:
    """Every stage's list of schedule ``name``, its transfers grouped as the peers post them
    (:func:`merak.pipeline.transfers.group_transfers`: the lists of all stages are needed together)."""
    from merak.pipeline.transfers import group_transfers  # it imports validation, which imports this package

    info = SCHEDULES[name]
    build = (lambda s: info.build(s, num_stages, num_microbatches, num_chunks)) if info.chunked else \
        (lambda s: info.build(s, num_stages, num_microbatches))
    return tuple(tuple(stage) for stage in group_transfers([build(s) for s in range(num_stages)]))


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
    "ALIASES",
    "DEFAULT_CHUNKS",
    "DEFAULT_SCHEDULE",
    "SCHEDULES",
    "ScheduleInfo",
    "build_forward_only_schedule",
    "build_schedule",
    "schedule_info",
    "schedule_names",
]
