"""docs/config/ documents every setting of every section, as the code defines it (merak.config.docs)."""

from __future__ import annotations

from pathlib import Path

from merak.config.docs import config_sections, section_markdown

DOCS = Path(__file__).resolve().parents[2] / "docs" / "config"


def test_each_section_page_is_current_and_short():
    for stem, (group, cls) in config_sections().items():
        page = DOCS / f"{stem}.md"
        assert page.exists(), f"{page} is missing: python -m merak.config.docs"
        assert page.read_text() == section_markdown(stem, group, cls), \
            f"{page} is out of date: python -m merak.config.docs"
        assert len(page.read_text().splitlines()) < 150


def test_pages_name_every_field_with_its_range():
    text = (DOCS / "optimizer.md").read_text()
    assert "| `learning_rate` | float | `5e-05` |" in text and "must be a finite number >= 0" in text
