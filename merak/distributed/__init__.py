"""Rank grid, process groups, launching and point-to-point communication."""

from merak.distributed.groups import (
    ParallelState,
    get_dp_group,
    get_dp_rank,
    get_dp_size,
    get_pp_group,
    get_pp_rank,
    get_pp_size,
    get_rank_grid,
    get_state,
    get_tp_group,
    get_tp_rank,
    get_tp_size,
    init,
    is_initialized,
    shutdown,
)
from merak.distributed.topology import Coordinates, RankGrid

__all__ = [
    "Coordinates",
    "ParallelState",
    "RankGrid",
    "get_dp_group",
    "get_dp_rank",
    "get_dp_size",
    "get_pp_group",
    "get_pp_rank",
    "get_pp_size",
    "get_rank_grid",
    "get_state",
    "get_tp_group",
    "get_tp_rank",
    "get_tp_size",
    "init",
    "is_initialized",
    "shutdown",
]
