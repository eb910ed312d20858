"""Where model libraries' adapters register default tensor-parallel plans.

:func:`merak.tensor_parallel.default_plan` gives a model the user describes no
plan for the plan of the first source that knows the model, and
:func:`merak.tensor_parallel.plan_for` turns a user's plan written as a dict
(module glob -> style name) into a plan with a source's translator. The
sources live in the adapters (the Hugging Face one, :mod:`merak.hf.tp_plans`,
registers itself when merak is imported), so tensor parallelism itself knows no
model library and imports no adapter.

Plans are passed through untyped here: this module imports nothing else from
merak.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlanSource:
    """A library's default tensor-parallel plans.

    Attributes:
        name: who provides them (named in log messages and errors).
        default_plan: ``default_plan(model)``: the plan (a ``TPPlan``) ``model``
            trains with when the user gives none; None when this source does not know the model.
        translate: ``translate(model, rules)``: the plan a dict of rules in this
            library's form describes for ``model`` (None when it splits nothing); None when the
            library has no such form.
    """

    name: str
    default_plan: Callable[[Any], Any]
    translate: Callable[[Any, Mapping[str, str]], Any] | None = None


_SOURCES: dict[str, PlanSource] = {}


def register_plan_source(source: PlanSource) -> None:
    """Add ``source`` (replacing an earlier one of the same name, which keeps its place)."""
    if source.name not in _SOURCES:
        logger.debug("tensor-parallel plan source %r registered", source.name)
    _SOURCES[source.name] = source


def unregister_plan_source(name: str) -> None:
    """Remove the source called ``name`` (nothing when there is none)."""
    _SOURCES.pop(name, None)


def plan_sources() -> tuple[PlanSource, ...]:
    """The registered sources, in the order they were first registered."""
    return tuple(_SOURCES.values())
