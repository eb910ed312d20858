"""All-gather into one tensor and reduce-scatter out of one, under the name the running torch prefers.

torch 2.13 renamed ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` to ``all_gather_single``
and ``reduce_scatter_single``; the old names still work there but warn (a ``FutureWarning`` on
every rank). Older torch (2.11 on the GPU machine) has only the old names. The function is looked
up on ``torch.distributed`` at each call, so a wrapper patched in there (the benchmarks time calls
that way) is the one that runs.
"""

from __future__ import annotations

import torch.distributed as dist

# The names in torch.distributed that this torch provides without a deprecation warning.
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


def all_gather_single(output, input, group=None, async_op: bool = False):
    """Every rank's ``input`` concatenated, in rank order, into ``output`` (``group`` size times larger)."""
    return getattr(dist, ALL_GATHER)(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """This rank's chunk of the group's element-wise reduction of ``input`` into ``output``."""
    return getattr(dist, REDUCE_SCATTER)(output, input, op=op, group=group, async_op=async_op)
