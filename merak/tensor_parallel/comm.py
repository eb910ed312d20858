"""Autograd-aware collectives of the tensor-parallel group, as torch custom operators.

They are custom operators (``torch.ops.merak.*``) rather than autograd
Functions so that graph capture keeps them as single opaque nodes: torch.fx
records the call, and torch.export keeps the operator with its registered
backward instead of inlining a forward whose backward would be lost. During
capture only their shape functions run, so planning needs no process group.

Groups are named (``"tp"``, and the second group of the sub-pipelined
overlap, ``"tp_overlap"``) because an operator takes plain arguments; each
worker registers its groups in :mod:`merak.core.group_registry` (``merak.init`` does).

The pairs follow Megatron-LM (sums in the forward pass are identity in the
backward pass and vice versa):

==========================  ======================  ===========================
operator                    forward                 backward
==========================  ======================  ===========================
``copy_to_tp``              identity                all-reduce
``reduce_from_tp``          all-reduce              identity
``scatter_to_sequence``     keep own chunk          all-gather
``gather_from_sequence``    all-gather              reduce-scatter
``gather_to_replicated``    all-gather              keep own chunk
``reduce_scatter_sequence`` reduce-scatter          all-gather
==========================  ======================  ===========================
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from merak.core.group_registry import get_group, group_size, resolve_name
from merak.distributed import collectives

# -- raw collectives (no autograd) ---------------------------------------------------------------

def all_reduce(x: Tensor, name: str, op=dist.ReduceOp.SUM) -> Tensor:
    """Sum (or ``op``) of ``x`` over the group, as a new tensor."""
    entry = get_group(name)
    out = x.contiguous().clone()
    if entry.size > 1 and not entry.simulated:
        dist.all_reduce(out, op=op, group=entry.group)
    return out


def all_gather(x: Tensor, name: str, dim: int) -> Tensor:
    """Chunks of every rank concatenated along ``dim`` in rank order."""
    entry = get_group(name)
    if entry.size == 1:
        return x.clone()
    if entry.simulated:
        return torch.cat([x] * entry.size, dim=dim)
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] * entry.size, *moved.shape[1:]))
    collectives.all_gather_single(out, moved, group=entry.group)
    return out.movedim(0, dim).contiguous()


def reduce_scatter(x: Tensor, name: str, dim: int) -> Tensor:
    """This rank's chunk along ``dim`` of the sum over the group."""
    entry = get_group(name)
    if entry.size == 1 or entry.simulated:
        return own_chunk(x, name, dim)
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // entry.size, *moved.shape[1:]))
    collectives.reduce_scatter_single(out, moved, group=entry.group)
    return out.movedim(0, dim).contiguous()


def own_chunk(x: Tensor, name: str, dim: int) -> Tensor:
    """This rank's chunk of ``x`` along ``dim`` (a copy)."""
    entry = get_group(name)
    return x.chunk(entry.size, dim=dim)[entry.rank].contiguous()


def _resize(x: Tensor, dim: int, factor: float) -> list[int]:
    shape = list(x.shape)
    shape[dim] = int(shape[dim] * factor)
    return shape


# -- operators --------------------------------------------------------------------------------------
# Each backward formula calls the mirror operator of the table above (never torch.distributed
# directly): a compiled backward then holds one opaque call per collective, not a traced c10d call
# bound to a process group object.

def _copied(x, name):
    return torch.empty_like(x)  # a clone keeps the strides


def _reduced(x, name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _gathered(x, name, dim):
    return x.new_empty(_resize(x, dim, group_size(name)))


def _scattered(x, name, dim):
    return x.new_empty(_resize(x, dim, 1 / group_size(name)))


@torch.library.custom_op("merak::copy_to_tp", mutates_args=())
def copy_to_tp(x: Tensor, name: str) -> Tensor:
    """Identity forward, all-reduce of the gradient backward (enters a tensor-parallel region)."""
    return x.clone()


@torch.library.custom_op("merak::reduce_from_tp", mutates_args=())
def reduce_from_tp(x: Tensor, name: str) -> Tensor:
    """All-reduce forward, identity backward (leaves a tensor-parallel region)."""
    return all_reduce(x, name)


@torch.library.custom_op("merak::scatter_to_sequence", mutates_args=())
def scatter_to_sequence(x: Tensor, name: str, dim: int) -> Tensor:
    """Keep this rank's chunk along ``dim`` (enter the sequence-parallel region)."""
    return own_chunk(x, name, dim)


@torch.library.custom_op("merak::gather_from_sequence", mutates_args=())
def gather_from_sequence(x: Tensor, name: str, dim: int) -> Tensor:
    """All-gather along ``dim``; the backward reduce-scatters (the gathered value feeds a split layer)."""
    return all_gather(x, name, dim)


@torch.library.custom_op("merak::gather_to_replicated", mutates_args=())
def gather_to_replicated(x: Tensor, name: str, dim: int) -> Tensor:
    """All-gather along ``dim``; the backward keeps the own chunk (the value feeds replicated layers)."""
    return all_gather(x, name, dim)


@torch.library.custom_op("merak::reduce_scatter_sequence", mutates_args=())
def reduce_scatter_sequence(x: Tensor, name: str, dim: int) -> Tensor:
    """Reduce-scatter along ``dim`` (leave a tensor-parallel region into the sequence-parallel one)."""
    return reduce_scatter(x, name, dim)


def _save_name(ctx, inputs, output):
    # The group is resolved now: backward runs on the autograd thread, which has no renames.
    ctx.name = resolve_name(inputs[1])


def _save_name_dim(ctx, inputs, output):
    ctx.name, ctx.dim = resolve_name(inputs[1]), inputs[2]


for _op, _fake in ((copy_to_tp, _copied), (reduce_from_tp, _reduced), (scatter_to_sequence, _scattered),
                   (gather_from_sequence, _gathered), (gather_to_replicated, _gathered),
                   (reduce_scatter_sequence, _scattered)):
    _op.register_fake(_fake)

copy_to_tp.register_autograd(lambda ctx, grad: (reduce_from_tp(grad, ctx.name), None), setup_context=_save_name)
reduce_from_tp.register_autograd(lambda ctx, grad: (grad, None), setup_context=lambda ctx, inputs, output: None)
scatter_to_sequence.register_autograd(
    lambda ctx, grad: (gather_from_sequence(grad, ctx.name, ctx.dim), None, None), setup_context=_save_name_dim)
gather_from_sequence.register_autograd(
    lambda ctx, grad: (reduce_scatter_sequence(grad, ctx.name, ctx.dim), None, None), setup_context=_save_name_dim)
gather_to_replicated.register_autograd(
    lambda ctx, grad: (scatter_to_sequence(grad, ctx.name, ctx.dim), None, None), setup_context=_save_name_dim)
reduce_scatter_sequence.register_autograd(
    lambda ctx, grad: (gather_from_sequence(grad, ctx.name, ctx.dim), None, None), setup_context=_save_name_dim)
