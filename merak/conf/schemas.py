"""The typed sections as Hydra structured configs, registered in Hydra's ConfigStore.

``trainer/default.yaml`` and ``launcher/local.yaml`` extend these schemas (``defaults: [schema]``),
so a misspelt key or a value of the wrong type fails when Hydra composes the config, in a YAML
file as on the command line. Plain and optional values are typed here; a list or any other union
(``str | list[str]``, ``int | float``) is ``Any`` (OmegaConf's typed lists reject an interpolation
such as ``${model.split_points}`` while composing), and its value is checked with the rest by
merak.config.resolve_settings.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Optional

from hydra.core.config_store import ConfigStore

from merak.config import TRAINER_SECTIONS, LauncherSettings

_PLAIN = (bool, int, float, str)


def omegaconf_type(hint):
    """``hint`` as a type OmegaConf can enforce, else ``Any``."""
    if hint in _PLAIN:
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [member for member in typing.get_args(hint) if member is not type(None)]
        if len(members) == 1 and len(members) < len(typing.get_args(hint)):
            inner = omegaconf_type(members[0])
            return Any if inner is Any else Optional[inner]  # noqa: UP045 (OmegaConf reads typing.Optional)
    return Any


def hydra_schema(name: str, classes) -> type:
    """A structured-config dataclass ``name`` with the fields and defaults of every class in ``classes``
    (one flat group), typed for OmegaConf."""
    fields = []
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if field.default is dataclasses.MISSING:
                default = dataclasses.field(default_factory=field.default_factory)
            else:
                default = dataclasses.field(default=field.default)
            fields.append((field.name, omegaconf_type(hints[field.name]), default))
    schema = dataclasses.make_dataclass(name, fields)
    schema.__module__ = __name__  # a composed config is pickled for spawned workers: its class must be found
    return schema


# The trainer group is flat (trainer.learning_rate): its schema holds the fields of every section.
TrainerSettingsSchema = hydra_schema("TrainerSettingsSchema", TRAINER_SECTIONS.values())
LauncherSettingsSchema = hydra_schema("LauncherSettingsSchema", [LauncherSettings])


def register_schemas() -> None:
    """Register ``trainer/schema`` and ``launcher/schema`` (idempotent)."""
    store = ConfigStore.instance()
    store.store(group="trainer", name="schema", node=TrainerSettingsSchema)
    store.store(group="launcher", name="schema", node=LauncherSettingsSchema)
