"""LoRA adapters through peft: inject before the model is split, save and load them alone.

``lora_config`` is either a JSON file of ``peft.LoraConfig`` fields (a new adapter)
or a directory written by :func:`save_adapter` / peft's ``save_pretrained`` (the
adapter's config and weights, to train further). Only adapter weights require
gradients, so the optimizer, ZeRO and checkpoints hold only them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import torch
from torch import nn

from merak.distributed import groups

logger = logging.getLogger(__name__)


def unwrap_peft(model: nn.Module) -> tuple[nn.Module, str]:
    """The model inside a peft wrapper and its name prefix there (``model`` and "" when not wrapped)."""
    base = getattr(model, "get_base_model", None)
    if callable(base) and type(model).__name__.startswith("Peft"):
        inner = base()
        prefix = next(name for name, module in model.named_modules() if module is inner)
        return inner, prefix + "."
    return model, ""


def apply_lora(model: nn.Module, path: str, *, adapter_name: str = "default") -> nn.Module:
    """``model`` wrapped by peft with a LoRA adapter from ``path`` (a JSON config or a saved adapter)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if os.path.isdir(path):
        wrapped = PeftModel.from_pretrained(model, path, adapter_name=adapter_name, is_trainable=True)
        logger.info("loaded LoRA adapter %r from %s", adapter_name, path)
    else:
        with open(path, encoding="utf-8") as handle:
            fields = json.load(handle)
        try:
            config = LoraConfig(**fields)
        except TypeError as error:
            raise ValueError(f"lora_config={path}: {error}") from None
        wrapped = get_peft_model(model, config, adapter_name=adapter_name)
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    total = sum(p.numel() for p in wrapped.parameters())
    logger.info("LoRA: %s of %s parameters are trained (%.2f%%)", f"{trainable:,}", f"{total:,}",
                100.0 * trainable / max(1, total))
    return wrapped


def save_adapter(trainer, directory: str) -> None:
    """Write the trained adapter alone, in peft's layout (adapter_config.json and
    adapter_model.safetensors). Collective: every rank calls it; rank 0 writes, atomically."""
    session = trainer._session()
    engine, coords = session.engine, session.state.coordinates
    mine = {}
    with engine.whole_parameters():
        if coords.dp == 0:
            mine = {name: param.detach().float().cpu() for name, param in engine.named_parameters()
                    if param.requires_grad and name in engine.primary_names}
    pieces = groups.gather_from_all(mine)
    if session.state.rank != 0:
        return
    model = session.model
    values = {name: tensor for piece in pieces for name, tensor in piece.items()}
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, tensor in values.items():
            params[name].copy_(tensor.to(params[name].dtype))
    staging = directory.rstrip("/") + ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, selected_adapters=[trainer.args.adapter_name])
    written = os.path.join(staging, trainer.args.adapter_name) if trainer.args.adapter_name != "default" else staging
    if os.path.isdir(directory):
        shutil.rmtree(directory)
    os.replace(written, directory)
    shutil.rmtree(staging, ignore_errors=True)
    logger.info("saved LoRA adapter %r (%d tensors) to %s", trainer.args.adapter_name, len(values), directory)
