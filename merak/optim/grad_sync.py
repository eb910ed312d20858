"""Gradient reductions across ranks: tied weights and data parallelism."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
T = TypeVar("T")


def dtype_runs(items: Sequence[T], bucket_bytes: int,
               tensor_of: Callable[[T], torch.Tensor] = lambda item: item) -> list[list[T]]:
    """``items`` cut, in order, into runs whose tensors (``tensor_of(item)``) share a dtype and add up to
    about ``bucket_bytes``."""
    runs: list[list[T]] = []
    size = 0
    for item in items:
        tensor = tensor_of(item)
        nbytes = tensor.numel() * tensor.element_size()
        if not runs or tensor_of(runs[-1][0]).dtype != tensor.dtype or size + nbytes > bucket_bytes:
            runs.append([])
            size = 0
        runs[-1].append(item)
        size += nbytes
    return runs


def ensure_grads(params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
    """The gradients of ``params``, zeros created where there is none yet."""
    # A parameter unused in this step still takes part, with a zero gradient,
    # so every rank reduces the same buffers in the same order.
    grads = []
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grads.append(param.grad)
    return grads


def all_reduce_tensors(tensors: Sequence[torch.Tensor], *, group, scale: float = 1.0, pre_scale: float = 1.0,
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES, reduce_dtype: torch.dtype | None = None) -> None:
    """Sum ``tensors`` in place over ``group`` in flat buckets: ``scale * sum(pre_scale * t)``.

    ``pre_scale`` applies before the sum, which keeps fp16 sums in range; ``reduce_dtype`` (default: the
    tensors') is the dtype the sum travels and adds in.
    """
    for bucket in dtype_runs(tensors, bucket_bytes):
        flat = torch.cat([t.reshape(-1).to(reduce_dtype or t.dtype) for t in bucket])
        if pre_scale != 1.0:
            flat.mul_(pre_scale)
        dist.all_reduce(flat, group=group)
        if scale != 1.0:
            flat.mul_(scale)
        offset = 0
        for tensor in bucket:
            tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
