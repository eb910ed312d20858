"""How long a tensor-parallel collective waits when the processes around it compute.

A collective among processes that share the cores costs more than its bytes: each message waits for its
receiver to be scheduled. How long depends on what the other processes do meanwhile. All of them inside
collectives (the calibration's small all-reduce among every process) sleep between messages, so a
receiver is woken at once; in a tensor-parallel step the other groups compute between their
collectives, so a woken receiver waits for a core held by a computing process. How much that differs
from the idle all-reduce's ring steps depends on the processes: in the 34 calibrations of one sweep on
two cores, a pair's all-reduce took a median 2.3 ms among four processes (the idle all-reduce of all
four: 1.06 ms per ring step, 2.1 ms for a pair's two) and 2.8 ms among eight (idle: 3.3 ms). More
compute between the collectives did not lengthen it (``bench/busy_collective_waits.py``: among eight,
2.6, 2.2 and 2.2 ms with 0.3, 1.1 and 4.4 ms of compute).

Here every group of each size computes a little between small all-reduces, every group at once, as
tensor-parallel ranks do: the time per collective is the time of such a stretch over the same
computing without the all-reduces, the blocks alternating so that a drift of the machine's speed falls
on both. Runs inside the calibration's processes (``torch.distributed`` already set up).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

MESSAGE_ELEMENTS = 1024  # a small message: the collective costs its waits, not its bytes
FILLER_SIDE = 96  # the compute between collectives: products of a matrix this wide, ...
FILLER_PRODUCTS = 12  # ... this many (0.3 ms on one core alone when last timed)
COLLECTIVES_PER_BLOCK = 10
BLOCK_PAIRS = 10  # blocks with and without the all-reduces, alternating


def _stretch(filler: torch.Tensor, message: torch.Tensor, group, with_collectives: bool) -> float:
    """The slowest process's time per repetition of computing (and, ``with_collectives``, all-reducing
    in ``group``), all processes starting together."""
    dist.barrier()
    started = time.perf_counter()
    for _ in range(COLLECTIVES_PER_BLOCK):
        for _ in range(FILLER_PRODUCTS):
            filler @ filler
        if with_collectives:
            dist.all_reduce(message, group=group)
    elapsed = torch.tensor([(time.perf_counter() - started) / COLLECTIVES_PER_BLOCK], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a synchronous step waits for the slowest
    return elapsed.item()


def own_group(size: int):
    """This process's group of ``size`` consecutive ranks (None: all of them). Every process creates every group
    of that size, in the same order (torch.distributed's rule)."""
    rank, processes = dist.get_rank(), dist.get_world_size()
    if size == processes:
        return None
    groups = [dist.new_group(list(range(first, first + size))) for first in range(0, processes, size)]
    return groups[rank // size]


def time_busy_collectives(sizes: list[int]) -> dict[int, float]:
    """Per group size in ``sizes`` (each dividing the world): the seconds a small all-reduce adds in groups
    of that many consecutive ranks, every group at once, each process computing between its collectives
    (the median over :data:`BLOCK_PAIRS` pairs of blocks; never below zero). Every rank must call it."""
    filler = torch.randn(FILLER_SIDE, FILLER_SIDE)
    message = torch.zeros(MESSAGE_ELEMENTS)
    waits = {}
    for size in sizes:
        group = own_group(size)
        dist.all_reduce(message, group=group)  # warm-up: the group's connections
        differences = []
        for _ in range(BLOCK_PAIRS):
            computing = _stretch(filler, message, group, with_collectives=False)
            differences.append(_stretch(filler, message, group, with_collectives=True) - computing)
        waits[size] = max(0.0, statistics.median(differences))
    return waits
