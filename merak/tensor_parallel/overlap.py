"""Sub-pipelined tensor parallelism across whole blocks (``tp_overlapping_level=2``).

Each microbatch is split in two along the batch, and the stage runs both
halves at once: the first on the calling thread with the tensor-parallel
group ``tp``, the second on a helper thread with its own copy of the group,
``tp_overlap``. While one half waits for an all-reduce, the other computes,
through every transformer block of the stage (level 1 only overlaps inside
one linear pair). The halves never share a collective, so their order across
ranks cannot be confused; backward runs on the autograd thread as usual, each
half's collectives on the group its forward used.

The stage graphs are captured for half a microbatch. Dropout would draw from
the one random generator of the process in a thread-dependent order, so
models with dropout are refused at this level.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn
from torch.utils import _pytree as pytree

from merak.core.group_registry import OVERLAP_GROUP, TP_GROUP, groups_renamed


def halve(value, batch: int):
    """(first half, second half) of every tensor whose first dimension is ``batch``; others shared."""
    leaves, spec = pytree.tree_flatten(value)
    firsts, seconds = [], []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == batch:
            first, second = leaf.chunk(2, dim=0)
            firsts.append(first)
            seconds.append(second)
        else:
            firsts.append(leaf)
            seconds.append(leaf)
    return pytree.tree_unflatten(firsts, spec), pytree.tree_unflatten(seconds, spec)


def join(first, second, half: int):
    """The two halves' outputs concatenated along the batch (tensors whose first dimension is ``half``)."""
    firsts, spec = pytree.tree_flatten(first)
    seconds, _ = pytree.tree_flatten(second)
    joined = [torch.cat([a, b], dim=0) if isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] == half else a
              for a, b in zip(firsts, seconds)]
    return pytree.tree_unflatten(joined, spec)


def batch_size(value) -> int:
    sizes = [leaf.shape[0] for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor) and leaf.dim()]
    if not sizes:
        raise ValueError("tp_overlapping_level=2 found no batched tensor in the stage input")
    return max(set(sizes), key=sizes.count)


class SubPipelinedStage(nn.Module):
    """Runs ``stage`` on the two halves of each microbatch concurrently (see the module docstring)."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage
        self._helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="merak-tp-overlap")

    def forward(self, inputs):
        batch = batch_size(inputs)
        if batch % 2:
            raise ValueError(f"tp_overlapping_level=2 splits each microbatch in two; got a batch of {batch}")
        first, second = halve(inputs, batch)
        grad_enabled = torch.is_grad_enabled()

        def run_second():
            with torch.set_grad_enabled(grad_enabled), groups_renamed({TP_GROUP: OVERLAP_GROUP}):
                return self.stage(second)

        pending = self._helper.submit(run_second)
        out_first = self.stage(first)
        return join(out_first, pending.result(), batch // 2)


def dropout_modules(model: nn.Module) -> list[str]:
    """Dropout modules with a positive rate (level 2 cannot reproduce their masks)."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]
