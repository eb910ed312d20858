"""Stage partition methods (uniform, uniform_floor, parameters, custom, AutoPipe),
stages_from_blocks and tied-parameter detection."""

from __future__ import annotations

import itertools
import random
from fractions import Fraction

import pytest
import torch
from torch import nn

from merak.core.partition import (
    PartitionError,
    check_custom_boundaries,
    parameter_boundaries,
    uniform_boundaries,
    uniform_floor_boundaries,
)
from merak.pipeline.stage import (
    StageModule,
    TiedParameter,
    find_tied_parameters,
    stages_from_blocks,
)
from merak.shard import autopipe
from merak.shard.autopipe import (
    autopipe_boundaries,
    native_available,
    python_autopipe_boundaries,
    simulate_1f1b,
)


@pytest.mark.parametrize("num_items,num_parts,expected", [
    (4, 4, [0, 1, 2, 3, 4]),
    (5, 1, [0, 5]),
    (7, 3, [0, 2, 4, 7]),
    (10, 4, [0, 2, 4, 7, 10]),
    (12, 4, [0, 3, 6, 9, 12]),
    (5, 4, [0, 1, 2, 3, 5]),
    (11, 4, [0, 2, 5, 8, 11]),
])
def test_uniform_boundaries_exact(num_items, num_parts, expected):
    assert uniform_boundaries(num_items, num_parts) == expected


