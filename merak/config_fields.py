"""Typed config sections: every value checked against its dataclass field's type and range.

A Hydra override such as ``trainer.learning_rate=abc`` arrives as the string
``'abc'``; without this check it would reach the optimizer inside the workers. Each
wrong value is reported with its field's name, and replaced by the field's default in
the settings object, so that the later checks (which compare values) neither crash
nor report the same field twice.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from typing import Any


def typed_section(values: dict, cls, section: str, problems: list[str]):
    """``cls(**values)`` after checking each value against its field's type and range; unknown keys
    and wrong values are appended to ``problems`` (and the field keeps its default)."""
    hints = typing.get_type_hints(cls)
    fields = {field.name: field for field in dataclasses.fields(cls)}
    for key in sorted(set(values) - set(fields)):
        problems.append(f"{section}.{key} is not a known setting; known: {', '.join(sorted(fields))}")
    kept = {}
    for name, value in values.items():
        if name not in fields:
            continue
        ok, converted = _conform(value, hints[name])
        if not ok:
            problems.append(f"{section}.{name}={value!r} must be {_describe(hints[name])}")
            continue
        problem = _range_problem(section, name, converted)
        if problem:
            problems.append(f"{section}.{name}={value!r} {problem}")
            continue
        kept[name] = converted
    return cls(**kept)


def _conform(value, hint) -> tuple[bool, Any]:
    """Whether ``value`` fits ``hint``, and the value (lists as lists)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            ok, converted = _conform(value, option)
            if ok:
                return True, converted
        return False, value
    if hint is Any:
        return True, value
    if hint is type(None):
        return value is None, value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:  # an int is a number too (and kept as given, so messages echo the input)
        return isinstance(value, int | float) and not isinstance(value, bool), value
    if hint is str:
        return isinstance(value, str), value
    if origin is list:
        if not isinstance(value, list | tuple):
            return False, value
        (item,) = typing.get_args(hint)
        converted = [_conform(element, item) for element in value]
        return all(ok for ok, _ in converted), [element for _, element in converted]
    raise TypeError(f"no check for the type {hint!r}")  # a new field type: teach _conform it


def _describe(hint) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(option) for option in typing.get_args(hint))
    if origin is list:
        return f"a list of {_describe(typing.get_args(hint)[0]).removeprefix('a ').removeprefix('an ')}s"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string",
            type(None): "null"}.get(hint, str(hint))


def _finite(value: float) -> bool:
    return math.isfinite(value)


# Ranges of numeric fields not checked elsewhere in merak.config: (accepts the value, what it must be).
_RANGES: dict[tuple[str, str], tuple[Callable[[Any], bool], str]] = {
    ("trainer", "seed"): (lambda v: 0 <= v < 2 ** 32, "must be within 0 .. 2**32-1"),
    ("trainer", "max_steps"): (lambda v: v >= -1, "must be -1 (train num_train_epochs) or a positive integer"),
    ("trainer", "num_train_epochs"): (_finite, "must be a finite number"),
    ("trainer", "learning_rate"): (lambda v: _finite(v) and v >= 0, "must be a finite number >= 0"),
    ("trainer", "weight_decay"): (lambda v: _finite(v) and v >= 0, "must be a finite number >= 0"),
    ("trainer", "adam_beta1"): (lambda v: 0 <= v < 1, "must be within [0, 1)"),
    ("trainer", "adam_beta2"): (lambda v: 0 <= v < 1, "must be within [0, 1)"),
    ("trainer", "adam_epsilon"): (lambda v: _finite(v) and v >= 0, "must be a finite number >= 0"),
    ("trainer", "max_grad_norm"): (lambda v: _finite(v) and v >= 0, "must be a finite number >= 0 (0: no clipping)"),
    ("trainer", "warmup_steps"): (lambda v: v >= 0, "must be an integer >= 0"),
    ("trainer", "warmup_ratio"): (lambda v: 0 <= v <= 1, "must be within [0, 1]"),
    ("trainer", "logging_steps"): (lambda v: v >= 1, "must be a positive integer"),
    ("trainer", "peak_tflops"): (lambda v: v is None or (_finite(v) and v > 0), "must be null or a positive number"),
    ("trainer", "simulated_tflops"): (lambda v: _finite(v) and v > 0, "must be a positive number"),
    ("trainer", "num_warmup_steps"): (lambda v: v >= 0, "must be an integer >= 0"),
    ("trainer", "num_prof_steps"): (lambda v: v >= 1, "must be a positive integer"),
    ("trainer", "loss_scale"): (_finite, "must be a finite number"),
    ("trainer", "min_loss_scale"): (_finite, "must be a finite number"),
    ("trainer", "max_consecutive_skipped_steps"): (lambda v: v >= 1, "must be a positive integer"),
    ("launcher", "timeout_s"): (lambda v: _finite(v) and v > 0, "must be a positive number of seconds"),
}


def _range_problem(section: str, name: str, value) -> str | None:
    check = _RANGES.get((section, name))
    if check is None or value is None:
        return None
    accepts, requirement = check
    return None if accepts(value) else requirement
