"""AutoPipe: balance pipeline stages by forward and backward cost, scored by a 1F1B simulation.

The search starts from the exact min-max partition of the per-shard cost
``f + b`` and then moves single shards off the critical stage while the
simulated 1F1B iteration time strictly improves.

``merak/shard/_autopipe.cpp`` implements the same algorithm with the same
floating-point operations in the same order (only additions, comparisons and
``max`` on doubles, so no fused multiply-add can creep in); both return
identical boundaries and identical simulated times. :func:`autopipe_boundaries`
uses the compiled module when it imports and falls back to Python otherwise.
"""

from __future__ import annotations

import itertools
import logging
import math
import numbers
from collections.abc import Sequence

from merak.core.partition import PartitionError, check_counts

logger = logging.getLogger(__name__)

try:
    from merak.shard import _autopipe as _native
except ImportError:  # not built: the pure-Python search below gives the same answers
    _native = None


def native_available() -> bool:
    """Whether the compiled ``merak.shard._autopipe`` module is in use."""
    return _native is not None


def _as_costs(name: str, values: Sequence[float]) -> list[float]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise PartitionError(f"{name} must be a list of numbers, got {values!r}")
    costs = []
    for index, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise PartitionError(f"{name}[{index}] must be a real number, got {value!r}")
        value = float(value)
        if not math.isfinite(value) or value < 0:
            raise PartitionError(f"{name}[{index}] must be finite and non-negative, got {value!r}")
        costs.append(value)
    return costs


def _as_microbatches(num_microbatches: int) -> int:
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, numbers.Integral):
        raise PartitionError(f"num_microbatches must be an integer, got {num_microbatches!r}")
    if num_microbatches < 1:
        raise PartitionError(f"num_microbatches must be at least 1, got {num_microbatches}")
    return int(num_microbatches)


def _checked(forward_costs, backward_costs, num_parts, num_microbatches):
    forward = _as_costs("forward_costs", forward_costs)
    backward = _as_costs("backward_costs", backward_costs)
    if len(forward) != len(backward):
        raise PartitionError(
            f"forward_costs and backward_costs differ in length: {len(forward)} vs {len(backward)}")
    check_counts(len(forward), num_parts)
    if num_microbatches is None:
        num_microbatches = 2 * num_parts
    return forward, backward, int(num_parts), _as_microbatches(num_microbatches)


def _simulate(stage_forward: list[float], stage_backward: list[float], num_microbatches: int) -> float:
    num_stages = len(stage_forward)
    # Op order per stage: min(S - s, M) forwards, then alternate backward and
    # forward, then the remaining backwards. This is Megatron's 1F1B (S - s - 1
    # warm-up forwards, then forward-backward pairs) written with the first
    # steady forward counted as warm-up. An op is (is_backward, microbatch).
    orders = []
    for stage in range(num_stages):
        warmup = min(num_stages - stage, num_microbatches)
        order = [(False, m) for m in range(warmup)]
        for m in range(num_microbatches):
            order.append((True, m))
            if warmup + m < num_microbatches:
                order.append((False, warmup + m))
        orders.append(order)
    forward_end = [[-1.0] * num_microbatches for _ in range(num_stages)]
    backward_end = [[-1.0] * num_microbatches for _ in range(num_stages)]
    next_op = [0] * num_stages
    stage_free = [0.0] * num_stages
    remaining = 2 * num_stages * num_microbatches
    # Sweep the stages, running every op whose dependency has finished. An op's
    # end time depends only on its two predecessors, so the sweep order cannot
    # change the result.
    while remaining:
        progressed = False
        for stage in range(num_stages):
            order = orders[stage]
            while next_op[stage] < len(order):
                is_backward, m = order[next_op[stage]]
                if is_backward:
                    ready = forward_end[stage][m] if stage == num_stages - 1 else backward_end[stage + 1][m]
                else:
                    ready = 0.0 if stage == 0 else forward_end[stage - 1][m]
                if ready < 0.0:
                    break
                start = max(ready, stage_free[stage])
                if is_backward:
                    stage_free[stage] = start + stage_backward[stage]
                    backward_end[stage][m] = stage_free[stage]
                else:
                    stage_free[stage] = start + stage_forward[stage]
                    forward_end[stage][m] = stage_free[stage]
                next_op[stage] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen for 1F1B; guards against an endless loop
            raise RuntimeError("1F1B simulation deadlocked")
    return max(stage_free)


