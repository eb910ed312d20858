"""The rank grid: how global ranks map onto (pipeline, data, tensor) coordinates.

Pure arithmetic, no torch.distributed: axes are ordered (pp, dp, tp) with tp
fastest, so ``rank = (pp_rank * dp + dp_rank) * tp + tp_rank``. Tensor-parallel
peers are neighbours (they talk most), pipeline stages are the slowest axis.
"""

from __future__ import annotations

from dataclasses import dataclass

AXES = ("pp", "dp", "tp")


@dataclass(frozen=True)
class Coordinates:
    """A rank's position on each axis."""

    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class RankGrid:
    """A dp x tp x pp grid of ranks.

    Args:
        dp: data-parallel degree.
        tp: tensor-parallel degree.
        pp: pipeline-parallel degree (number of stages).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            value = getattr(self, axis)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"parallel degree {axis}={value!r} must be a positive integer")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def size(self, axis: str) -> int:
        """Degree of one axis ('pp', 'dp' or 'tp')."""
        if axis not in AXES:
            raise ValueError(f"unknown axis {axis!r}; axes are {AXES}")
        return getattr(self, axis)

    def rank_of(self, *, pp: int, dp: int, tp: int) -> int:
        """Global rank at the given coordinates."""
        for axis, value in (("pp", pp), ("dp", dp), ("tp", tp)):
            if not 0 <= value < self.size(axis):
                raise ValueError(f"{axis} coordinate {value} outside 0..{self.size(axis) - 1}")
        return (pp * self.dp + dp) * self.tp + tp

    def coordinates(self, rank: int) -> Coordinates:
        """Coordinates of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside 0..{self.world_size - 1}")
        tp = rank % self.tp
        dp = (rank // self.tp) % self.dp
        pp = rank // (self.tp * self.dp)
        return Coordinates(pp=pp, dp=dp, tp=tp)

    def axis_groups(self, axis: str) -> list[list[int]]:
        """All groups of ranks that differ only along ``axis``, in a fixed order.

        Every rank must create process groups in the same order, so the order
        here is part of the contract.
        """
        others = [a for a in AXES if a != axis]
        groups = []
        for first in range(self.size(others[0])):
            for second in range(self.size(others[1])):
                fixed = {others[0]: first, others[1]: second}
                groups.append([self.rank_of(**fixed, **{axis: i}) for i in range(self.size(axis))])
        return groups

    def model_parallel_groups(self) -> list[list[int]]:
        """Groups of ranks holding one full model replica (same dp coordinate)."""
        return [
            sorted(self.rank_of(pp=p, dp=d, tp=t) for p in range(self.pp) for t in range(self.tp))
            for d in range(self.dp)
        ]

    def stage_rank(self, rank: int, stage: int) -> int:
        """The rank that holds ``stage`` in the same (dp, tp) slice as ``rank``."""
        here = self.coordinates(rank)
        return self.rank_of(pp=stage, dp=here.dp, tp=here.tp)
