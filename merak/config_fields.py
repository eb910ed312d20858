"""Typed config sections: every value checked against its dataclass field's type and range.

A Hydra override such as ``trainer.learning_rate=abc`` arrives as the string
``'abc'``; without this check it would reach the optimizer inside the workers. Each
wrong value is reported with its field's name, and replaced by the field's default in
the settings object, so that the later checks (which compare values) neither crash
nor report the same field twice.

Hydra parses override values as YAML-like literals: ``1e4``, ``5e-5`` and ``.5`` are
floats, ``3`` and ``1_000`` ints, ``true`` a bool, ``nan``/``inf`` floats, and
anything else (``abc``, ``yes``, ``0x10``) a string.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from typing import Any


def typed_section(values: dict, cls, section: str, problems: list[str]):
    """``cls(**values)`` after checking each value against its field's type and range.

    Unknown keys and wrong values are appended to ``problems`` as messages naming
    ``<section>.<field>``; a wrong value's field keeps its default. Numbers given for
    ``float`` fields come out as floats.
    """
    hints = typing.get_type_hints(cls)
    fields = {field.name for field in dataclasses.fields(cls)}
    for key in sorted(set(values) - fields):
        problems.append(f"{section}.{key} is not a known setting; known: {', '.join(sorted(fields))}")
    kept = {}
    for name, value in values.items():
        if name not in fields:
            continue
        problem, converted = field_problem(section, name, value, hints[name])
        if problem:
            problems.append(problem)
        else:
            kept[name] = converted
    return cls(**kept)


def field_problem(section: str, name: str, value, hint) -> tuple[str | None, Any]:
    """The message for a wrong ``value`` of field ``name`` (None when it is fine), and the value
    converted to the field's type. The range is checked only when the type is right."""
    ok, converted = _conform(value, hint)
    if not ok:
        return f"{section}.{name}={value!r} must be {_describe(hint)}{_integer_hint(value, hint)}", value
    requirement = _range_problem(section, name, converted)
    if requirement:
        return f"{section}.{name}={value!r} {requirement}", value
    return None, converted


def _union_options(hint) -> tuple | None:
    """The members of ``X | Y`` (or ``Optional[X]``), None for any other type."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return None


def _conform(value, hint) -> tuple[bool, Any]:
    """Whether ``value`` fits ``hint``, and the value converted to it (ints to floats for float
    fields, tuples to lists)."""
    options = _union_options(hint)
    if options is not None:
        # Members are tried in declaration order, so ``int | float`` keeps an int an int.
        for option in options:
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
    if hint is int:  # bool is an int subclass, but true is no step count
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        return _as_float(value)
    if hint is str:
        return isinstance(value, str), value
    if typing.get_origin(hint) is list:
        return _as_list(value, typing.get_args(hint)[0])
    raise TypeError(f"no check for the type {hint!r}")  # a new field type: teach _conform it


def _as_float(value) -> tuple[bool, Any]:
    """An int or float as a float; an int too large for a float does not fit."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False, value
    try:
        return True, float(value)
    except OverflowError:
        return False, value


def _as_list(value, item_hint) -> tuple[bool, Any]:
    """A list (or tuple) whose every element fits ``item_hint``, converted element by element."""
    if not isinstance(value, list | tuple):
        return False, value
    converted = [_conform(element, item_hint) for element in value]
    if not all(ok for ok, _ in converted):
        return False, value
    return True, [element for _, element in converted]


def _describe(hint) -> str:
    """What a value of ``hint`` is, in words: "a number or null"."""
    options = _union_options(hint)
    if options is not None:
        return " or ".join(_describe(option) for option in options)
    if typing.get_origin(hint) is list:
        return f"a list of {_describe(typing.get_args(hint)[0]).removeprefix('a ').removeprefix('an ')}s"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string",
            type(None): "null"}.get(hint, str(hint))


def _integer_hint(value, hint) -> str:
    """For an integer field given a whole float (Hydra reads ``1e4`` as 10000.0): how to write it."""
    options = _union_options(hint) or (hint,)
    if int in options and float not in options and isinstance(value, float) and value.is_integer():
        return f" (write {int(value)})"
    return ""