def simulate_1f1b(stage_forward: Sequence[float], stage_backward: Sequence[float],
                  num_microbatches: int) -> float:
    """Time of one non-interleaved 1F1B iteration, ignoring communication.

    ``stage_forward[s]`` and ``stage_backward[s]`` are stage ``s``'s cost for
    one microbatch. Stage ``s`` runs ``min(S - s, M)`` forwards, then
    alternates backward and forward, then finishes the backwards. ``F(s, m)``
    starts once ``F(s-1, m)`` and the stage's previous op are done; ``B(s, m)``
    once ``B(s+1, m)`` (``F(S-1, m)`` on the last stage) and the previous op
    are done. Returns the time the last op ends.
    """
    forward = _as_costs("stage_forward", stage_forward)
    backward = _as_costs("stage_backward", stage_backward)
    if not forward or len(forward) != len(backward):
        raise PartitionError(
            f"need the same non-zero number of stage costs, got {len(forward)} and {len(backward)}")
    return _simulate(forward, backward, _as_microbatches(num_microbatches))


def _stage_sums(costs: list[float], boundaries: list[int]) -> list[float]:
    sums = []
    for start, end in itertools.pairwise(boundaries):
        total = 0.0
        for index in range(start, end):  # left to right, as the C++ loop does
            total += costs[index]
        sums.append(total)
    return sums


def _min_max_start(costs: list[float], num_parts: int) -> list[int]:
    """Exact min-max partition of ``costs`` (left-to-right double sums), back-loaded.

    The bottleneck is one of the contiguous-range sums: the smallest for which a greedy fill of the
    reversed list needs at most ``num_parts`` parts. It is found without listing the n^2 sums: bisect
    the real line down to two adjacent doubles, the upper one feasible; the greedy fill at that bound
    has its largest part equal to the smallest feasible sum (no sum lies strictly between the bounds).
    The partition is built by filling the reversed list from the front (each part as full as the
    bottleneck allows, one item left for every later part) and mirroring, so the later stages take as
    much as they can, as in :func:`merak.core.partition.parameter_boundaries`.
    """
    num_items = len(costs)
    reversed_costs = costs[::-1]

    def greedy(bound: float) -> tuple[int, float]:
        """(parts needed, largest part) when every part holds as much as ``bound`` allows."""
        parts, load, largest = 1, 0.0, 0.0
        for cost in reversed_costs:
            if cost > bound:
                return num_items + 1, math.inf
            if load + cost > bound:
                largest = max(largest, load)
                parts, load = parts + 1, 0.0 + cost
            else:
                load += cost
        return parts, max(largest, load)

    low, high = 0.0, sum(reversed_costs)  # the total (one part) is a range sum; fewer parts never need more
    if greedy(low)[0] <= num_parts:
        high = low
    while True:
        middle = low + (high - low) / 2
        if middle <= low or middle >= high:
            break
        if greedy(middle)[0] <= num_parts:
            high = middle
        else:
            low = middle
    bottleneck = greedy(high)[1]
    mirrored = [0]
    for part in range(num_parts - 1):
        end, load = mirrored[-1], 0.0
        last_end = num_items - (num_parts - 1 - part)
        while end < last_end and (end == mirrored[-1] or load + reversed_costs[end] <= bottleneck):
            load += reversed_costs[end]
            end += 1
        mirrored.append(end)
    mirrored.append(num_items)
    return [num_items - b for b in reversed(mirrored)]


