"""Graph sharding: where the unit sequence is cut into shards.

Every method returns sorted cut positions (unit indices at which a new shard
starts, never 0), so shard ``i`` holds units ``[cuts[i-1], cuts[i])``.

- ``min_bytes`` (the default): cut only where the fewest bytes cross. The
  positions are grouped by the bytes that cross them; the cheapest group whose
  positions still allow stages balanced within ``BALANCE_TOLERANCE`` of the
  best balance any positions allow is taken whole, and every one of its
  positions is a cut (the partition then picks the stage boundaries among
  them). In a transformer these are the block boundaries and the residual
  stream between attention and MLP: only the hidden state crosses. Needs the
  measured unit costs and value sizes (``merak.shard.costs``); ``shard_count``
  does not apply.

- ``farthest_min_deps``: a parameter budget of ``total / shard_count`` per
  shard; each shard grows as far as the budget allows (at least one unit), then
  is cut at the position in its range where the fewest values cross, the
  farthest such position on ties. Units larger than an even share (embeddings)
  count as one shard's budget each; the rest is spread over the other shards.
- ``nearest_min_deps``: the same budget, but a shard is closed only once the
  budget is reached, at the nearest following position where the fewest values
  cross within the next budget's reach.
- ``layer_split``: cut before each module whose qualified name matches one of
  the split points (globs, e.g. ``transformer.h.*``); recipes
  supply defaults (every transformer block), users ``custom_split_points``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from merak.core.names import module_pattern
from merak.shard.graph import GraphUnits

SPLIT_METHODS = ("min_bytes", "farthest_min_deps", "nearest_min_deps", "layer_split")
# A cut carrying more bytes is taken only when it balances stages better than this (relative bottleneck).
BALANCE_TOLERANCE = 0.15  # about the error of the cost estimate: closer plans are not told apart


class ShardingError(ValueError):
    """The graph cannot be sharded as asked; the message says what to change."""


def _budget(units: GraphUnits, shard_count: int) -> float:
    """Parameters per shard. Units bigger than an even share (embeddings) take one shard each and
    the rest of the parameters are spread over the remaining shards."""
    if shard_count < 1:
        raise ShardingError(f"shard_count={shard_count} must be a positive integer")
    weights = _weights(units)
    total = sum(weights)
    big = [w for w in weights if w > total / shard_count]
    if big and len(big) < shard_count:
        return (total - sum(big)) / (shard_count - len(big))
    return total / shard_count


def _weights(units: GraphUnits) -> list[float]:
    # Parameter-free graphs fall back to counting units, so every method still makes progress.
    return [float(p) for p in units.unit_params] if sum(units.unit_params) else [1.0] * len(units)


def farthest_min_deps(units: GraphUnits, shard_count: int) -> list[int]:
    """Budget-bounded shards, each cut at its farthest fewest-crossing position."""
    budget, weights, crossing = _budget(units, shard_count), _weights(units), units.crossing_counts()
    cuts: list[int] = []
    start, n = 0, len(units)
    while start < n:
        end, used = start + 1, weights[start]  # end is exclusive
        while end < n and (used + weights[end] <= budget or used == 0):  # no parameter-free shards
            used += weights[end]
            end += 1
        if end >= n:
            break
        # Positions start+1 .. end are possible cuts; pick min crossing, farthest on ties.
        best = min(range(start + 1, end + 1), key=lambda k: (crossing[k], -k))
        cuts.append(best)
        start = best
    return cuts


def nearest_min_deps(units: GraphUnits, shard_count: int) -> list[int]:
    """Shards closed after the budget is reached, at the nearest fewest-crossing position."""
    budget, weights, crossing = _budget(units, shard_count), _weights(units), units.crossing_counts()
    cuts: list[int] = []
    start, n = 0, len(units)
    while start < n:
        reach, used = start, 0.0
        while reach < n and used < budget:
            used += weights[reach]
            reach += 1
        if reach >= n:
            break
        horizon, ahead = reach, 0.0  # look at most one more budget ahead
        while horizon < n and ahead < budget:
            ahead += weights[horizon]
            horizon += 1
        best = min(range(reach, min(horizon, n - 1) + 1), key=lambda k: (crossing[k], k))
        cuts.append(best)
        start = best
    return cuts


def _bottleneck(unit_costs: Sequence[float], positions: Sequence[int], num_stages: int) -> float:
    """Smallest largest-stage cost over partitions cut only at ``positions`` (inf if too few)."""
    bounds = [0, *positions, len(unit_costs)]
    segments = [sum(unit_costs[a:b]) for a, b in zip(bounds, bounds[1:])]
    if len(segments) < num_stages:
        return float("inf")

    def stages_needed(limit: float) -> int:
        stages, load = 1, 0.0
        for cost in segments:
            if load + cost > limit and load > 0:
                stages, load = stages + 1, cost
            else:
                load += cost
        return stages

    low, high = max(segments), sum(segments)
    for _ in range(60):  # bisection down to 1e-9 of the bound: far finer than the tolerance
        if high - low <= 1e-9 * high:
            break
        middle = (low + high) / 2
        if stages_needed(middle) <= num_stages:
            high = middle
        else:
            low = middle
    return high


def min_bytes(unit_costs: Sequence[float], cut_bytes: Sequence[int], num_stages: int,
              tolerance: float = BALANCE_TOLERANCE) -> list[int]:
    """Every position of the cheapest byte level that still balances ``num_stages`` stages.

    Args:
        unit_costs: each unit's forward + backward cost (any unit of time).
        cut_bytes: ``cut_bytes[k]``, bytes crossing a cut before unit ``k`` (index 0 unused).
        num_stages: pipeline stages (model chunks with interleaving) to be formed from the shards.
        tolerance: how much worse than the best balance of any cuts the cheap cuts may be.
    """
    count = len(unit_costs)
    if num_stages == 1:
        return []
    if count < num_stages:
        raise ShardingError(f"the graph has {count} units, fewer than the {num_stages} stages asked for")
    # No cut may leave a stage nothing to do (only the input ids, say): work before and after it.
    before = list(itertools.accumulate(unit_costs))
    positions = [k for k in range(1, count) if before[k - 1] > 0 and before[-1] - before[k - 1] > 0] \
        or list(range(1, count))
    best = _bottleneck(unit_costs, positions, num_stages)
    levels = sorted({cut_bytes[k] for k in positions})
    low, high = 0, len(levels) - 1  # the highest level allows every position, so it always balances
    while low < high:
        middle = (low + high) // 2
        allowed = [k for k in positions if cut_bytes[k] <= levels[middle]]
        if _bottleneck(unit_costs, allowed, num_stages) <= best * (1 + tolerance):
            high = middle
        else:
            low = middle + 1
    return [k for k in positions if cut_bytes[k] <= levels[low]]


def layer_split(units: GraphUnits, split_points: Sequence[str], module_names: Sequence[str]) -> list[int]:
    """Cut before every module whose qualified name matches a split point.

    Args:
        units: the graph's units.
        split_points: glob patterns over module names (``transformer.h.*``)
            or exact names.
        module_names: the model's module names in definition order.
    """
    if not split_points:
        raise ShardingError("layer_split needs split points: set custom_split_points (module names or globs "
                            "such as 'transformer.h.*'), or pick another split_method")
    first_unit: dict[str, int] = {}
    for index, unit in enumerate(units.units):
        for name in unit.scope:
            first_unit.setdefault(name, index)
    cuts: set[int] = set()
    for pattern in split_points:
        regex = module_pattern(pattern)
        matched = [name for name in module_names if regex.fullmatch(name)]
        if not matched:
            raise ShardingError(f"split point {pattern!r} matches no module; module names look like "
                                f"{list(module_names)[1:6]}")
        used = [first_unit[name] for name in matched if name in first_unit]
        if not used:
            raise ShardingError(f"split point {pattern!r} matches modules {matched[:3]} that the captured "
                                "graph never calls")
        cuts.update(k for k in used if k > 0)
    return sorted(cuts)


def split_units(units: GraphUnits, *, method: str, shard_count: int, split_points: Sequence[str] = (),
                module_names: Sequence[str] = (), unit_costs: Sequence[float] = (),
                cut_bytes: Sequence[int] = (), num_stages: int = 1) -> list[int]:
    """Cut positions for ``method`` (see the module docstring); ``min_bytes`` needs ``unit_costs``,
    ``cut_bytes`` and ``num_stages``."""
    if method == "min_bytes":
        return min_bytes(unit_costs, cut_bytes, num_stages)
    if method == "farthest_min_deps":
        return farthest_min_deps(units, shard_count)
    if method == "nearest_min_deps":
        return nearest_min_deps(units, shard_count)
    if method == "layer_split":
        return layer_split(units, split_points, module_names)
    raise ShardingError(f"split_method={method!r} is unknown; choose one of {', '.join(SPLIT_METHODS)}")
