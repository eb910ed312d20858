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
import difflib
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
    fields = {field.name: field for field in dataclasses.fields(cls)}
    for key in sorted(set(values) - set(fields)):
        problems.append(unknown_field_problem(section, key, fields))
    kept = {}
    for name, value in values.items():
        if name not in fields:
            continue
        problem, converted = field_problem(section, fields[name], value, hints[name])
        if problem:
            problems.append(problem)
        else:
            kept[name] = converted
    return cls(**kept)


def unknown_field_problem(section: str, key: str, known, *, list_known: bool = True) -> str:
    """The message for a key that is no field of the section: the closest names (if any are close),
    then every known name unless ``list_known`` is false."""
    close = difflib.get_close_matches(key, list(known), n=3, cutoff=0.6)
    guess = f" (did you mean {' or '.join(f'{section}.{name}' for name in close)}?)" if close else ""
    if list_known:
        return f"{section}.{key} is not a known setting{guess}; known: {', '.join(sorted(known))}"
    return f"{section}.{key} is not a known setting{guess or f' (--cfg job --package {section} lists them)'}"


def field_problem(section: str, field: dataclasses.Field, value, hint) -> tuple[str | None, Any]:
    """The message for a wrong ``value`` of ``field`` (None when it is fine), and the value
    converted to the field's type. The range is checked only when the type is right."""
    name = field.name
    ok, converted = _conform(value, hint)
    if not ok:
        return f"{section}.{name}={value!r} must be {_describe(hint)}{_integer_hint(value, hint)}", value
    requirement = _range_problem(field, converted)
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
    if hint is dict:
        return isinstance(value, dict), value
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
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a mapping",
            type(None): "null"}.get(hint, str(hint))


def _integer_hint(value, hint) -> str:
    """For an integer field given a whole float (Hydra reads ``1e4`` as 10000.0): how to write it."""
    options = _union_options(hint) or (hint,)
    if int in options and float not in options and isinstance(value, float) and value.is_integer():
        return f" (write {int(value)})"
    return ""


def _finite(value: float) -> bool:
    return math.isfinite(value)


def setting(default: Any = None, help: str = "", *, check: Callable[[Any], bool] | None = None,
            requirement: str = "", factory: Callable[[], Any] | None = None):
    """A config field: its default, what it means (``help``, shown in the config docs), and optionally
    the range a value of the right type must lie in (``check`` accepts it, ``requirement`` says what it
    must be, e.g. "must be a positive integer"). None always passes the range check: it means unset.
    ``factory`` makes a mutable default (a list) for each instance."""
    metadata = {"help": help}
    if check is not None:
        metadata["range"] = (check, requirement)
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def positive_int_problem(name: str, value, problems: list[str]) -> bool:
    """Append a message to ``problems`` unless ``value`` is a positive integer; whether it is one.
    (For fields whose range is checked where they are used, e.g. only when a feature is on.)"""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        problems.append(f"{name}={value!r} must be a positive integer")
        return False
    return True


# Ranges used by several sections.
def positive(value) -> bool:
    return value >= 1


def non_negative(value) -> bool:
    return value >= 0


def positive_finite(value) -> bool:
    return _finite(value) and value > 0


def non_negative_finite(value) -> bool:
    return _finite(value) and value >= 0


def finite(value) -> bool:
    return _finite(value)


def _range_problem(field: dataclasses.Field, value) -> str | None:
    """What ``value`` (already of the right type) must be, or None when it is in range.
    None stands for "unset" wherever a field allows it, so it is never out of range."""
    check = field.metadata.get("range")
    if check is None or value is None:
        return None
    accepts, requirement = check
    return None if accepts(value) else requirement