def _finite(value: float) -> bool:
    return math.isfinite(value)


# Ranges of numeric fields, checked once the type is right: (accepts the value, what it must be).
# The other numeric fields (batch sizes, pipeline_chunks, shard_count, save_steps and zero_stage when
# used, the bucket sizes, the loss-scale integers, tp_overlapping_level, threads_per_rank) are checked
# in merak.config and the modules it calls; a field is checked in one place, so no problem is reported
# twice.
_RANGES: dict[tuple[str, str], tuple[Callable[[Any], bool], str]] = {
    ("trainer", "seed"): (lambda v: 0 <= v < 2 ** 32, "must be within 0 .. 2**32-1"),
    # 0 passes here: merak.config reports it as "nothing to train".
    ("trainer", "max_steps"): (lambda v: v >= -1, "must be -1 (train num_train_epochs) or a positive integer"),
    ("trainer", "num_train_epochs"): (_finite, "must be a finite number"),
    ("trainer", "learning_rate"): (lambda v: _finite(v) and v >= 0, "must be a finite number >= 0"),
    ("trainer", "weight_decay"): (lambda v: _finite(v) and v >= 0, "must be a finite number >= 0"),
    ("trainer", "adam_beta1"): (lambda v: 0 <= v < 1, "must be within [0, 1)"),
    ("trainer", "adam_beta2"): (lambda v: 0 <= v < 1, "must be within [0, 1)"),
    # Adam divides by sqrt(v) + epsilon: 0 turns a parameter with no gradient yet into NaN.
    ("trainer", "adam_epsilon"): (lambda v: _finite(v) and v > 0, "must be a finite number > 0"),
    ("trainer", "max_grad_norm"): (lambda v: _finite(v) and v >= 0, "must be a finite number >= 0 (0: no clipping)"),
    ("trainer", "warmup_steps"): (lambda v: v >= 0, "must be an integer >= 0"),
    ("trainer", "warmup_ratio"): (lambda v: 0 <= v <= 1, "must be within [0, 1]"),
    ("trainer", "logging_steps"): (lambda v: v >= 1, "must be a positive integer"),
    ("trainer", "peak_tflops"): (lambda v: _finite(v) and v > 0, "must be null or a positive number"),
    ("trainer", "sequence_dim"): (lambda v: v >= 0, "must be a non-negative integer"),
    ("trainer", "checkpoint_num_layers"): (lambda v: v >= 1, "must be a positive integer"),
    ("trainer", "gradient_predivide_factor"): (lambda v: _finite(v) and v > 0, "must be positive and finite"),
    ("trainer", "loss_scale"): (_finite, "must be a finite number"),
    ("trainer", "min_loss_scale"): (_finite, "must be a finite number"),
    ("trainer", "max_consecutive_skipped_steps"): (lambda v: v >= 1, "must be a positive integer"),
    ("trainer", "simulated_tflops"): (lambda v: _finite(v) and v > 0, "must be a positive number"),
    ("trainer", "num_warmup_steps"): (lambda v: v >= 0, "must be an integer >= 0"),
    ("trainer", "num_prof_steps"): (lambda v: v >= 1, "must be a positive integer"),
    ("trainer", "eval_steps"): (lambda v: v >= 1, "must be null (no evaluation) or a positive integer"),
    ("trainer", "eval_iters"): (lambda v: v >= 1, "must be null (the whole held-out set) or a positive integer"),
    ("trainer", "eval_holdout"): (lambda v: 0 < v <= 0.5, "must be within (0, 0.5]"),
    ("launcher", "timeout_s"): (lambda v: _finite(v) and v > 0, "must be a positive number of seconds"),
}


def _range_problem(section: str, name: str, value) -> str | None:
    """What ``value`` (already of the right type) must be, or None when it is in range.
    None stands for "unset" wherever a field allows it, so it is never out of range."""
    check = _RANGES.get((section, name))
    if check is None or value is None:
        return None
    accepts, requirement = check
    return None if accepts(value) else requirement
