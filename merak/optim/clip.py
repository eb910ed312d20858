"""The gradient norm over the whole model, whichever ranks hold it, and the step's loss check."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def global_grad_norm(grads: Sequence[torch.Tensor | None], *, group, group_size: int,
                     loss: torch.Tensor | None = None) -> tuple[float, bool]:
    """L2 norm of the gradients of one model replica spread over ``group``, and whether every
    rank's ``loss`` was finite. Both are identical on every rank of the group.

    ``grads`` must hold each gradient element of the replica on exactly one rank of the
    group (copies of tied weights and data-parallel replicas left out), so nothing is
    counted twice. ``loss``: this rank's loss of the step, if it computed one.
    """
    # float64 accumulation keeps the norm exact to ~1e-15 (an fp32 norm of a large
    # embedding is off by ~1e-6); vector_norm does it without a float64 copy.
    # One fused kernel per device and dtype, not one per gradient.
    present = [g.detach() for g in grads if g is not None]
    norms = torch._foreach_norm(present, 2, dtype=torch.float64) if present else []
    squares = torch.stack([n.to(norms[0].device) for n in norms]).square().sum() if norms \
        else torch.zeros((), dtype=torch.float64)
    bad_loss = (~torch.isfinite(loss.detach())).any().to(torch.float64) if loss is not None \
        else torch.zeros((), dtype=torch.float64)
    # One reduction and one host synchronisation for both numbers.
    both = torch.stack([squares.cpu(), bad_loss.cpu()])
    if group_size > 1:
        dist.all_reduce(both, group=group)
    return float(both[0].sqrt()), bool(both[1] == 0)
