"""Command-line overrides of the typed config groups, checked before Hydra composes, and
``hydra_main``: ``hydra.main`` for a recipe's ``train.py`` that runs that check first.

``hydra_main`` also defers the job's record: Hydra writes ``.hydra/`` (config, overrides) and opens
``train.log`` before the task starts, that is before merak holds the run directory's lock, so a run
refused for a busy directory would rewrite the running run's record and log its error into the
running run's log. merak turns both off in Hydra and writes them itself once it holds the lock
(:func:`hydra_run_record`), to the same places, unless the command line chooses Hydra's
``output_subdir`` or ``job_logging`` itself.

Hydra already rejects a misspelt key or a wrong value while composing (the groups extend typed
schemas, merak.conf.schemas), but it reports one in six lines, with OmegaConf's internals. This
checks each override of ``trainer.*`` and ``launcher.*`` against its field the way
merak.config.resolve_settings checks values, and reports each problem as one line, with exit
status 2, before Hydra starts. What it does not check (sweeps, interpolations, YAML files) Hydra
and resolve_settings still do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import sys
import typing
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from merak.core.fields import field_problem, unknown_field_problem
from merak.report.console import DATE_FORMAT, log_format

logger = logging.getLogger(__name__)

EXIT_CANNOT_START = 2


def _typed_groups() -> dict[str, dict[str, tuple[dataclasses.Field, Any]]]:
    """The field and type of each setting of the typed config groups, by its name on the command line."""
    from merak.config import SECTION_OF, TRAINER_FIELDS, TRAINER_SECTIONS, LauncherSettings

    section_hints = {name: typing.get_type_hints(cls) for name, cls in TRAINER_SECTIONS.items()}
    launcher_hints = typing.get_type_hints(LauncherSettings)
    return {"trainer": {name: (field, section_hints[SECTION_OF[name]][name]) for name, field in TRAINER_FIELDS.items()},
            "launcher": {field.name: (field, launcher_hints[field.name])
                         for field in dataclasses.fields(LauncherSettings)}}


def override_problems(arguments: Sequence[str]) -> list[str]:
    """The problems with the ``trainer.*``/``launcher.*`` overrides among command-line ``arguments``
    (Hydra's flags are skipped), one message per bad override."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parsed, _ = get_args_parser().parse_known_args(list(arguments))
    try:
        overrides = OverridesParser.create().parse_overrides(parsed.overrides)
    except HydraException:
        return []  # a syntax error: Hydra reports it with the position
    groups, problems = _typed_groups(), []
    for override in overrides:
        group, _, name = override.key_or_group.partition(".")
        fields = groups.get(group)
        if fields is None or not name or override.is_delete() or override.package:
            continue
        name = name.split(".")[0]
        if name not in fields:
            problems.append(unknown_field_problem(group, name, fields, list_known=False))
            continue
        if override.is_sweep_override():
            continue
        value = override.value()
        if isinstance(value, str) and "${" in value:
            continue  # an interpolation: resolved (and checked) later
        field, hint = fields[name]
        problem, _ = field_problem(group, field, value, hint)
        if problem:
            problems.append(problem)
    return problems


def hydra_main(*, config_path: str, config_name: str) -> Callable:
    """``hydra.main(version_base=None, config_path=..., config_name=...)`` whose command first checks
    the overrides of the typed groups (see the module docstring)."""
    import hydra

    def decorate(task: Callable) -> Callable:
        as_typed: list[str] = []  # the command line as the user typed it, for the task to see

        @functools.wraps(task)
        def typed_argv_task(cfg):
            if as_typed:
                sys.argv[:] = as_typed  # the run directory's lock records the command as typed
            return task(cfg)

        hydra_task = hydra.main(version_base=None, config_path=config_path, config_name=config_name)(typed_argv_task)

        @functools.wraps(task)
        def command(*args, **kwargs):
            if not args and not kwargs:  # called as the command, not with a config
                problems = override_problems(sys.argv[1:])
                if problems:
                    logging.basicConfig(format=log_format("main"), datefmt=DATE_FORMAT)
                    for problem in problems:
                        logger.error("%s", problem)
                    raise SystemExit(EXIT_CANNOT_START)
                as_typed[:] = sys.argv
                sys.argv[1:] = _with_record_deferred(sys.argv[1:])
            return hydra_task(*args, **kwargs)

        return command

    return decorate


# Hydra overrides that leave the job's record and log file to merak (hydra_run_record).
_DEFERRED_RECORD = ("hydra.output_subdir=null", "~hydra.job_logging.handlers.file",
                    "hydra.job_logging.root.handlers=[console]")
_RECORD_DIR = ".hydra"  # where Hydra writes it by default


def _with_record_deferred(arguments: Sequence[str]) -> list[str]:
    """The command line with :data:`_DEFERRED_RECORD` added, unless it sets Hydra's record or logging."""
    own = ("hydra.output_subdir", "hydra.job_logging", "hydra/job_logging", "--help", "-h", "--hydra-help")
    if any(argument.lstrip("~+").startswith(own) for argument in arguments):
        return list(arguments)
    return [*arguments, *_DEFERRED_RECORD]


@contextlib.contextmanager
def hydra_run_record(cfg) -> Iterator[None]:
    """Write the Hydra job's record (``.hydra/config.yaml``, ``hydra.yaml``, ``overrides.yaml``) and log
    to its ``<job name>.log`` within the block, as Hydra would have, when :func:`hydra_main` deferred
    them; otherwise (not under Hydra, or Hydra wrote them itself) do nothing. Called by the run that
    holds the run directory's lock."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import OmegaConf

        everything = HydraConfig.instance().cfg
        hydra_cfg = HydraConfig.get()
    except (ImportError, ValueError):  # not a Hydra job
        yield
        return
    if everything is None or not set(_DEFERRED_RECORD) <= set(hydra_cfg.overrides.hydra):
        yield
        return
    output_dir = Path(hydra_cfg.runtime.output_dir)
    record = output_dir / _RECORD_DIR
    record.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, record / "config.yaml")
    OmegaConf.save(everything, record / "hydra.yaml")
    OmegaConf.save(hydra_cfg.overrides.task, record / "overrides.yaml")
    handler = logging.FileHandler(output_dir / f"{hydra_cfg.job.name}.log")
    handler.setFormatter(logging.Formatter(log_format("main"), datefmt=DATE_FORMAT))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()