@pytest.mark.parametrize("num_parts", range(1, 9))
@pytest.mark.parametrize("num_items", range(1, 30))
def test_uniform_boundaries_properties(num_items, num_parts):
    if num_items < num_parts:
        with pytest.raises(ValueError, match="non-empty parts"):
            uniform_boundaries(num_items, num_parts)
        return
    bounds = uniform_boundaries(num_items, num_parts)
    assert len(bounds) == num_parts + 1
    assert bounds[0] == 0
    assert bounds[-1] == num_items
    sizes = [b - a for a, b in itertools.pairwise(bounds)]
    assert all(s >= 1 for s in sizes)  # strictly increasing boundaries
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes)  # the extra items go to the later parts
    assert sizes.count(num_items // num_parts + 1) == num_items % num_parts


def test_uniform_boundaries_errors():
    with pytest.raises(PartitionError):
        uniform_boundaries(3, 4)
    with pytest.raises(ValueError, match="cannot split 3 items into 4 non-empty parts"):
        uniform_boundaries(3, 4)
    with pytest.raises(ValueError, match="cannot split into 0 parts"):
        uniform_boundaries(5, 0)
    with pytest.raises(ValueError, match="cannot split into -1 parts"):
        uniform_boundaries(5, -1)
    with pytest.raises(ValueError, match="cannot split 0 items"):
        uniform_boundaries(0, 1)


class Embed(nn.Module):
    def __init__(self, shared: nn.Embedding) -> None:
        super().__init__()
        self.wte = shared

    def forward(self, batch):
        return self.wte(batch["input_ids"])


class Head(nn.Module):
    def __init__(self, shared: nn.Embedding, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, shared.num_embeddings, bias=False)
        self.proj.weight = shared.weight  # tied by identity

    def forward(self, hidden):
        return self.proj(self.norm(hidden))


class TinyLM(nn.Module):
    """embedding -> blocks -> head with the head weight tied to the embedding."""

    def __init__(self, vocab: int = 11, width: int = 6, depth: int = 5) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.embed = Embed(self.wte)
        self.head = Head(self.wte, width)
        # same shape as the embedding weight, but a distinct parameter: never "tied"
        self.lookalike = nn.Parameter(torch.randn(vocab, width))

    def forward(self, batch):
        hidden = self.embed(batch)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


def test_stages_from_blocks_layout():
    model = TinyLM(depth=5)
    stages = stages_from_blocks(model.embed, list(model.blocks), model.head, 3)
    assert len(stages) == 3
    assert all(isinstance(s, StageModule) for s in stages)
    # 5 blocks over 3 stages -> 1, 2, 2 ; embed first, head last
    assert [len(s.parts) for s in stages] == [2, 2, 3]
    assert stages[0].parts[0] is model.embed
    assert stages[0].parts[1] is model.blocks[0]
    assert list(stages[1].parts) == [model.blocks[1], model.blocks[2]]
    assert list(stages[2].parts)[:2] == [model.blocks[3], model.blocks[4]]
    assert stages[2].parts[-1] is model.head


def test_single_stage_holds_everything():
    model = TinyLM(depth=2)
    (stage,) = stages_from_blocks(model.embed, list(model.blocks), model.head, 1)
    assert list(stage.parts) == [model.embed, model.blocks[0], model.blocks[1], model.head]
    assert find_tied_parameters(model, [stage]) == []


def test_stages_compose_to_the_full_model():
    torch.manual_seed(0)
    model = TinyLM(depth=4)
    stages = stages_from_blocks(model.embed, list(model.blocks), model.head, 2)
    batch = {"input_ids": torch.tensor([[1, 2, 3], [4, 5, 6]])}
    payload = batch
    for stage in stages:
        payload = stage(payload)
    assert torch.equal(payload, model(batch))
    assert payload.shape == (2, 3, 11)


def test_too_many_stages_for_blocks():
    model = TinyLM(depth=2)
    with pytest.raises(ValueError, match="cannot split 2 items into 3"):
        stages_from_blocks(model.embed, list(model.blocks), model.head, 3)


def test_find_tied_parameters_by_identity():
    model = TinyLM(depth=4)
    assert model.head.proj.weight is model.wte.weight
    stages = stages_from_blocks(model.embed, list(model.blocks), model.head, 2)
    tied = find_tied_parameters(model, stages)
    # the model's first name for the shared weight is "wte.weight"
    assert tied == [TiedParameter(name="wte.weight", stages=(0, 1))]


def test_tied_parameter_across_three_stages_and_middle_untouched():
    model = TinyLM(depth=3)
    stages = stages_from_blocks(model.embed, list(model.blocks), model.head, 3)
    tied = find_tied_parameters(model, stages)
    assert tied == [TiedParameter(name="wte.weight", stages=(0, 2))]


def test_same_shape_distinct_weight_is_not_tied():
    model = TinyLM(depth=2)
    # A head whose weight equals the embedding in shape and value but is another tensor.
    head = Head(nn.Embedding(11, 6), 6)
    with torch.no_grad():
        head.proj.weight.copy_(model.wte.weight)
    model.head = head
    stages = stages_from_blocks(model.embed, list(model.blocks), model.head, 2)
    assert head.proj.weight.shape == model.wte.weight.shape
    assert torch.equal(head.proj.weight, model.wte.weight)
    assert find_tied_parameters(model, stages) == []


def test_lookalike_parameter_in_two_stages_is_not_confused():
    model = TinyLM(depth=2)
    # put the same-shape lookalike into the last stage; only the real shared weight is tied
    carrier = nn.Module()
    carrier.weight = model.lookalike
    stages = stages_from_blocks(model.embed, list(model.blocks), nn.Sequential(model.head, carrier), 2)
    tied = find_tied_parameters(model, stages)
    assert [t.name for t in tied] == ["wte.weight"]
    assert tied[0].stages == (0, 1)


# ---------------------------------------------------------------- helpers

def assert_valid(bounds, num_items, num_parts):
    assert len(bounds) == num_parts + 1
    assert bounds[0] == 0 and bounds[-1] == num_items
    assert all(isinstance(b, int) for b in bounds)
    assert all(a < b for a, b in itertools.pairwise(bounds)), bounds


def all_boundaries(num_items, num_parts):
    for cuts in itertools.combinations(range(1, num_items), num_parts - 1):
        yield [0, *cuts, num_items]


def exact_bottleneck(weights, bounds):
    return max(sum(Fraction(w) for w in weights[a:b]) for a, b in itertools.pairwise(bounds))


def stage_sums(costs, bounds):
    sums = []
    for a, b in itertools.pairwise(bounds):
        total = 0.0
        for cost in costs[a:b]:
            total += cost
        sums.append(total)
    return sums


def simulated(forward, backward, bounds, num_microbatches):
    return simulate_1f1b(stage_sums(forward, bounds), stage_sums(backward, bounds), num_microbatches)


def random_costs(rng, num_items):
    forward = [rng.choice([rng.random(), float(rng.randint(1, 9)), rng.uniform(0, 100)])
               for _ in range(num_items)]
    backward = [2 * f + rng.random() for f in forward]
    return forward, backward


SMALL = [(n, s) for n in range(1, 21) for s in range(1, n + 1)]


# ---------------------------------------------------------------- validity

@pytest.mark.parametrize("num_items,num_parts", SMALL)
def test_every_method_gives_valid_boundaries(num_items, num_parts):
    rng = random.Random(num_items * 100 + num_parts)
    weights = [rng.randint(0, 50) for _ in range(num_items)]
    forward, backward = random_costs(rng, num_items)
    assert_valid(uniform_boundaries(num_items, num_parts), num_items, num_parts)
    assert_valid(uniform_floor_boundaries(num_items, num_parts), num_items, num_parts)
    assert_valid(parameter_boundaries(weights, num_parts), num_items, num_parts)
    assert_valid(parameter_boundaries([0.0] * num_items, num_parts), num_items, num_parts)
    assert_valid(autopipe_boundaries(forward, backward, num_parts), num_items, num_parts)
    assert_valid(python_autopipe_boundaries(forward, backward, num_parts), num_items, num_parts)


@pytest.mark.parametrize("method", [uniform_boundaries, uniform_floor_boundaries,
                                    lambda n, s: parameter_boundaries([1] * n, s),
                                    lambda n, s: autopipe_boundaries([1.0] * n, [2.0] * n, s)])
def test_every_method_rejects_bad_counts(method):
    with pytest.raises(PartitionError, match="cannot split 3 items into 4 non-empty parts"):
        method(3, 4)
    with pytest.raises(PartitionError, match="cannot split into 0 parts"):
        method(3, 0)


def test_partition_error_is_a_value_error():
    assert issubclass(PartitionError, ValueError)
    with pytest.raises(PartitionError, match="num_parts must be an integer"):
        uniform_floor_boundaries(4, 2.0)


# ---------------------------------------------------------------- uniform_floor

@pytest.mark.parametrize("num_items,num_parts,expected", [
    (8, 4, [2, 2, 2, 2]),
    (9, 4, [2, 2, 3, 2]),    # centre 1.5: stages 1 and 2 tie, the later one wins
    (10, 4, [2, 3, 3, 2]),
    (11, 4, [2, 3, 3, 3]),   # stages 0 and 3 tie for the third extra: 3 wins
    (7, 3, [2, 3, 2]),
    (8, 3, [2, 3, 3]),
    (8, 5, [1, 2, 2, 2, 1]),
    (4, 4, [1, 1, 1, 1]),
    (5, 1, [5]),
])
def test_uniform_floor_exact(num_items, num_parts, expected):
    bounds = uniform_floor_boundaries(num_items, num_parts)
    assert [b - a for a, b in itertools.pairwise(bounds)] == expected


@pytest.mark.parametrize("num_items,num_parts", SMALL)
def test_uniform_floor_remainder_goes_to_the_middle(num_items, num_parts):
    bounds = uniform_floor_boundaries(num_items, num_parts)
    sizes = [b - a for a, b in itertools.pairwise(bounds)]
    base, extra = divmod(num_items, num_parts)
    larger = [s for s, size in enumerate(sizes) if size == base + 1]
    assert all(size in (base, base + 1) for size in sizes)
    assert len(larger) == extra
    # every stage holding an extra item is at least as near the centre as every other stage
    distance = [abs(2 * s - (num_parts - 1)) for s in range(num_parts)]
    others = [s for s in range(num_parts) if s not in larger]
    if larger and others:
        assert max(distance[s] for s in larger) <= min(distance[s] for s in others)
        assert larger == list(range(larger[0], larger[-1] + 1))  # one contiguous middle block


# ---------------------------------------------------------------- parameters

@pytest.mark.parametrize("kind", ["int", "float"])
def test_parameter_boundaries_match_brute_force(kind):
    rng = random.Random(7 if kind == "int" else 8)
    for _ in range(150):
        num_items = rng.randint(1, 9)
        num_parts = rng.randint(1, min(4, num_items))
        if kind == "int":
            weights = [rng.randint(0, 20) for _ in range(num_items)]
        else:
            weights = [rng.choice([rng.random(), rng.uniform(0, 1e6), 0.1, 0.2, 0.3])
                       for _ in range(num_items)]
        bounds = parameter_boundaries(weights, num_parts)
        assert_valid(bounds, num_items, num_parts)
        best = min(exact_bottleneck(weights, c) for c in all_boundaries(num_items, num_parts))
        assert exact_bottleneck(weights, bounds) == best, (weights, num_parts, bounds)
        # back-loaded: every boundary is as small as in any optimal partition
        for other in all_boundaries(num_items, num_parts):
            if exact_bottleneck(weights, other) == best:
                assert all(a <= b for a, b in zip(bounds, other)), (weights, bounds, other)


def test_parameter_boundaries_examples():
    assert parameter_boundaries([1, 2, 3, 4, 5, 6], 3) == [0, 3, 5, 6]   # 6, 9, 6
    assert parameter_boundaries([5, 1, 1, 1, 1, 1], 2) == [0, 1, 6]
    assert parameter_boundaries([1, 1, 1, 1], 2) == [0, 2, 4]
    assert parameter_boundaries([0, 0, 0, 7], 2) == [0, 1, 4]           # ties: the last stage takes 0, 0, 7
    # 0.1 + 0.2 != 0.3 in doubles; the exact arithmetic still sees a tie
    assert parameter_boundaries([0.1, 0.2, 0.3], 2) == [0, 2, 3]


def test_parameter_boundaries_rejects_bad_weights():
    with pytest.raises(PartitionError, match="weight 1 must be non-negative"):
        parameter_boundaries([1, -2, 3], 2)
    with pytest.raises(PartitionError, match="weight 0 must be finite"):
        parameter_boundaries([float("nan"), 1.0], 2)
    with pytest.raises(PartitionError, match="weight 2 must be a real number"):
        parameter_boundaries([1, 2, "3"], 2)
    with pytest.raises(PartitionError, match="weight 0 must be a real number"):
        parameter_boundaries([True, 2], 2)


# ---------------------------------------------------------------- custom

def test_custom_boundaries_accepted():
    assert check_custom_boundaries([0, 2, 5, 6], 6, 3) == [0, 2, 5, 6]
    assert check_custom_boundaries((0, 4), 4, 1) == [0, 4]


@pytest.mark.parametrize("boundaries,message", [
    ([0, 2, 6, 8], "custom_partition must have pp+1 = 5 entries, got 4"),
    ([0, 2, 4, 6, 8, 8], "custom_partition must have pp+1 = 5 entries, got 6"),
    ([1, 2, 4, 6, 8], "custom_partition must start at 0, got 1"),
    ([0, 2, 4, 6, 7], "custom_partition must end at the number of shards 8, got 7"),
    ([0, 2, 6, 6, 8], "custom_partition is not increasing at position 3: 6 then 6"),
    ([0, 6, 2, 7, 8], "custom_partition is not increasing at position 2: 6 then 2"),
    ([0, 2, 4.0, 6, 8], "custom_partition entry 2 must be an integer, got 4.0"),
    ("0,2,4,6,8", "custom_partition must be a list of integers"),
])
def test_custom_boundaries_errors(boundaries, message):
    with pytest.raises(PartitionError) as info:
        check_custom_boundaries(boundaries, 8, 4)
    assert str(info.value).startswith(message)


# ---------------------------------------------------------------- 1F1B simulation

def test_simulate_two_stages_by_hand():
    # f = [1, 3], b = [2, 4], M = 2. Stage 0 runs F0 F1 B0 B1, stage 1 runs F0 B0 F1 B1.
    #   s0 F0 0-1, F1 1-2
    #   s1 F0 1-4 (after s0 F0), B0 4-8, F1 8-11 (after B0), B1 11-15
    #   s0 B0 8-10 (after s1 B0), B1 15-17 (after s1 B1)          -> 17
    assert simulate_1f1b([1, 3], [2, 4], 2) == 17.0
    # one microbatch: everything is serial, 1 + 3 + 4 + 2
    assert simulate_1f1b([1, 3], [2, 4], 1) == 10.0


@pytest.mark.parametrize("num_stages", range(1, 7))
@pytest.mark.parametrize("num_microbatches", [1, 2, 3, 8])
def test_simulate_balanced_stages_have_the_textbook_bubble(num_stages, num_microbatches):
    # equal stages: (M + S - 1) (f + b), i.e. a bubble of (S - 1) (f + b)
    time = simulate_1f1b([1.0] * num_stages, [2.5] * num_stages, num_microbatches)
    assert time == (num_microbatches + num_stages - 1) * 3.5


def test_simulate_rejects_bad_input():
    with pytest.raises(PartitionError, match="same non-zero number"):
        simulate_1f1b([1.0], [1.0, 2.0], 2)
    with pytest.raises(PartitionError, match="num_microbatches must be at least 1"):
        simulate_1f1b([1.0], [1.0], 0)


# ---------------------------------------------------------------- AutoPipe

def test_autopipe_is_never_worse_than_its_start_and_not_below_the_optimum():
    rng = random.Random(11)
    improved = 0
    for _ in range(150):
        num_items = rng.randint(1, 9)
        num_parts = rng.randint(1, min(4, num_items))
        num_microbatches = rng.randint(1, 8)
        forward = [float(rng.randint(1, 9)) for _ in range(num_items)]
        backward = [float(rng.randint(1, 20)) for _ in range(num_items)]
        bounds = python_autopipe_boundaries(forward, backward, num_parts, num_microbatches)
        assert_valid(bounds, num_items, num_parts)
        start = autopipe._min_max_start([f + b for f, b in zip(forward, backward)], num_parts)
        combined = [f + b for f, b in zip(forward, backward)]
        assert exact_bottleneck(combined, start) == min(
            exact_bottleneck(combined, c) for c in all_boundaries(num_items, num_parts))
        time = simulated(forward, backward, bounds, num_microbatches)
        assert time <= simulated(forward, backward, start, num_microbatches)
        assert time >= min(simulated(forward, backward, c, num_microbatches)
                           for c in all_boundaries(num_items, num_parts))
        improved += time < simulated(forward, backward, start, num_microbatches)
    assert improved > 0  # the local search does more than return the start


def test_autopipe_moves_off_a_heavy_backward_stage():
    # Equal f + b per shard, but the last shards' work is mostly backward.
    forward = [3.0, 3.0, 3.0, 0.5, 0.5, 0.5]
    backward = [1.0, 1.0, 1.0, 3.5, 3.5, 3.5]
    bounds = python_autopipe_boundaries(forward, backward, 2, 4)
    assert_valid(bounds, 6, 2)
    assert simulated(forward, backward, bounds, 4) <= simulated(forward, backward, [0, 3, 6], 4)


def test_autopipe_default_microbatches_is_twice_the_stages():
    rng = random.Random(3)
    forward, backward = random_costs(rng, 12)
    assert python_autopipe_boundaries(forward, backward, 3) == \
        python_autopipe_boundaries(forward, backward, 3, 6)
    assert autopipe_boundaries(forward, backward, 3) == autopipe_boundaries(forward, backward, 3, 6)


def test_autopipe_rejects_bad_input():
    with pytest.raises(PartitionError, match="differ in length: 3 vs 2"):
        autopipe_boundaries([1.0, 1.0, 1.0], [1.0, 1.0], 2)
    with pytest.raises(PartitionError, match=r"backward_costs\[1\] must be finite and non-negative"):
        autopipe_boundaries([1.0, 1.0], [1.0, -1.0], 2)
    with pytest.raises(PartitionError, match="num_microbatches must be at least 1"):
        autopipe_boundaries([1.0, 1.0], [1.0, 1.0], 2, 0)


@pytest.mark.skipif(not native_available(),
                    reason="merak.shard._autopipe is not built (pip install -e . compiles it)")
def test_native_matches_python():
    from merak.shard import _autopipe

    rng = random.Random(2024)
    for case in range(200):
        num_items = rng.randint(1, 40)
        num_parts = rng.randint(1, min(8, num_items))
        num_microbatches = rng.randint(1, 16)
        forward, backward = random_costs(rng, num_items)
        if case % 5 == 0:  # many exact ties
            forward = [float(rng.randint(0, 3)) for _ in range(num_items)]
            backward = [float(rng.randint(0, 3)) for _ in range(num_items)]
        expected = python_autopipe_boundaries(forward, backward, num_parts, num_microbatches)
        got = list(_autopipe.autopipe_boundaries(forward, backward, num_parts, num_microbatches))
        assert got == expected, (case, forward, backward, num_parts, num_microbatches)
        assert autopipe_boundaries(forward, backward, num_parts, num_microbatches) == expected
        stage_forward, stage_backward = stage_sums(forward, got), stage_sums(backward, got)
        assert _autopipe.simulate_1f1b(stage_forward, stage_backward, num_microbatches) == \
            simulate_1f1b(stage_forward, stage_backward, num_microbatches)


def _smallest_feasible_range_sum(costs: list[float], num_parts: int) -> float:
    """The min-max bottleneck by listing every contiguous sum of the reversed costs (left to right, as the
    search sums them) and taking the smallest a greedy fill of ``num_parts`` parts can keep."""
    reversed_costs = costs[::-1]
    sums = sorted({sum(reversed_costs[start:end])
                   for start in range(len(costs)) for end in range(start + 1, len(costs) + 1)})

    def parts(bound: float) -> int:
        count, load = 1, 0.0
        for cost in reversed_costs:
            if cost > bound:
                return len(costs) + 1
            if load + cost > bound:
                count, load = count + 1, 0.0 + cost
            else:
                load += cost
        return count

    return next(s for s in sums if parts(s) <= num_parts)


def test_min_max_start_finds_the_smallest_feasible_range_sum_without_listing_them():
    rng = random.Random(7)
    for trial in range(400):
        count = rng.randint(1, 24)
        parts = rng.randint(1, count)
        kind = trial % 3
        costs = [rng.random() if kind == 0 else float(rng.randint(0, 4)) if kind == 1
                 else rng.random() * 10 ** rng.randint(-6, 6) for _ in range(count)]
        bounds = autopipe._min_max_start(costs, parts)
        assert bounds[0] == 0 and bounds[-1] == count and len(bounds) == parts + 1
        reversed_sums = [sum(costs[a:b][::-1]) for a, b in itertools.pairwise(bounds)]
        assert max(reversed_sums) == _smallest_feasible_range_sum(costs, parts)
