"""What each rank holds, named by the full model: weights (tensor-parallel slices) and optimizer pieces."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from merak.core.slices import TensorSlice

MASTER = "master"


def slice_to_json(spec: TensorSlice | None) -> list | None:
    return None if spec is None else [spec.dim, spec.rank, spec.size, spec.parts]


def slice_from_json(value: list | None, full_shape) -> TensorSlice | None:
    if value is None:
        return None
    dim, rank, size, parts = value
    return TensorSlice(dim, rank, size, parts, tuple(full_shape))


def join_slices(pieces: dict[int, torch.Tensor], spec: TensorSlice) -> torch.Tensor:
    """The full tensor from every tensor-parallel rank's piece (the inverse of TensorSlice.take)."""
    missing = sorted(set(range(spec.size)) - set(pieces))
    if missing:
        raise KeyError(f"tensor-parallel pieces {missing} of {spec.size} are missing")
    blocks = [pieces[rank].chunk(spec.parts, dim=spec.dim) for rank in range(spec.size)]
    return torch.cat([torch.cat([b[part] for b in blocks], dim=spec.dim) for part in range(spec.parts)],
                     dim=spec.dim)


@dataclass(frozen=True)
class WeightEntry:
    """A tensor of the full model as one rank holds it."""

    name: str
    tensor: torch.Tensor
    slice: TensorSlice | None

    @property
    def full_shape(self) -> list[int]:
        return list(self.slice.full_shape) if self.slice else list(self.tensor.shape)


def weight_entries(engine) -> list[WeightEntry]:
    """The tensors this rank writes: parameters and persistent buffers it is the primary holder of
    (tied copies on their first stage, replicated tensors on tensor-parallel rank 0)."""
    out = []
    for name, tensor in [*engine.named_parameters(), *engine.named_buffers()]:
        if name in engine.primary_names:
            out.append(WeightEntry(name, tensor.detach(), engine.slices.get(name)))
    return out


def weights_file(entries: list[WeightEntry]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and safetensors metadata of one rank's weights file."""
    meta = {e.name: {"slice": slice_to_json(e.slice), "full_shape": e.full_shape} for e in entries}
    return {e.name: e.tensor.contiguous() for e in entries}, {"merak": json.dumps(meta)}


def optimizer_file(engine) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """This rank's optimizer pieces: per primary trainable parameter, the owned flat range of its
    (tensor-parallel local) master weights and of every optimizer state tensor (empty on
    data-parallel replicas other than the first when nothing is sharded)."""
    optimizer = engine.optimizer
    names = engine.trainable_names
    tensors, meta = {}, {}
    if not optimizer.sharded and engine.state.coordinates.dp != 0:
        return tensors, meta  # data-parallel replicas hold the same state: replica 0 writes it
    for i, (param, master, piece) in enumerate(zip(optimizer.params, optimizer.master, optimizer.pieces)):
        name = names[i]
        if name not in engine.primary_names:
            continue
        states = {}
        if optimizer.copies:
            states[MASTER] = master.detach()
        for key, value in optimizer.optimizer.state.get(master, {}).items():
            if isinstance(value, torch.Tensor):
                states[key] = value.detach()
        scalars = sorted(key for key, value in states.items() if value.dim() == 0)
        for key, value in states.items():  # scalars (AdamW's step) stored as one-element tensors
            tensors[f"{name}/{key}"] = value.reshape(-1).contiguous()
        spec = engine.slices.get(name)
        meta[name] = {"start": piece.start, "stop": piece.stop, "local_shape": list(param.shape),
                      "slice": slice_to_json(spec),
                      "full_shape": list(spec.full_shape) if spec else list(param.shape),
                      "scalars": scalars, "states": sorted(set(states) - set(scalars))}
    return tensors, {"merak": json.dumps(meta)}
