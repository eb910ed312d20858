"""ZeRO stage 3: a parameter's data lives as this rank's flat piece and is whole only while it is used.

The optimizer (:class:`merak.optim.distributed.DistributedOptimizer`) cuts every trainable parameter
into ``dp`` flat pieces, as at stages 1 and 2, and keeps this rank's piece as a *shard* in the
model's dtype. Each parameter keeps its shape, but its storage is resized to nothing while no
unit needs it; gathering resizes it back and writes the all-gathered pieces into it, so autograd's
saved references and any views see the whole weight again.

A *unit* is one part of a stage (:class:`merak.pipeline.stage.StageModule`; a stage of another
kind is one unit). Module hooks drive the gathering:

- forward (including a recomputation's): gather the unit before it runs, prefetch the next one,
  free the unit after it ran;
- backward: a hook on each unit output that needs a gradient gathers the unit when its gradient
  arrives (before any of the unit's backward runs) and prefetches the previous unit. It also frees
  the units after it, whose backward is complete: autograd runs the ready node created last, so
  every node of a later unit has run before the first node of an earlier unit. What is still held
  is freed when the instruction ends;
- a weight-gradient pass of the zero-bubble schedules (``backward_weight``) holds its whole chunk,
  since it runs no hooks of its own.

Every replica runs the same graph in the same order, so the all-gathers on the data-parallel group
are issued in the same order on every rank, as collectives must be. Gradients are reduce-scattered
as ZeRO-2 does it (during each backward, into the fp32 gradient pieces).

Why not FSDP2's ``fully_shard``: it turns parameters into ``DTensor`` shards of dimension 0, while
merak's optimizer, its checkpoints (pieces named per parameter, resumable into any layout), the
tied-weight sums across stages and stages 1 and 2 all use flat pieces of each parameter; and its
gathering is keyed to module forward and autograd post-backward callbacks, which the zero-bubble
schedules' split backward (an input pass, then a weight pass later) and merak's recomputation
instructions do not follow. Sharing the pieces keeps one checkpoint format and one optimizer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils import _pytree as pytree

from merak.distributed import collectives
from merak.pipeline.hooks import InstructionEvent, PipelineHook


@dataclass(frozen=True)
class Unit:
    """Parameters gathered together: ``params`` (optimizer indices) of ``module``, the ``index``-th unit
    of local ``chunk``."""

    chunk: int
    index: int
    module: nn.Module
    params: tuple[int, ...]


def stage_units(chunks: dict[int, nn.Module], index_of: dict[int, int]) -> list[Unit]:
    """The units of the local chunks: each part of a stage with ``parts``, else the whole stage.
    ``index_of`` maps ``id(parameter)`` to its optimizer index; a parameter two parts share belongs to both."""
    units = []
    for chunk, module in chunks.items():
        parts = list(module.parts) if hasattr(module, "parts") else [module]
        covered = {id(p) for part in parts for p in part.parameters()}
        if any(id(p) not in covered for p in module.parameters()):
            parts = [module]  # parameters outside the parts: the stage is gathered whole
        for index, part in enumerate(parts):
            params = tuple(dict.fromkeys(index_of[id(p)] for p in part.parameters() if id(p) in index_of))
            if params:
                units.append(Unit(chunk=chunk, index=index, module=part, params=params))
    return units


class ShardedParameters(PipelineHook):
    """Gathers and frees the trainable parameters of one rank's chunks (ZeRO-3).

    Args:
        params: the optimizer's parameters, in its order.
        shards: this rank's piece of each, padded to the piece size, in the model's dtype.
        units: how they are gathered (:func:`stage_units`).
        dp_group / dp_size: the data-parallel group the pieces are spread over.
    """

    def __init__(self, params: Sequence[nn.Parameter], shards: Sequence[torch.Tensor], units: Sequence[Unit], *,
                 dp_group, dp_size: int) -> None:
        self.params, self.shards, self.units = list(params), list(shards), list(units)
        self.dp_group, self.dp_size = dp_group, dp_size
        self._holds = [0] * len(self.params)
        self._nbytes = [p.numel() * p.element_size() for p in self.params]
        self._unit_at = {(unit.chunk, unit.index): unit for unit in self.units}
        self._by_chunk: dict[int, list[Unit]] = {}
        for unit in self.units:
            self._by_chunk.setdefault(unit.chunk, []).append(unit)
        self._prefetched: dict[tuple[int, int], list[tuple[list[int], object, torch.Tensor]]] = {}
        self._backward_held: list[Unit] = []
        self._instruction_held: list[Unit] = []
        self._gathered_bytes = 0  # of the parameters held whole now
        self.peak_gathered_bytes = 0
        for param in self.params:
            # A storage of its own, so that freeing it frees exactly this parameter.
            param.data = torch.empty(param.shape, dtype=param.dtype, device=param.device)
            param.data.untyped_storage().resize_(0)
        for unit in self.units:
            unit.module.register_forward_pre_hook(lambda _module, _args, unit=unit: self._before_forward(unit))
            # always_call: a recomputation inside the backward stops early by raising out of the forward
            # (torch.utils.checkpoint), and the unit must still be freed.
            unit.module.register_forward_hook(
                lambda _module, args, output, unit=unit: self._after_forward(unit, args, output), always_call=True)

    # -- gathering -------------------------------------------------------------

    def _groups(self, indices: Sequence[int]) -> list[list[int]]:
        """``indices`` split by dtype (one all-gather each), in order."""
        groups: dict[torch.dtype, list[int]] = {}
        for i in indices:
            groups.setdefault(self.shards[i].dtype, []).append(i)
        return list(groups.values())

    def _start_gather(self, indices: Sequence[int]) -> list[tuple[list[int], object, torch.Tensor]]:
        started = []
        for group in self._groups(indices):
            own = torch.cat([self.shards[i] for i in group])
            out = torch.empty(own.numel() * self.dp_size, dtype=own.dtype, device=own.device)
            started.append((group, collectives.all_gather_single(out, own, group=self.dp_group, async_op=True), out))
        return started

    def _install(self, started) -> None:
        """Wait for gathers and write them into the parameters' storages (allocated where freed)."""
        for group, handle, out in started:
            handle.wait()
            rows = out.view(self.dp_size, -1)
            offset = 0
            for i in group:
                param, size = self.params[i], self.shards[i].numel()
                storage = param.data.untyped_storage()
                needed = param.numel() * param.element_size()
                if storage.nbytes() != needed:
                    storage.resize_(needed)
                whole = rows[:, offset:offset + size].reshape(-1)[:param.numel()]
                # Through .data: autograd's saved references to the parameter stay valid (no version bump).
                param.data.copy_(whole.view(param.shape))
                offset += size

    def _acquire(self, units: Sequence[Unit]) -> None:
        """Hold ``units``' parameters whole, gathering the ones that are not (or taking a prefetch)."""
        for unit in units:
            started = self._prefetched.pop((unit.chunk, unit.index), None)
            if started is None and any(self._holds[i] == 0 for i in unit.params):
                started = self._start_gather(unit.params)
            if started is not None:
                self._install(started)
            for i in unit.params:
                self._holds[i] += 1
                if self._holds[i] == 1:
                    self._gathered_bytes += self._nbytes[i]
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._gathered_bytes)

    def _release(self, units: Sequence[Unit]) -> None:
        for unit in units:
            for i in unit.params:
                self._holds[i] -= 1
                if self._holds[i] == 0:
                    self.params[i].data.untyped_storage().resize_(0)
                    self._gathered_bytes -= self._nbytes[i]

    def _prefetch(self, chunk: int, index: int) -> None:
        unit = self._unit_at.get((chunk, index))
        if unit is None or (chunk, index) in self._prefetched or all(self._holds[i] > 0 for i in unit.params):
            return
        self._prefetched[(chunk, index)] = self._start_gather(unit.params)

    def _drop_prefetches(self) -> None:
        for started in self._prefetched.values():
            for _, handle, _ in started:
                handle.wait()  # a collective in flight is finished on every rank, used or not
        self._prefetched.clear()

    def shard_bytes(self) -> int:
        """Bytes of this rank's pieces."""
        return sum(s.numel() * s.element_size() for s in self.shards)

    # -- module hooks ------------------------------------------------------------

    def _before_forward(self, unit: Unit) -> None:
        self._acquire([unit])
        self._prefetch(unit.chunk, unit.index + 1)

    def _after_forward(self, unit: Unit, args, output) -> None:
        self._release([unit])
        if not torch.is_grad_enabled():
            return
        # Outputs the unit computed: a tensor passed through unchanged gets its gradient only after the
        # units that consumed it, too late to announce this unit's backward.
        passed = {id(leaf) for leaf in pytree.tree_leaves(args)}
        for leaf in pytree.tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad and id(leaf) not in passed:
                leaf.register_hook(lambda _grad, unit=unit: self._before_backward(unit))

    def _before_backward(self, unit: Unit) -> None:
        if unit in self._backward_held:
            return
        done = [u for u in self._backward_held if u.chunk == unit.chunk and u.index > unit.index]
        self._release(done)
        self._backward_held = [u for u in self._backward_held if u not in done]
        self._acquire([unit])
        self._backward_held.append(unit)
        self._prefetch(unit.chunk, unit.index - 1)

    # -- instructions (a PipelineHook of the executor) -----------------------------

    def on_instruction_begin(self, event: InstructionEvent) -> None:
        if event.name == "backward_weight":
            held = self._by_chunk.get(event.chunk, [])
            self._acquire(held)
            self._instruction_held.extend(held)

    def on_instruction_end(self, event: InstructionEvent) -> None:
        self.settle()

    def settle(self) -> None:
        """Free everything an instruction held and finish unused prefetches."""
        self._release(self._backward_held + self._instruction_held)
        self._backward_held, self._instruction_held = [], []
        self._drop_prefetches()

    def check_freed(self) -> None:
        """Raise if a parameter is still held whole: the step would change its piece under a stale copy."""
        held = [i for i, count in enumerate(self._holds) if count]
        if held:
            raise RuntimeError(f"ZeRO-3: {len(held)} parameters are still gathered at the optimizer step "
                               f"(first: index {held[0]}, shape {tuple(self.params[held[0]].shape)})")

    # -- whole parameters outside the schedule -------------------------------------

    @contextlib.contextmanager
    def whole(self, *, write_back: bool = False, piece_range=None) -> Iterator[None]:
        """Every parameter whole inside the block (a collective on the data-parallel group: every replica
        enters it). ``write_back``: the block changed them (e.g. loaded a checkpoint); keep this rank's
        pieces of the new values, ``piece_range(i)`` giving the owned ``(start, stop)`` of parameter ``i``."""
        every = Unit(chunk=-1, index=0, module=nn.Module(), params=tuple(range(len(self.params))))
        self._acquire([every])
        try:
            yield
            if write_back:
                with torch.no_grad():
                    for i, param in enumerate(self.params):
                        start, stop = piece_range(i)
                        self.shards[i][:stop - start].copy_(param.detach().reshape(-1)[start:stop])
        finally:
            self._release([every])
