"""``merak settings [SECTION ...]``: the reference of every setting (type, default, range, meaning) printed
from the typed config sections themselves, so it is always the installed code's and no file has to be
kept in step with it (docs/config.md says where settings live)."""

from __future__ import annotations

import dataclasses
import sys
import typing


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
    """One section's reference: what it is, where it lives, and a table of its settings."""
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


def main(argv: list[str] | None = None, *, prog: str = "merak settings") -> int:
    """merak settings [SECTION ...]: print the reference of the named config sections (all by default)."""
    import argparse

    sections = config_sections()
    parser = argparse.ArgumentParser(prog=prog, description=main.__doc__)
    parser.add_argument("sections", nargs="*", metavar="SECTION", help=f"any of: {', '.join(sections)}")
    chosen = parser.parse_args(argv).sections or list(sections)
    unknown = [name for name in chosen if name not in sections]
    if unknown:
        parser.error(f"no section {', '.join(unknown)}; choose from {', '.join(sections)}")
    sys.stdout.write("\n".join(section_markdown(name, *sections[name]) for name in chosen))
    return 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m merak.config.docs"))
