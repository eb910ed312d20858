"""Stage partition: which consecutive items (blocks, shards) each stage gets."""

from __future__ import annotations


def uniform_boundaries(num_items: int, num_parts: int) -> list[int]:
    """Split ``num_items`` into ``num_parts`` consecutive runs whose sizes differ by at most one.

    Returns ``num_parts + 1`` non-decreasing boundaries starting at 0 and ending
    at ``num_items``; part ``i`` holds items ``[b[i], b[i+1])``. The larger
    runs go to the later parts, where pipeline stages hold fewer in-flight
    activations.
    """
    if num_parts < 1:
        raise ValueError(f"cannot split into {num_parts} parts")
    if num_items < num_parts:
        raise ValueError(f"cannot split {num_items} items into {num_parts} non-empty parts")
    base, extra = divmod(num_items, num_parts)
    boundaries = [0]
    for part in range(num_parts):
        boundaries.append(boundaries[-1] + base + (1 if part >= num_parts - extra else 0))
    return boundaries
