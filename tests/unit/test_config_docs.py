"""`merak settings` documents every setting of every section, as the code defines it (merak.config.docs), and
docs/config.md names every section."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from merak.config.docs import config_sections, main

REPO = Path(__file__).resolve().parents[2]


def test_every_setting_is_printed_with_its_type_default_and_range(capsys):
    assert main([]) == 0
    text = capsys.readouterr().out
    for stem, (group, cls) in config_sections().items():
        assert f"# `{group}` settings: {stem.replace('_', ' ')}" in text
        for field in dataclasses.fields(cls):
            assert f"| `{field.name}` |" in text, field.name
            assert field.metadata.get("help"), f"{cls.__name__}.{field.name} has no help"
    assert "| `learning_rate` | float | `5e-05` |" in text and "must be a finite number >= 0" in text


def test_sections_are_chosen_by_name(capsys):
    assert main(["zero"]) == 0
    text = capsys.readouterr().out
    assert "`zero_stage`" in text and "`learning_rate`" not in text
    with pytest.raises(SystemExit) as exit_:
        main(["optimiser"])
    assert exit_.value.code == 2 and "no section optimiser" in capsys.readouterr().err


def test_the_settings_page_names_every_section():
    rows = [line.split("|")[1] for line in (REPO / "docs" / "config.md").read_text().splitlines()
            if line.startswith("| ")]
    named = {word.strip("() ") for row in rows for word in row.replace(",", " ").split()}
    assert set(config_sections()) <= named
