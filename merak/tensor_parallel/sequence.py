"""Sequence parallelism: activations outside the tensor-parallel blocks split along the sequence.

Between the blocks (normalizations, dropout, residual additions) every rank
would otherwise hold the same full activations; with sequence parallelism each
keeps 1/tp of the sequence, and the blocks' all-reduce becomes an all-gather
at the block's entry plus a reduce-scatter at its row-parallel exit.

For an unmodified model this is expressed on module boundaries (forward hooks,
which graph capture records like any other call):

- ``enter``: modules whose output is split along the sequence (e.g. the
  embedding dropout);
- ``regions``: tensor-parallel blocks (attention, MLP) whose first input is
  gathered; their row-parallel layers reduce-scatter;
- ``exit``: modules whose first input is gathered back to full (the output
  head); a column-parallel head gathers by itself;
- ``sharded``: modules whose replicated parameters see only a chunk of the
  sequence; their gradients are summed over the tensor-parallel group.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from merak.core.names import module_pattern
from merak.core.slices import mark_partial, slices_of
from merak.tensor_parallel import comm


@dataclass(frozen=True)
class SequenceParallelPlan:
    """Module globs that delimit the sequence-parallel region (see the module docstring)."""

    enter: tuple[str, ...]
    regions: tuple[str, ...]
    exit: tuple[str, ...]
    sharded: tuple[str, ...]

    def _matches(self, patterns: Iterable[str], names: list[str]) -> set[str]:
        return {n for p in patterns for n in names if module_pattern(p).fullmatch(n)}

    def region_modules(self, names: list[str]) -> set[str]:
        return self._matches(self.regions, names)

    def exit_modules(self, names: list[str]) -> set[str]:
        return self._matches(self.exit, names)

    def problems(self, names: list[str]) -> list[str]:
        """Globs that match no module."""
        out = []
        for kind in ("enter", "regions", "exit", "sharded"):
            for pattern in getattr(self, kind):
                if not self._matches([pattern], names):
                    out.append(f"sequence-parallel {kind} {pattern!r} matches no module")
        return out


def _first_tensor(value, change):
    """``value`` with its first tensor (itself, or the first element of a tuple) replaced by ``change(t)``."""
    if isinstance(value, torch.Tensor):
        return change(value)
    if isinstance(value, tuple) and value and isinstance(value[0], torch.Tensor):
        return (change(value[0]), *value[1:])
    raise TypeError(f"sequence parallelism expects a tensor or a tuple starting with one, got {type(value).__name__}")


def _input_hook(op, group: str, dim: int):
    def hook(module, args, kwargs):
        if args:
            return (_first_tensor(args, lambda t: op(t, group, dim)), kwargs)
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": op(kwargs["hidden_states"], group, dim)}
        raise TypeError(f"{type(module).__name__} was called without a positional or hidden_states input "
                        "to gather along the sequence")
    return hook


def install_sequence_parallel(model: nn.Module, plan: SequenceParallelPlan, ctx, *,
                              gathers_itself: set[str]) -> None:
    """Register the region hooks on ``model`` and mark the parameters whose gradients are partial."""
    names = [n for n, _ in model.named_modules()]
    modules = dict(model.named_modules())
    for name in plan._matches(plan.enter, names):
        modules[name].register_forward_hook(
            lambda module, args, output: _first_tensor(
                output, lambda t: comm.scatter_to_sequence(t, ctx.group, ctx.sequence_dim)))
    for name in plan.region_modules(names):
        modules[name].register_forward_pre_hook(_input_hook(comm.gather_from_sequence, ctx.group, ctx.sequence_dim),
                                                with_kwargs=True)
    for name in plan.exit_modules(names) - gathers_itself:
        modules[name].register_forward_pre_hook(_input_hook(comm.gather_to_replicated, ctx.group, ctx.sequence_dim),
                                                with_kwargs=True)
    sliced = {id(p) for m in model.modules() for p in _sliced_parameters(m)}
    for name in plan._matches(plan.sharded, names):
        for param in modules[name].parameters():
            if id(param) not in sliced:
                mark_partial(param)


def _sliced_parameters(module: nn.Module):
    return [getattr(module, n) for n in slices_of(module) if isinstance(getattr(module, n), nn.Parameter)]

