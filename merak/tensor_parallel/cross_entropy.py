"""Cross-entropy over logits split by vocabulary (``parallel_vocab``), and the dispatching loss.

With a vocabulary-parallel output layer each rank holds the logits of its
vocabulary slice only; gathering them would cost tp x the logits' memory. The
loss is instead computed from three all-reduces of per-token scalars (the max,
the sum of exponentials and the target's logit), as in Megatron-LM.

Recipes call :func:`cross_entropy`; it uses the vocabulary-parallel form when
the worker's model was split with ``parallel_vocab`` (see
:func:`set_vocab_parallel`) and ``torch.nn.functional.cross_entropy`` otherwise.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from merak.tensor_parallel import comm

_STATE = {"group": None}


def set_vocab_parallel(group: str | None) -> None:
    """Declare that output logits are split by vocabulary over ``group`` (None: they are whole)."""
    _STATE["group"] = group


def vocab_is_parallel() -> bool:
    return _STATE["group"] is not None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, name: str, ignore_index: int):
        entry = comm.get_group(name)
        vocab_local = logits.shape[-1]
        start = entry.rank * vocab_local
        logits = logits.float()
        peak = comm.all_reduce(logits.max(dim=-1).values, name, dist.ReduceOp.MAX)
        shifted = logits - peak.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = comm.all_reduce(exp.sum(dim=-1), name)
        valid = labels != ignore_index
        local = (labels >= start) & (labels < start + vocab_local) & valid
        index = torch.where(local, labels - start, 0)
        target = torch.where(local, shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1), 0.0)
        target = comm.all_reduce(target, name)
        count = valid.sum().clamp_min(1)
        losses = torch.where(valid, sum_exp.log() - target, 0.0)
        ctx.save_for_backward(exp, sum_exp, index, local, valid)
        ctx.count = count
        return losses.sum() / count

    @staticmethod
    def backward(ctx, grad):
        exp, sum_exp, index, local, valid = ctx.saved_tensors
        softmax = exp / sum_exp.unsqueeze(-1)
        softmax.scatter_add_(-1, index.unsqueeze(-1), -local.to(softmax.dtype).unsqueeze(-1))
        scale = (grad / ctx.count) * valid.to(softmax.dtype)
        return softmax * scale.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, group: str = "tp",
                                 ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of ``labels`` (global token ids) given this rank's vocabulary slice of ``logits``.

    ``logits``: ``(..., vocab / tp)``; ``labels``: ``(...)``. Positions labelled
    ``ignore_index`` are left out of the mean. Identical on every rank of the group.
    """
    return _VocabParallelCrossEntropy.apply(logits, labels, group, ignore_index)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy (in float32), vocabulary-parallel when this worker's logits are split.

    ``logits``: ``(N, vocab)`` or ``(N, vocab / tp)``; ``labels``: ``(N,)``.
    """
    if vocab_is_parallel():
        return vocab_parallel_cross_entropy(logits, labels, group=_STATE["group"], ignore_index=ignore_index)
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index)
