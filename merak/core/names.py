"""Module-name globs: how plans, split points and sequence-parallel regions name modules.

A pattern is matched against a module's qualified name (``transformer.h.3.attn``):
``*`` matches within one dotted part, ``**`` across parts, ``?`` one character
within a part.
"""

from __future__ import annotations

import re

_WILDCARDS = {"**": ".*", "*": "[^.]*", "?": "[^.]"}


def module_pattern(pattern: str) -> re.Pattern:
    """Compile a module-name glob: ``*`` matches within one dotted part, ``**`` across parts;
    a leading ``**.`` also matches no prefix (``**.query`` matches ``query`` and ``a.b.query``)."""
    prefix = ""
    if pattern.startswith("**."):
        prefix, pattern = r"(?:.*\.)?", pattern[3:]
    parts = re.split(r"(\*\*|\*|\?)", pattern)
    return re.compile(prefix + "".join(_WILDCARDS.get(part, re.escape(part)) for part in parts))
