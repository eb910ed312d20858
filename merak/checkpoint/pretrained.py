"""The whole trained model as a Hugging Face directory: from a running job or from a checkpoint.

A rank holds only its pipeline stage, and with tensor parallelism only slices of
its tensors. :func:`gather_weights` brings every full tensor to the main process
(the tensor-parallel slices joined); :func:`write_pretrained` writes them as a
directory ``from_pretrained`` loads (``config.json`` + ``model.safetensors``), or
as ``model.safetensors`` alone for a model that is not a Hugging Face model.
"""

from __future__ import annotations

import importlib
import logging
import os

import torch
from safetensors.torch import save_file

from merak.checkpoint.files import CheckpointError
from merak.checkpoint.tensors import join_slices, weight_entries
from merak.distributed import groups

logger = logging.getLogger(__name__)


def _model_class(info: dict):
    module = info["module"]
    if not module.startswith("transformers."):  # only library classes are imported, never code from a file
        raise CheckpointError(f"the model class comes from {module}, not transformers")
    return getattr(importlib.import_module(module), info["class"])


def gather_weights(engine) -> dict[str, torch.Tensor] | None:
    """Every full tensor of the model (parameters and persistent buffers), by the model's names, on
    rank 0; None on the other ranks. Collective: every rank calls it. Rank 0 needs the whole model's
    size in host memory (for models too large, save a checkpoint and run ``merak-export``)."""
    local = [(e.name, e.tensor.cpu(), e.slice) for e in weight_entries(engine)]
    everyone = groups.gather_to_first(local)
    if everyone is None:
        return None
    whole: dict[str, torch.Tensor] = {}
    pieces: dict[str, dict] = {}
    for entries in everyone:
        for name, tensor, spec in entries:
            if spec is None:
                whole[name] = tensor
            else:
                pieces.setdefault(name, {"spec": spec, "by_rank": {}})["by_rank"][spec.rank] = tensor
    for name, joined in pieces.items():
        whole[name] = join_slices(joined["by_rank"], joined["spec"])
    return whole


def write_pretrained(state: dict[str, torch.Tensor], model_info: dict | None, out_dir: str, *,
                     source: str = "the trained model") -> str:
    """Write ``state`` to ``out_dir`` as ``model_info``'s Hugging Face class saves it; return ``out_dir``.

    Without ``model_info`` (not a Hugging Face model), ``model.safetensors`` holds the tensors by name.

    Raises:
        CheckpointError: the tensors do not fit the model class (a missing or unknown tensor is named).
    """
    os.makedirs(out_dir, exist_ok=True)
    if model_info is None:
        save_file({n: t.contiguous() for n, t in state.items()}, os.path.join(out_dir, "model.safetensors"))
        logger.info("wrote %d tensors to %s (not a Hugging Face model: no config.json)", len(state), out_dir)
        return out_dir
    cls = _model_class(model_info)
    config = cls.config_class.from_dict(model_info["config"])
    with torch.device("meta"):
        model = cls(config)
    _, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected:
        raise CheckpointError(f"{source}: tensors the model does not have: {', '.join(unexpected[:5])}")
    model.tie_weights()
    still_meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if still_meta:
        raise CheckpointError(f"{source} lacks {', '.join(still_meta[:5])}")
    model.save_pretrained(out_dir, safe_serialization=True)
    logger.info("wrote %s (%s, %d tensors) to %s", source, model_info["class"], len(state), out_dir)
    return out_dir


def save_pretrained_model(engine, out_dir: str) -> str | None:
    """Gather the trained model and write it to ``out_dir`` on rank 0 (collective). Returns ``out_dir``
    on rank 0, None elsewhere; every rank raises alike when the write fails."""
    with engine.whole_parameters():
        state = gather_weights(engine)
    problem = None
    if state is not None:
        try:
            write_pretrained(state, engine.model_info, out_dir)
        except (CheckpointError, OSError) as error:
            problem = str(error)
    problem = groups.broadcast_object(problem)
    if problem is not None:
        raise CheckpointError(f"the model was not saved to {out_dir}: {problem}")
    return out_dir if state is not None else None


__all__ = ["gather_weights", "save_pretrained_model", "write_pretrained"]