def _score(forward: list[float], backward: list[float], boundaries: list[int],
           num_microbatches: int) -> float:
    return _simulate(_stage_sums(forward, boundaries), _stage_sums(backward, boundaries),
                     num_microbatches)


def _compiled_score(forward: list[float], backward: list[float], boundaries: list[int],
                    num_microbatches: int) -> float:
    """:func:`_score` on the compiled simulation when it is built: the same time, and a planner prices
    thousands of partitions of models with a thousand shards and as many microbatches."""
    if _native is None:
        return _score(forward, backward, boundaries, num_microbatches)
    return _native.simulate_1f1b(_stage_sums(forward, boundaries), _stage_sums(backward, boundaries),
                                 num_microbatches)


def python_autopipe_boundaries(forward_costs: Sequence[float], backward_costs: Sequence[float],
                               num_parts: int, num_microbatches: int | None = None) -> list[int]:
    """Pure-Python AutoPipe; see :func:`autopipe_boundaries` for the algorithm."""
    forward, backward, num_parts, num_microbatches = _checked(
        forward_costs, backward_costs, num_parts, num_microbatches)
    combined = [f + b for f, b in zip(forward, backward)]
    boundaries = _min_max_start(combined, num_parts)
    best = _score(forward, backward, boundaries, num_microbatches)
    # Every accepted move strictly lowers the time, so the search cannot cycle;
    # the cap only bounds the work on adversarial inputs.
    for _ in range(len(forward) * num_parts):
        stage_forward = _stage_sums(forward, boundaries)
        stage_backward = _stage_sums(backward, boundaries)
        critical = 0
        for stage in range(1, num_parts):  # strict '>' keeps the earliest stage on ties
            if (stage_forward[stage] + stage_backward[stage]
                    > stage_forward[critical] + stage_backward[critical]):
                critical = stage
        if boundaries[critical + 1] - boundaries[critical] < 2:
            break  # a single shard cannot move without emptying its stage
        candidates = []
        if critical > 0:  # first shard to the previous stage
            moved = list(boundaries)
            moved[critical] += 1
            candidates.append(moved)
        if critical < num_parts - 1:  # last shard to the next stage
            moved = list(boundaries)
            moved[critical + 1] -= 1
            candidates.append(moved)
        improved = None
        for candidate in candidates:  # strict '<' keeps the earlier candidate on ties
            time = _score(forward, backward, candidate, num_microbatches)
            if time < best:
                best, improved = time, candidate
        if improved is None:
            break
        boundaries = improved
    logger.debug("autopipe: boundaries %s, simulated 1F1B time %r", boundaries, best)
    return boundaries


def autopipe_boundaries(forward_costs: Sequence[float], backward_costs: Sequence[float],
                        num_parts: int, num_microbatches: int | None = None) -> list[int]:
    """Stage boundaries balancing per-shard forward and backward costs for 1F1B.

    ``forward_costs[i]`` and ``backward_costs[i]`` are shard ``i``'s cost for
    one microbatch; ``num_microbatches`` defaults to ``2 * num_parts``.

    1. Start from the exact min-max partition of ``f + b`` (back-loaded among
       the optimal ones, see :func:`_min_max_start`).
    2. The critical stage is the one with the largest summed ``f + b``
       (the earliest on ties). Try moving its first shard to the previous
       stage, then its last shard to the next stage, never emptying a stage.
    3. Score both with :func:`simulate_1f1b`; take the better one (the first
       tried on ties) if it is strictly faster than the current partition,
       and go back to 2. Stop when neither helps, or after
       ``num_shards * num_parts`` moves.

    The simulated time of the result is never above that of the start. Uses
    the compiled module when available; the answer is the same either way.
    """
    forward, backward, num_parts, num_microbatches = _checked(
        forward_costs, backward_costs, num_parts, num_microbatches)
    if _native is None:
        return python_autopipe_boundaries(forward, backward, num_parts, num_microbatches)
    return list(_native.autopipe_boundaries(forward, backward, num_parts, num_microbatches))



