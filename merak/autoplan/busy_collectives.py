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
on both. Then one group of each size does so alone, the other processes asleep, as a pipeline's other
stages wait while one stage computes: that is not the collective's bare cost either. A process that
computes between collectives arrives when its partner already sleeps in the collective, and waking it
takes most of a millisecond on this machine (``bench/gloo_collectives.py``: a pair's small all-reduce
between about a millisecond of compute, nothing else running, 1.4 ms among eight processes and 1.6 among
four, where a back-to-back one takes 0.6). A run's stage pays about the lone time when its group computes
alone, the busy time when every process computes, and in between as many processes as run beside it.
Runs inside the calibration's processes (``torch.distributed`` already set up).
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


def _stretch(filler: torch.Tensor, message: torch.Tensor, group, with_collectives: bool,
             taking_part: bool = True) -> float:
    """The slowest process's time per repetition of computing (and, ``with_collectives``, all-reducing
    in ``group``), all processes starting together; a process not ``taking_part`` waits for them, asleep in
    the closing all-reduce."""
    dist.barrier()
    started = time.perf_counter()
    for _ in range(COLLECTIVES_PER_BLOCK if taking_part else 0):
        for _ in range(FILLER_PRODUCTS):
            filler @ filler
        if with_collectives:
            dist.all_reduce(message, group=group)
    elapsed = torch.tensor([(time.perf_counter() - started) / COLLECTIVES_PER_BLOCK], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a synchronous step waits for the slowest
    return elapsed.item()


def _added_seconds(filler: torch.Tensor, message: torch.Tensor, group, taking_part: bool) -> float:
    """The median over :data:`BLOCK_PAIRS` pairs of blocks of what the all-reduces add (never below zero)."""
    differences = []
    for _ in range(BLOCK_PAIRS):
        computing = _stretch(filler, message, group, False, taking_part)
        differences.append(_stretch(filler, message, group, True, taking_part) - computing)
    return max(0.0, statistics.median(differences))


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
        waits[size] = _added_seconds(filler, message, group, taking_part=True)
    return waits


def time_lone_collectives(sizes: list[int]) -> dict[int, float]:
    """:func:`time_busy_collectives` with only the first group of each size (of fewer than all the processes)
    computing and all-reducing, the other processes asleep meanwhile, as a pipeline's other stages wait for
    their inputs. Every rank must call it."""
    filler = torch.randn(FILLER_SIDE, FILLER_SIDE)
    message = torch.zeros(MESSAGE_ELEMENTS)
    rank, processes = dist.get_rank(), dist.get_world_size()
    waits = {}
    for size in (s for s in sizes if s < processes):
        group = own_group(size)
        dist.all_reduce(message, group=group)
        waits[size] = _added_seconds(filler, message, group, taking_part=rank < size)
    return waits
