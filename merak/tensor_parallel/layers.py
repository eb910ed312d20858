"""Turn single-device layers into their tensor-parallel shards, in place.

A layer keeps its module object, its name and its class (a parallel layer is
a subclass of the original, so ``isinstance`` checks and Hugging Face's
``_init_weights`` still apply); its weights are replaced by this rank's
slice of exactly the single-device weights, and its ``forward`` by one that
communicates. Styles:

- ``column``: ``nn.Linear`` / GPT-2 ``Conv1D`` keep a slice of the output
  features (``parts`` > 1 for fused query/key/value weights);
- ``row``: keep a slice of the input features, sum the outputs over the group,
  then add the bias;
- ``vocab``: ``nn.Embedding`` keeps a slice of the rows (token ids outside it
  give zeros before the sum);
- ``conv_column`` / ``conv_row``: ``nn.Conv2d`` split by output / input channels;
- sliced tensors (:func:`merak.core.slices.slice_tensor_`) for
  per-head tables and the normalizations between a column and a row layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from merak.core.slices import TensorSlice, slice_tensor_
from merak.tensor_parallel import comm
from merak.tensor_parallel.linear_ops import column_linear, row_linear

STYLES = ("column", "row", "vocab", "conv_column", "conv_row")


@dataclass(frozen=True)
class ParallelContext:
    """How this rank's layers communicate."""

    rank: int
    size: int
    group: str = "tp"
    sequence_dim: int = -1  # >= 0: sequence parallelism along this dimension
    overlap: bool = False  # tp_overlapping_level >= 1


def weight_in_out(module: nn.Module) -> bool:
    """True for GPT-2's ``Conv1D`` (weight stored in x out), False for ``nn.Linear``."""
    if isinstance(module, nn.Linear):
        return False
    if hasattr(module, "nf") and hasattr(module, "nx") and module.weight.shape == (module.nx, module.nf):
        return True
    raise TypeError(f"{type(module).__name__} is neither nn.Linear nor a GPT-2 Conv1D; "
                    "column and row styles apply to linear layers only")


_SUBCLASSES: dict[tuple[type, type], type] = {}


def _swap_class(module: nn.Module, mixin: type) -> None:
    """Make ``module`` an instance of a subclass of its class whose forward is ``mixin.forward``."""
    base = type(module)
    key = (base, mixin)
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(f"{mixin.__name__}{base.__name__}", (mixin, base), {"__module__": __name__})
    module.__class__ = _SUBCLASSES[key]


class _Column:
    def forward(self, x):
        ctx = self._merak_tp
        return column_linear(x, self.weight, self.bias, ctx.group, self._merak_in_out, self._merak_input_comm,
                             ctx.sequence_dim, ctx.overlap)


class _Row:
    def forward(self, x):
        ctx = self._merak_tp
        return row_linear(x, self.weight, self.bias, ctx.group, self._merak_in_out, ctx.sequence_dim,
                          ctx.overlap)


class _Vocab:
    def forward(self, ids):
        ctx = self._merak_tp
        rows = self.weight.shape[0]
        start = ctx.rank * rows
        outside = (ids < start) | (ids >= start + rows)
        local = torch.where(outside, 0, ids - start)
        out = F.embedding(local, self.weight, self._merak_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        # Always a full sum: models add position embeddings to the result before the
        # sequence-parallel region starts.
        return comm.reduce_from_tp(out, ctx.group)


class _ConvColumn:
    def forward(self, x):
        return self._conv_forward(comm.copy_to_tp(x, self._merak_tp.group), self.weight, self.bias)


class _ConvRow:
    def forward(self, x):
        out = comm.reduce_from_tp(self._conv_forward(x, self.weight, None), self._merak_tp.group)
        return out if self.bias is None else out + self.bias.view(1, -1, *([1] * (out.dim() - 2)))


def parallelize(module: nn.Module, style: str, ctx: ParallelContext, memo: dict, *,
                parts: int = 1, input_comm: str = "copy") -> None:
    """Turn ``module`` into its ``style`` shard for ``ctx.rank`` (see the module docstring).

    Args:
        memo: parameters already sliced (tied weights stay one parameter).
        parts: fused blocks along the output features (column style).
        input_comm: how a column layer's input arrives (merak.tensor_parallel.linear_ops).
    """
    def cut(name: str, dim: int, blocks: int = 1) -> None:
        slice_tensor_(module, name, TensorSlice(dim=dim, rank=ctx.rank, size=ctx.size, parts=blocks), memo)

    if style in ("column", "row"):
        in_out = weight_in_out(module)
        out_dim, in_dim = (1, 0) if in_out else (0, 1)
        if style == "column":
            cut("weight", out_dim, parts)
            if module.bias is not None:
                cut("bias", 0, parts)
        else:
            cut("weight", in_dim)
        module._merak_in_out = in_out
        module._merak_input_comm = input_comm
        _set_features(module, in_out)
        _swap_class(module, _Column if style == "column" else _Row)
    elif style == "vocab":
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"vocab style needs nn.Embedding, got {type(module).__name__}")
        if module.max_norm is not None or module.sparse:
            raise ValueError("vocab-parallel embeddings support neither max_norm nor sparse gradients")
        rows = module.num_embeddings // ctx.size
        padding = module.padding_idx
        module._merak_padding_idx = (padding - ctx.rank * rows
                                     if padding is not None and ctx.rank * rows <= padding < (ctx.rank + 1) * rows
                                     else None)
        cut("weight", 0)
        module.num_embeddings = rows
        _swap_class(module, _Vocab)
    elif style in ("conv_column", "conv_row"):
        if not isinstance(module, nn.Conv2d) or module.groups != 1:
            raise TypeError(f"{style} needs an nn.Conv2d with groups=1, got {module!r}")
        if style == "conv_column":
            cut("weight", 0)
            if module.bias is not None:
                cut("bias", 0)
            module.out_channels //= ctx.size
        else:
            cut("weight", 1)
            module.in_channels //= ctx.size
        _swap_class(module, _ConvColumn if style == "conv_column" else _ConvRow)
    else:
        raise ValueError(f"unknown tensor-parallel style {style!r}; choose from {STYLES}")
    module._merak_tp = ctx


def _set_features(module: nn.Module, in_out: bool) -> None:
    """Keep the feature-count attributes true to the local weight (``Conv1D.forward`` reads ``nf``)."""
    if in_out:
        module.nx, module.nf = module.weight.shape
    else:
        module.out_features, module.in_features = module.weight.shape
