"""Atomic file writes: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import json
import os


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` so that readers see the old file or the new one, never half of one."""
    temporary = f"{path}.tmp.{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(temporary, path)


def write_json_atomic(path: str, payload: dict) -> None:
    """Write JSON so that readers see the old file or the new one, never half of one."""
    write_text_atomic(path, json.dumps(payload, indent=2))
