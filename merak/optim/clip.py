"""The gradient norm over the whole model, whichever ranks hold it."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def global_grad_norm(grads: Sequence[torch.Tensor | None], *, group, group_size: int) -> torch.Tensor:
    """L2 norm of the gradients of one model replica spread over ``group``.

    ``grads`` must hold each gradient element of the replica on exactly one rank of the
    group (copies of tied weights on their other owners left out), so nothing is
    counted twice. A float64 scalar, identical on every rank of the group.
    """
    # float64 accumulation keeps the norm exact to ~1e-15 (an fp32 norm of a large
    # embedding is off by ~1e-6); vector_norm does it without a float64 copy.
    # One fused kernel per device and dtype, not one per gradient.
    present = [g.detach() for g in grads if g is not None]
    norms = torch._foreach_norm(present, 2, dtype=torch.float64) if present else []
    squares = torch.stack([n.to(norms[0].device) for n in norms]).square().sum().cpu() if norms \
        else torch.zeros((), dtype=torch.float64)
    if group_size > 1:
        dist.all_reduce(squares, group=group)
    return squares.sqrt()
