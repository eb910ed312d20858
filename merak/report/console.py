"""What a run prints: one log format for the launching process and every worker.

The process that calls :func:`merak.run` logs through Hydra's handlers (console and the run
directory's ``<job>.log``); the workers it spawns configure their own. Both use
``HH:MM:SS [who] LEVEL logger: message``, where ``who`` is ``main`` for the launching process and
``rank N`` for a worker.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

DATE_FORMAT = "%H:%M:%S"
# Hydra's default job_logging format: replaced, so that the console shows one format. A format the
# user chose (hydra/job_logging=...) is left as it is.
HYDRA_DEFAULT_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


def log_format(who: str) -> str:
    """The format of every merak log line, for the process named ``who``."""
    return f"%(asctime)s [{who}] %(levelname)s %(name)s: %(message)s"


def configure_worker_logging(rank: int, quiet: bool = False) -> None:
    """A worker's logging: rank 0 reports progress (INFO) unless ``quiet``; the other ranks only what goes
    wrong."""
    logging.basicConfig(level=logging.INFO if rank == 0 and not quiet else logging.WARNING, force=True,
                        format=log_format(f"rank {rank}"), datefmt=DATE_FORMAT)


def use_merak_format(who: str = "main") -> None:
    """Give the root logger's handlers that still use Hydra's default format merak's format."""
    for handler in logging.getLogger().handlers:
        if handler.formatter is not None and handler.formatter._fmt == HYDRA_DEFAULT_FORMAT:
            handler.setFormatter(logging.Formatter(log_format(who), datefmt=DATE_FORMAT))


@contextlib.contextmanager
def quiet_below(level: int, *names: str) -> Iterator[None]:
    """Show only records of ``level`` and above from the loggers ``names`` (default ``merak``; each with its
    children) for the duration."""
    targets = [logging.getLogger(name) for name in names or ("merak",)]
    previous = [target.level for target in targets]
    for target in targets:
        target.setLevel(level)
    try:
        yield
    finally:
        for target, level_before in zip(targets, previous, strict=True):
            target.setLevel(level_before)


def only_errors(*names: str):
    """Show only errors of the loggers ``names`` (default ``merak``; each with its children) for the duration.

    For work that is done again later in the run, where it reports the same lines itself, or whose
    lines a summary says again.
    """
    return quiet_below(logging.ERROR, *names)
