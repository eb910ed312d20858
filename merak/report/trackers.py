"""Experiment trackers for recipe runs (``trainer.report_to``): TensorBoard and Weights & Biases.

Rank 0 hands each logged training step and each evaluation to every tracker; the
metrics file ``metrics.jsonl`` is written either way. Weights & Biases runs offline
unless ``WANDB_MODE`` says otherwise (these machines have no network), into the run
directory; ``wandb sync`` uploads it later.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Sequence

logger = logging.getLogger(__name__)

TRACKERS = ("tensorboard", "wandb")


def tracker_names(report_to) -> list[str]:
    """``report_to`` as a list of tracker names ("none" and an empty list: none; "all": every installed one)."""
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    if names == ["all"]:
        return [name for name in TRACKERS if _installed(name)]
    return [name for name in names if name != "none"]


def _installed(name: str) -> bool:
    return importlib.util.find_spec("tensorboard" if name == "tensorboard" else name) is not None


def tracker_problems(report_to) -> list[str]:
    """What cannot work in ``report_to`` (unknown or not installed trackers)."""
    problems = []
    for name in tracker_names(report_to):
        if name not in TRACKERS:
            problems.append(f"trainer.report_to names {name!r}; use none, all or any of {', '.join(TRACKERS)}")
        elif not _installed(name):
            problems.append(f"trainer.report_to names {name} but it is not installed (pip install {name})")
    return problems


class TensorBoardTracker:
    """Scalars in ``<output_dir>/runs`` (``tensorboard --logdir <output_dir>/runs``)."""

    def __init__(self, output_dir: str, run_name: str | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(output_dir, "runs", run_name or "merak"))

    def log(self, metrics: dict, step: int) -> None:
        for name, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A Weights & Biases run in ``<output_dir>/wandb``, offline unless ``WANDB_MODE`` is set."""

    def __init__(self, output_dir: str, run_name: str | None, config: dict) -> None:
        import wandb

        self.run = wandb.init(dir=output_dir, name=run_name, config=config, project="merak",
                              mode=os.environ.get("WANDB_MODE", "offline"))

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """Every tracker ``report_to`` names (none: a no-op)."""

    def __init__(self, names: Sequence[str], output_dir: str, *, run_name: str | None = None,
                 config: dict | None = None) -> None:
        self.trackers = []
        for name in names:
            if name == "tensorboard":
                self.trackers.append(TensorBoardTracker(output_dir, run_name))
            elif name == "wandb":
                self.trackers.append(WandbTracker(output_dir, run_name, config or {}))
        if self.trackers:
            logger.info("reporting to %s", ", ".join(names))

    def log(self, metrics: dict, step: int) -> None:
        for tracker in self.trackers:
            tracker.log(metrics, step)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


__all__ = ["TRACKERS", "TensorBoardTracker", "Trackers", "WandbTracker", "tracker_names", "tracker_problems"]
