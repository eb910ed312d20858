"""Gradient reductions across ranks: tied weights and data parallelism."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


def _buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Group tensors of one dtype into runs of about ``bucket_bytes``, keeping order."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        same_dtype = buckets and buckets[-1][0].dtype == tensor.dtype
        if not buckets or not same_dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(tensor)
        size += nbytes
    return buckets


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
    for bucket in _buckets(tensors, bucket_bytes):
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
