"""RankGrid: rank <-> coordinates arithmetic and the process-group rank lists."""

from __future__ import annotations

import itertools

import pytest

from merak.distributed.topology import Coordinates, RankGrid

GRIDS = [
    (1, 1, 1),
    (2, 1, 1),
    (1, 1, 4),
    (2, 2, 2),
    (3, 1, 2),
    (2, 3, 4),
    (4, 2, 1),
]


@pytest.mark.parametrize("dp,tp,pp", GRIDS)
def test_rank_formula_and_round_trip(dp, tp, pp):
    grid = RankGrid(dp=dp, tp=tp, pp=pp)
    assert grid.world_size == dp * tp * pp
    seen = []
    for p, d, t in itertools.product(range(pp), range(dp), range(tp)):
        rank = grid.rank_of(pp=p, dp=d, tp=t)
        assert rank == (p * dp + d) * tp + t
        assert grid.coordinates(rank) == Coordinates(pp=p, dp=d, tp=t)
        seen.append(rank)
    # tp fastest, pp slowest: iterating (pp, dp, tp) lexicographically enumerates 0..N-1 in order.
    assert seen == list(range(dp * tp * pp))
    for rank in range(grid.world_size):
        c = grid.coordinates(rank)
        assert grid.rank_of(pp=c.pp, dp=c.dp, tp=c.tp) == rank


def test_coordinates_examples():
    grid = RankGrid(dp=2, tp=3, pp=4)
    assert grid.coordinates(0) == Coordinates(pp=0, dp=0, tp=0)
    assert grid.coordinates(1) == Coordinates(pp=0, dp=0, tp=1)
    assert grid.coordinates(3) == Coordinates(pp=0, dp=1, tp=0)
    assert grid.coordinates(6) == Coordinates(pp=1, dp=0, tp=0)
    assert grid.coordinates(23) == Coordinates(pp=3, dp=1, tp=2)
    assert grid.rank_of(pp=2, dp=1, tp=1) == 16


def test_out_of_range_rank_and_coordinates():
    grid = RankGrid(dp=2, tp=2, pp=2)
    with pytest.raises(ValueError, match="rank 8 outside 0..7"):
        grid.coordinates(8)
    with pytest.raises(ValueError, match="rank -1 outside"):
        grid.coordinates(-1)
    with pytest.raises(ValueError, match="pp coordinate 2 outside 0..1"):
        grid.rank_of(pp=2, dp=0, tp=0)
    with pytest.raises(ValueError, match="tp coordinate -1"):
        grid.rank_of(pp=0, dp=0, tp=-1)
    with pytest.raises(ValueError, match="unknown axis"):
        grid.size("xp")


def test_axis_groups_dp2_tp2_pp2():
    grid = RankGrid(dp=2, tp=2, pp=2)
    assert grid.axis_groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.axis_groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.axis_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_axis_groups_dp3_pp2():
    grid = RankGrid(dp=3, tp=1, pp=2)
    assert grid.axis_groups("pp") == [[0, 3], [1, 4], [2, 5]]
    assert grid.axis_groups("dp") == [[0, 1, 2], [3, 4, 5]]
    assert grid.axis_groups("tp") == [[0], [1], [2], [3], [4], [5]]


@pytest.mark.parametrize("dp,tp,pp", GRIDS)
@pytest.mark.parametrize("axis", ["pp", "dp", "tp"])
def test_axis_groups_partition_the_world(dp, tp, pp, axis):
    grid = RankGrid(dp=dp, tp=tp, pp=pp)
    groups = grid.axis_groups(axis)
    assert len(groups) == grid.world_size // grid.size(axis)
    assert sorted(r for g in groups for r in g) == list(range(grid.world_size))
    others = [a for a in ("pp", "dp", "tp") if a != axis]
    for group in groups:
        assert len(group) == grid.size(axis)
        coords = [grid.coordinates(r) for r in group]
        # members differ only along `axis`, listed in increasing coordinate order
        assert [getattr(c, axis) for c in coords] == list(range(grid.size(axis)))
        for other in others:
            assert len({getattr(c, other) for c in coords}) == 1


def test_model_parallel_groups():
    assert RankGrid(dp=2, tp=2, pp=2).model_parallel_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert RankGrid(dp=3, tp=1, pp=2).model_parallel_groups() == [[0, 3], [1, 4], [2, 5]]
    assert RankGrid(dp=4, tp=1, pp=1).model_parallel_groups() == [[0], [1], [2], [3]]
    assert RankGrid(dp=1, tp=2, pp=2).model_parallel_groups() == [[0, 1, 2, 3]]


def test_stage_rank():
    grid = RankGrid(dp=2, tp=2, pp=2)
    assert grid.stage_rank(3, 1) == 7  # (pp0, dp1, tp1) -> (pp1, dp1, tp1)
    assert grid.stage_rank(6, 0) == 2  # (pp1, dp1, tp0) -> (pp0, dp1, tp0)
    assert grid.stage_rank(5, 1) == 5  # already on stage 1
    grid = RankGrid(dp=2, tp=1, pp=4)
    assert [grid.stage_rank(1, s) for s in range(4)] == [1, 3, 5, 7]
    assert [grid.stage_rank(6, s) for s in range(4)] == [0, 2, 4, 6]
    with pytest.raises(ValueError, match="pp coordinate 4"):
        grid.stage_rank(0, 4)


@pytest.mark.parametrize("axis", ["dp", "tp", "pp"])
@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2", None])
def test_invalid_degrees_raise(axis, bad):
    with pytest.raises(ValueError, match=f"parallel degree {axis}="):
        RankGrid(**{axis: bad})


def test_defaults_are_single_process():
    grid = RankGrid()
    assert (grid.dp, grid.tp, grid.pp, grid.world_size) == (1, 1, 1, 1)
    assert grid.axis_groups("pp") == [[0]]