def _even_partition(costs: list[float], num_parts: int) -> list[int]:
    """Lexicographic min-max: the min-max partition, then the parts on each side of its largest
    part partitioned the same way among themselves, recursively."""
    boundaries = _min_max_start(costs, num_parts)
    sums = _stage_sums(costs, boundaries)
    largest = max(range(num_parts), key=lambda part: (sums[part], -part))
    first, last = boundaries[largest], boundaries[largest + 1]
    if largest >= 2:
        boundaries[:largest + 1] = _even_partition(costs[:first], largest)
    after = num_parts - largest - 1
    if after >= 2:
        boundaries[largest + 1:] = [last + b for b in _even_partition(costs[last:], after)]
    return boundaries


def balance_other_stages(forward_costs: Sequence[float], backward_costs: Sequence[float], boundaries: Sequence[int],
                         num_microbatches: int) -> list[int]:
    """Even out the stages before and after the critical one, keeping the critical stage as it is.

    When one stage dominates (a large LM head), every partition of the others is as fast by the
    bottleneck, and the min-max start leaves the earliest stages nearly empty. The stages on each
    side of the critical one are partitioned among themselves, most even first (:func:`_even_partition`);
    the result is kept only if its simulated 1F1B time is not longer.
    """
    forward = _as_costs("forward_costs", forward_costs)
    backward = _as_costs("backward_costs", backward_costs)
    boundaries = list(boundaries)
    combined = [f + b for f, b in zip(forward, backward)]
    sums = _stage_sums(combined, boundaries)
    critical = max(range(len(sums)), key=lambda s: (sums[s], -s))
    balanced = list(boundaries)
    first, last = boundaries[critical], boundaries[critical + 1]
    if critical >= 2:
        balanced[:critical + 1] = _even_partition(combined[:first], critical)
    after = len(sums) - critical - 1
    if after >= 2:
        balanced[critical + 1:] = [last + b for b in _even_partition(combined[last:], after)]
    num_microbatches = _as_microbatches(num_microbatches)
    if _compiled_score(forward, backward, balanced, num_microbatches) \
            <= _compiled_score(forward, backward, boundaries, num_microbatches):
        return balanced
    return boundaries


# A cheaper stage boundary may cost this much simulated step time (which does not count sends).
CHEAPER_SEND_TOLERANCE = 0.05


def cheapen_boundaries(forward_costs: Sequence[float], backward_costs: Sequence[float],
                       send_bytes: Sequence[int], boundaries: Sequence[int], num_microbatches: int,
                       tolerance: float = CHEAPER_SEND_TOLERANCE) -> list[int]:
    """Move each stage boundary to the shard boundary between its neighbours that sends the fewest bytes,
    as long as the simulated 1F1B time grows by at most ``tolerance`` over the plan's and neither
    neighbouring stage is left without work.

    ``send_bytes[i]``: what a stage boundary after shard ``i`` sends. Costs are per shard, as for
    :func:`autopipe_boundaries`. A search over shards cut at one byte level (``min_bytes``) can
    still place a boundary at a dearer position of that level than a nearby one needs.
    """
    forward = _as_costs("forward_costs", forward_costs)
    backward = _as_costs("backward_costs", backward_costs)
    num_microbatches = _as_microbatches(num_microbatches)
    boundaries = list(boundaries)
    combined = [f + b for f, b in zip(forward, backward)]
    limit = _compiled_score(forward, backward, boundaries, num_microbatches) * (1 + tolerance)
    for stage in range(1, len(boundaries) - 1):
        best = boundaries[stage]
        for position in range(boundaries[stage - 1] + 1, boundaries[stage + 1]):
            if send_bytes[position - 1] >= send_bytes[best - 1]:
                continue
            moved = boundaries[:stage] + [position] + boundaries[stage + 1:]
            sums = _stage_sums(combined, moved[stage - 1:stage + 2])
            if min(sums) > 0 and _compiled_score(forward, backward, moved, num_microbatches) <= limit:
                best = position
        boundaries[stage] = best
    return boundaries
