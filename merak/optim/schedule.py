"""Optimizer construction and learning-rate schedules (the Hugging Face Trainer's defaults)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

LR_SCHEDULES = ("linear", "cosine", "constant", "constant_with_warmup")


OPTIMIZERS = ("adamw_torch", "sgd", "adafactor")
# Elementwise optimizers update a flat shard of a tensor exactly as they update the whole tensor,
# so ZeRO may cut parameters anywhere; the others need zero_allow_untested_optimizer.
ZERO_TESTED_OPTIMIZERS = ("adamw_torch", "sgd")


def build_optimizer(named_params: Iterable[tuple[str, nn.Parameter]], *, learning_rate: float,
                    weight_decay: float, betas: tuple[float, float], eps: float,
                    kind: str = "adamw_torch") -> torch.optim.Optimizer:
    """The optimizer of a whole model: weight decay on matrices only (biases and norm weights are not decayed)."""
    return make_optimizer([(p, p.ndim >= 2) for _, p in named_params if p.requires_grad], kind=kind,
                          learning_rate=learning_rate, weight_decay=weight_decay, betas=betas, eps=eps)


def make_optimizer(params: Iterable[tuple[torch.Tensor, bool]], *, kind: str, learning_rate: float,
                   weight_decay: float, betas: tuple[float, float], eps: float) -> torch.optim.Optimizer:
    """The ``kind`` optimizer (Hugging Face ``optim`` names) over ``(tensor, decays)`` pairs.

    ``decays`` says whether weight decay applies; it is passed separately because
    the tensors may be flat shards of the parameters they update.
    """
    decay, no_decay = [], []
    for tensor, decays in params:
        (decay if decays else no_decay).append(tensor)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if kind == "adamw_torch":
        # On the GPU one fused kernel updates every tensor (torch's own default there is foreach).
        tensors = decay + no_decay
        fused = bool(tensors) and all(t.is_cuda and t.is_floating_point() for t in tensors)
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, eps=eps, **({"fused": True} if fused else {}))
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=learning_rate)
    if kind == "adafactor":
        return torch.optim.Adafactor(groups, lr=learning_rate)
    raise ValueError(f"unknown optim {kind!r}; choose one of {', '.join(OPTIMIZERS)}")


def lr_factor(step: int, *, kind: str, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the base learning rate at ``step`` (0-based)."""
    if kind not in LR_SCHEDULES:
        raise ValueError(f"unknown lr_scheduler_type {kind!r}; choose one of {', '.join(LR_SCHEDULES)}")
    if kind == "constant":
        return 1.0
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    if kind == "constant_with_warmup":
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if kind == "linear":
        return max(0.0, 1.0 - progress)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, *, kind: str, warmup_steps: int,
                       total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR following :func:`lr_factor`."""
    lr_factor(0, kind=kind, warmup_steps=warmup_steps, total_steps=total_steps)  # validates kind
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, kind=kind, warmup_steps=warmup_steps, total_steps=total_steps)
    )
