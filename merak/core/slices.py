"""How a tensor-parallel rank's parameters relate to the full model's.

A sharded parameter remembers its :class:`TensorSlice` (in its module's
``_merak_tp_slices``), so that weights initialized at full size, loaded from a
full checkpoint, or saved for another layout map to and from the rank-local
piece exactly. A replicated parameter whose gradient is only a partial sum over
the tensor-parallel group (sequence parallelism, per-head norms) carries a mark
(:func:`mark_partial`) that the engine reads to sum it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

SLICES_ATTR = "_merak_tp_slices"
PARTIAL_GRADIENT_ATTR = "_merak_sequence_partial"


@dataclass(frozen=True)
class TensorSlice:
    """Rank ``rank`` of ``size`` holds one chunk along ``dim`` of each of ``parts`` equal blocks.

    ``parts`` > 1 describes fused weights such as GPT-2's ``c_attn`` (query, key
    and value stacked along the output features): every rank keeps its heads of
    each of the three blocks.
    """

    dim: int
    rank: int
    size: int
    parts: int = 1
    full_shape: tuple[int, ...] = ()

    def local_shape(self, full_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(full_shape)
        shape[self.dim] //= self.size
        return tuple(shape)

    def problem(self, full_shape: tuple[int, ...]) -> str | None:
        """Why ``full_shape`` cannot be sliced this way (None when it can)."""
        if self.dim >= len(full_shape):
            return f"has {len(full_shape)} dimensions, cannot split dimension {self.dim}"
        extent = full_shape[self.dim]
        if extent % (self.parts * self.size):
            blocks = f" in {self.parts} fused blocks" if self.parts > 1 else ""
            return f"dimension {self.dim} of size {extent}{blocks} is not divisible by tp={self.size}"
        return None

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of ``full`` (a new contiguous tensor)."""
        blocks = full.chunk(self.parts, dim=self.dim)
        return torch.cat([block.chunk(self.size, dim=self.dim)[self.rank] for block in blocks],
                         dim=self.dim).contiguous()


def slices_of(module: nn.Module) -> dict[str, TensorSlice]:
    """The sliced parameters and buffers of ``module`` (its own, not its children's)."""
    return getattr(module, SLICES_ATTR, {})


def record_slice(module: nn.Module, name: str, spec: TensorSlice) -> None:
    """Remember that ``module``'s tensor ``name`` is the piece ``spec`` of the full tensor."""
    if SLICES_ATTR not in module.__dict__:
        setattr(module, SLICES_ATTR, {})
    getattr(module, SLICES_ATTR)[name] = spec


def slice_tensor_(module: nn.Module, name: str, spec: TensorSlice,
                  memo: dict[int, tuple[nn.Parameter, TensorSlice, torch.Tensor]]) -> None:
    """Replace parameter or buffer ``name`` of ``module`` by this rank's piece and record how.

    A meta tensor gets a meta piece of the local shape (materialized later
    from a full-size initialization). ``memo`` maps (the ids of) parameters
    already sliced to their pieces and slices (and the originals, which keeps the
    ids valid), so a tied weight (an embedding and its output layer) stays one
    parameter.
    """
    tensor = getattr(module, name)
    spec = TensorSlice(spec.dim, spec.rank, spec.size, spec.parts, tuple(tensor.shape))
    record_slice(module, name, spec)
    if id(tensor) in memo:
        piece, first, _ = memo[id(tensor)]
        if first != spec:
            raise ValueError(f"{name} of {type(module).__name__} is shared with another layer the plan splits "
                             f"differently ({first} vs {spec})")
        module._parameters[name] = piece
        return
    if tensor.device.type == "meta":
        piece = torch.empty(spec.local_shape(tensor.shape), dtype=tensor.dtype, device="meta")
    else:
        piece = spec.take(tensor.detach())
    if isinstance(tensor, nn.Parameter):
        module._parameters[name] = nn.Parameter(piece, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = (module._parameters[name], spec, tensor)
    else:
        module._buffers[name] = piece


def sliced_parameter_ids(model: nn.Module) -> set[int]:
    """ids of the parameters of ``model`` that are tensor-parallel slices (the others are replicated)."""
    return {id(module._parameters[name]) for module in model.modules() for name in slices_of(module)
            if module._parameters.get(name) is not None}


def parameter_slices(model: nn.Module) -> dict[str, TensorSlice]:
    """Qualified parameter name -> its slice, for every tensor-parallel parameter of ``model``."""
    out = {}
    for module_name, module in model.named_modules():
        for name, spec in slices_of(module).items():
            if module._parameters.get(name) is not None:
                out[f"{module_name}.{name}" if module_name else name] = spec
    return out


def tensor_slices(model: nn.Module) -> dict[str, TensorSlice]:
    """Qualified name -> slice, for every tensor-parallel parameter and buffer of ``model``."""
    out = {}
    for module_name, module in model.named_modules():
        for name, spec in slices_of(module).items():
            out[f"{module_name}.{name}" if module_name else name] = spec
    return out


def mark_partial(param: nn.Parameter) -> None:
    """Record that ``param``'s gradient is a partial sum over the tp group (the engine sums it)."""
    setattr(param, PARTIAL_GRADIENT_ATTR, True)


def sequence_partial(param: nn.Parameter) -> bool:
    """True when ``param``'s gradient is a partial sum over the tp group: over the sequence
    chunks (sequence parallelism) or over the heads (a per-head norm, ``TPPlan.partial``)."""
    return getattr(param, PARTIAL_GRADIENT_ATTR, False)
