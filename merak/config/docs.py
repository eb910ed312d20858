"""Write docs/config/<section>.md from the typed config sections, so the documentation of every
setting (type, default, range, meaning) is the code's: ``python -m merak.config.docs [DIR]``.
tests/unit/test_config_docs.py fails when a file is out of date."""

from __future__ import annotations

import dataclasses
import logging
import sys
import typing
from pathlib import Path

logger = logging.getLogger(__name__)


def config_sections() -> dict[str, tuple[str, type]]:
    """``file stem -> (config group, section class)`` for every documented section."""
    from merak.config import TRAINER_SECTIONS, LauncherSettings

    sections = {name: ("trainer", cls) for name, cls in TRAINER_SECTIONS.items()}
    sections["launcher"] = ("launcher", LauncherSettings)
    return sections


def _type_name(hint) -> str:
    text = str(hint) if not isinstance(hint, type) else hint.__name__
    return text.replace("typing.", "").replace("NoneType", "None")


def _default(field: dataclasses.Field) -> str:
    """The default as written in YAML."""
    value = field.default_factory() if field.default is dataclasses.MISSING else field.default
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value)


def section_markdown(stem: str, group: str, cls: type) -> str:
    """One section's page: what it is, where it lives, and a table of its settings."""
    hints = typing.get_type_hints(cls)
    doc = " ".join((cls.__doc__ or "").split())
    lines = [f"# `{group}` settings: {stem.replace('_', ' ')}", "",
             f"{doc}", "",
             f"Defined by `{cls.__module__}.{cls.__name__}`, beside the code that consumes it. Set a value in a "
             f"recipe's YAML or on the command line (`{group}.NAME=VALUE`); a misspelt name or a value of the "
             f"wrong type fails when the config is composed, a value out of range before any worker starts.",
             "", "| setting | type | default | meaning |", "|---|---|---|---|"]
    for field in dataclasses.fields(cls):
        meaning = field.metadata.get("help", "")
        check = field.metadata.get("range")
        if check and check[1]:
            meaning += f" ({check[1]})"
        meaning = meaning.replace("|", "\\|")
        kind = _type_name(hints[field.name]).replace("|", "\\|")
        lines.append(f"| `{field.name}` | {kind} | `{_default(field)}` | {meaning} |")
    return "\n".join(lines) + "\n"


def write_config_docs(directory: str | Path) -> list[Path]:
    """Write every section's page into ``directory``; the paths written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, (group, cls) in config_sections().items():
        path = directory / f"{stem}.md"
        path.write_text(section_markdown(stem, group, cls))
        written.append(path)
    return written


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for written_path in write_config_docs(sys.argv[1] if len(sys.argv) > 1 else "docs/config"):
        logger.info("wrote %s", written_path)
