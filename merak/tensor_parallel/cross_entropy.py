"""Cross-entropy over logits split by vocabulary (``parallel_vocab``), and the dispatching loss.

With a vocabulary-parallel output layer each rank holds the logits of its
vocabulary slice only; gathering them would cost tp x the logits' memory. The
loss is instead computed from two all-reduces of per-token scalars (the max,
then the sum of exponentials with the target's logit), as in Megatron-LM.
Neither form copies half-precision logits to float32 whole: rows are
converted a chunk at a time.

Recipes call :func:`cross_entropy`; it uses the vocabulary-parallel form when
the worker's model was split with ``parallel_vocab`` (see
:func:`set_vocab_parallel`) and ``torch.nn.functional.cross_entropy`` otherwise.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from merak.core import group_registry
from merak.tensor_parallel import comm

_STATE = {"group": None}


def set_vocab_parallel(group: str | None) -> None:
    """Declare that output logits are split by vocabulary over ``group`` (None: they are whole)."""
    _STATE["group"] = group


def vocab_parallel_group() -> str | None:
    """The group the logits are split over by vocabulary (None: they are whole)."""
    return _STATE["group"]


def vocab_is_parallel() -> bool:
    return _STATE["group"] is not None


# Rows of logits turned into float32 at a time (about 128 MiB of float32 at GPT-2's vocabulary).
CHUNK_BYTES = 128 * 2**20


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``[N, vocab]`` logits (or of this rank's vocabulary slice of them),
    computed in float32 a chunk of rows at a time.

    Neither pass holds a float32 copy of the whole logits: the forward keeps three float32 numbers
    per row (the maximum, the sum of exponentials and the target's logit), the backward recomputes
    the softmax chunk by chunk and writes the gradient in the logits' dtype. With a vocabulary split
    over a tensor-parallel group, the per-row numbers are combined by two all-reduces (Megatron-LM's
    vocabulary-parallel loss). Rows labelled ``ignore_index`` are left out of the mean.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, group: str | None):
        vocab_local = logits.shape[-1]
        start = group_registry.get_group(group).rank * vocab_local if group is not None else 0
        rows = max(1, CHUNK_BYTES // (4 * vocab_local))
        valid = labels != ignore_index
        local = (labels >= start) & (labels < start + vocab_local) & valid
        index = torch.where(local, labels - start, 0).unsqueeze(-1)
        peak = logits.max(dim=-1).values.float()  # exact in any precision
        if group is not None:
            peak = comm.all_reduce(peak, group, dist.ReduceOp.MAX)
        sum_exp = torch.empty_like(peak)
        for first in range(0, logits.shape[0], rows):
            chunk = logits[first:first + rows].float() - peak[first:first + rows].unsqueeze(-1)
            sum_exp[first:first + rows] = chunk.exp_().sum(dim=-1)
        target = torch.where(local, logits.gather(-1, index).squeeze(-1).float() - peak, 0.0)
        if group is not None:
            sum_exp, target = comm.all_reduce(torch.stack([sum_exp, target]), group)
        count = valid.sum().clamp_min(1)
        ctx.save_for_backward(logits, index, local, valid, peak, sum_exp, count)
        ctx.rows = rows
        return torch.where(valid, sum_exp.log() - target, 0.0).sum() / count

    @staticmethod
    def backward(ctx, grad):
        logits, index, local, valid, peak, sum_exp, count = ctx.saved_tensors
        scale = torch.where(valid, grad / count, 0.0)
        grad_logits = torch.empty_like(logits)
        rows = ctx.rows
        for first in range(0, logits.shape[0], rows):
            stop = first + rows
            softmax = (logits[first:stop].float() - peak[first:stop].unsqueeze(-1)).exp_()
            softmax.div_(sum_exp[first:stop].unsqueeze(-1))
            softmax.scatter_add_(-1, index[first:stop], -local[first:stop].to(softmax.dtype).unsqueeze(-1))
            grad_logits[first:stop] = softmax.mul_(scale[first:stop].unsqueeze(-1))
        return grad_logits, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, group: str = "tp",
                                 ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of ``labels`` (global token ids) given this rank's vocabulary slice of ``logits``.

    ``logits``: ``(N, vocab / tp)``; ``labels``: ``(N,)``. Positions labelled ``ignore_index`` are
    left out of the mean. Identical on every rank of the group; no float32 copy of the logits.
    """
    return _ChunkedCrossEntropy.apply(logits, labels, ignore_index, group)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy (in float32), vocabulary-parallel when this worker's logits are split.

    ``logits``: ``(N, vocab)`` or ``(N, vocab / tp)``; ``labels``: ``(N,)``. Half-precision logits
    are never copied to float32 whole (chunked, see ``_ChunkedCrossEntropy``).
    """
    if vocab_is_parallel():
        return vocab_parallel_cross_entropy(logits, labels, group=_STATE["group"], ignore_index=ignore_index)
    if logits.dtype in (torch.float16, torch.bfloat16) and logits.dim() == 2:
        return _ChunkedCrossEntropy.apply(logits, labels, ignore_index, None)
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index)


def accepts_half_precision(loss_fn):
    """Mark a loss function that computes in float32 itself from half-precision model outputs.

    Without the mark, fp16/bf16 runs cast the last stage's outputs to float32 before the loss (a
    float32 copy of the whole logits); with it, the loss gets them as they are.
    """
    loss_fn.accepts_half_precision = True
    return loss_fn
