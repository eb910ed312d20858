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


# Rows of half-precision logits turned into float32 at a time (about 128 MiB of float32 at GPT-2's vocabulary).
CHUNK_BYTES = 128 * 2**20


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of half-precision logits, computed in float32 a chunk of rows at a time.

    Neither pass holds a float32 copy of the whole ``[N, vocab]`` logits: the forward keeps
    one log-sum-exp per row, the backward recomputes the softmax chunk by chunk and writes the
    gradient in the logits' dtype.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int):
        rows = max(1, CHUNK_BYTES // (4 * logits.shape[-1]))
        valid = labels != ignore_index
        safe = torch.where(valid, labels, 0)
        log_sum_exp = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        target = torch.empty_like(log_sum_exp)
        for start in range(0, logits.shape[0], rows):
            chunk = logits[start:start + rows].float()
            log_sum_exp[start:start + rows] = torch.logsumexp(chunk, dim=-1)
            target[start:start + rows] = chunk.gather(-1, safe[start:start + rows].unsqueeze(-1)).squeeze(-1)
        count = valid.sum()
        ctx.save_for_backward(logits, safe, valid, log_sum_exp, count)
        ctx.rows = rows
        return torch.where(valid, log_sum_exp - target, 0.0).sum() / count

    @staticmethod
    def backward(ctx, grad):
        logits, safe, valid, log_sum_exp, count = ctx.saved_tensors
        scale = torch.where(valid, grad / count, 0.0)
        grad_logits = torch.empty_like(logits)
        rows = ctx.rows
        for start in range(0, logits.shape[0], rows):
            stop = start + rows
            softmax = (logits[start:stop].float() - log_sum_exp[start:stop].unsqueeze(-1)).exp_()
            softmax.scatter_add_(-1, safe[start:stop].unsqueeze(-1),
                                 -torch.ones_like(log_sum_exp[start:stop]).unsqueeze(-1))
            grad_logits[start:stop] = softmax.mul_(scale[start:stop].unsqueeze(-1))
        return grad_logits, None, None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy (in float32), vocabulary-parallel when this worker's logits are split.

    ``logits``: ``(N, vocab)`` or ``(N, vocab / tp)``; ``labels``: ``(N,)``. Half-precision logits
    are never copied to float32 whole (chunked, see ``_ChunkedCrossEntropy``).
    """
    if vocab_is_parallel():
        return vocab_parallel_cross_entropy(logits, labels, group=_STATE["group"], ignore_index=ignore_index)
    if logits.dtype in (torch.float16, torch.bfloat16) and logits.dim() == 2:
        return _ChunkedCrossEntropy.apply(logits, labels, ignore_index)
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index)


def accepts_half_precision(loss_fn):
    """Mark a loss function that computes in float32 itself from half-precision model outputs.

    Without the mark, fp16/bf16 runs cast the last stage's outputs to float32 before the loss (a
    float32 copy of the whole logits); with it, the loss gets them as they are.
    """
    loss_fn.accepts_half_precision = True
    return loss_fn
