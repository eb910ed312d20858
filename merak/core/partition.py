"""Stage partition: which consecutive items (blocks, shards) each stage gets.

Every function here returns ``num_parts + 1`` boundaries ``b`` with
``b[0] == 0``, ``b[-1] == num_items`` and ``b`` strictly increasing: stage
``i`` holds items ``[b[i], b[i+1])`` and no stage is empty.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence


class PartitionError(ValueError):
    """A partition request that cannot be met or whose inputs are malformed."""


def check_counts(num_items: int, num_parts: int) -> None:
    """Raise :class:`PartitionError` unless ``num_items`` can fill ``num_parts`` non-empty parts."""
    for name, value in (("num_items", num_items), ("num_parts", num_parts)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise PartitionError(f"{name} must be an integer, got {value!r}")
    if num_parts < 1:
        raise PartitionError(f"cannot split into {num_parts} parts")
    if num_items < num_parts:
        raise PartitionError(f"cannot split {num_items} items into {num_parts} non-empty parts")


def uniform_boundaries(num_items: int, num_parts: int) -> list[int]:
    """Split ``num_items`` into ``num_parts`` consecutive runs whose sizes differ by at most one.

    Returns ``num_parts + 1`` strictly increasing boundaries starting at 0 and
    ending at ``num_items``; part ``i`` holds items ``[b[i], b[i+1])``. The
    larger runs go to the later parts, where pipeline stages hold fewer
    in-flight activations.
    """
    check_counts(num_items, num_parts)
    base, extra = divmod(num_items, num_parts)
    boundaries = [0]
    for part in range(num_parts):
        boundaries.append(boundaries[-1] + base + (1 if part >= num_parts - extra else 0))
    return boundaries


def uniform_floor_boundaries(num_items: int, num_parts: int) -> list[int]:
    """Give every part ``num_items // num_parts`` items and the remainder to the middle parts.

    The ``r = num_items % num_parts`` leftover items go one each to the ``r``
    parts nearest the centre ``(num_parts - 1) / 2``. When two parts are
    equally near (one on each side of the centre), the later one is chosen
    first, for the same reason as in :func:`uniform_boundaries`: later
    pipeline stages hold fewer in-flight activations. For example 4 parts
    with remainder 1 give ``[b, b, b+1, b]`` and remainder 3 gives
    ``[b, b+1, b+1, b+1]``.
    """
    check_counts(num_items, num_parts)
    base, extra = divmod(num_items, num_parts)
    # Distance to the centre doubled, so it stays an integer; -part prefers the later part on ties.
    by_centre = sorted(range(num_parts), key=lambda part: (abs(2 * part - (num_parts - 1)), -part))
    larger = set(by_centre[:extra])
    boundaries = [0]
    for part in range(num_parts):
        boundaries.append(boundaries[-1] + base + (1 if part in larger else 0))
    return boundaries


def _exact_integers(weights: Sequence[float]) -> list[int]:
    """Scale non-negative finite weights to integers with the same ratios, exactly.

    Every float is ``p / 2**k``, so multiplying by the largest ``2**k`` turns
    all of them into Python integers. Stage sums then carry no rounding, do
    not depend on summation order, and the bottleneck found is the true one.
    """
    ratios = []
    for index, weight in enumerate(weights):
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
            raise PartitionError(f"weight {index} must be a real number, got {weight!r}")
        if isinstance(weight, numbers.Integral):
            ratio = (int(weight), 1)
        else:
            value = float(weight)
            if not math.isfinite(value):
                raise PartitionError(f"weight {index} must be finite, got {value!r}")
            ratio = value.as_integer_ratio()
        if ratio[0] < 0:
            raise PartitionError(f"weight {index} must be non-negative, got {weight!r}")
        ratios.append(ratio)
    scale = max((den for _, den in ratios), default=1)
    return [num * (scale // den) for num, den in ratios]


def _parts_needed(weights: list[int], bottleneck: int) -> int:
    """Fewest consecutive parts whose sums are all <= ``bottleneck`` (greedy, which is optimal)."""
    parts, load = 1, 0
    for weight in weights:
        if weight > bottleneck:
            return len(weights) + 1
        if load + weight > bottleneck:
            parts, load = parts + 1, weight
        else:
            load += weight
    return parts


def _front_filled(weights: list[int], num_parts: int, bottleneck: int) -> list[int]:
    """Boundaries where each part, first to last, takes as many items as fit under ``bottleneck``.

    Each part stops early enough to leave one item for every later part. If any
    partition meets ``bottleneck``, this one does and every boundary is as
    large as it can be among those partitions (by induction: starting no
    earlier than any other, a part can extend at least as far).
    """
    num_items = len(weights)
    boundaries = [0]
    for part in range(num_parts - 1):
        end, load = boundaries[-1], 0
        last_end = num_items - (num_parts - 1 - part)
        while end < last_end and (end == boundaries[-1] or load + weights[end] <= bottleneck):
            load += weights[end]
            end += 1
        boundaries.append(end)
    boundaries.append(num_items)
    return boundaries


def parameter_boundaries(weights: Sequence[float], num_parts: int) -> list[int]:
    """Partition minimising the largest part sum of ``weights`` (e.g. parameter counts per shard).

    Exact for integers and floats alike (floats are scaled to integers without
    rounding, see :func:`_exact_integers`); the minimal bottleneck is found by
    binary search with a greedy feasibility check. Among the optimal
    partitions the one returned is back-loaded: the last part takes as many
    items as it can, then the one before it, and so on, so that the earlier
    pipeline stages, which hold more in-flight activations, get the least.
    Equivalently its boundaries are the lexicographically smallest optimal ones.
    """
    check_counts(len(weights), num_parts)
    exact = _exact_integers(weights)
    # Fill from the back by filling the reversed list from the front, then mirror.
    reversed_weights = exact[::-1]
    low, high = max(exact), sum(exact)
    while low < high:
        middle = (low + high) // 2
        if _parts_needed(reversed_weights, middle) <= num_parts:
            high = middle
        else:
            low = middle + 1
    mirrored = _front_filled(reversed_weights, num_parts, low)
    return [len(exact) - b for b in reversed(mirrored)]


def custom_boundary_problem(boundaries, num_parts: int, num_items: int | None = None) -> str | None:
    """What is wrong with a user-given ``custom_partition``, or None.

    It must have ``num_parts + 1`` integer entries, start at 0, be strictly
    increasing (no empty stage) and, when ``num_items`` is known, end there.
    The message names the first broken rule and where.
    """
    if isinstance(boundaries, (str, bytes)) or not isinstance(boundaries, Sequence):
        return f"custom_partition must be a list of integers, got {boundaries!r}"
    if len(boundaries) != num_parts + 1:
        return f"custom_partition must have pp+1 = {num_parts + 1} entries, got {len(boundaries)}"
    for position, value in enumerate(boundaries):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            return f"custom_partition entry {position} must be an integer, got {value!r}"
    if boundaries[0] != 0:
        return f"custom_partition must start at 0, got {boundaries[0]}"
    if num_items is not None and boundaries[-1] != num_items:
        return f"custom_partition must end at the number of shards {num_items}, got {boundaries[-1]}"
    for position in range(1, len(boundaries)):
        if boundaries[position] <= boundaries[position - 1]:
            return (f"custom_partition is not increasing at position {position}: "
                    f"{boundaries[position - 1]} then {boundaries[position]}")
    return None


def check_custom_boundaries(boundaries: Sequence[int], num_items: int, num_parts: int) -> list[int]:
    """Validate a user-given ``custom_partition`` against ``num_items`` shards and return it as ints.

    Raises :class:`PartitionError` with :func:`custom_boundary_problem`'s message.
    """
    check_counts(num_items, num_parts)
    problem = custom_boundary_problem(boundaries, num_parts, num_items)
    if problem:
        raise PartitionError(problem)
    return [int(value) for value in boundaries]
