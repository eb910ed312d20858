"""Optimizer construction and learning-rate schedules (the Hugging Face Trainer's defaults), from the
optimizer section of the config (merak.optim.settings.OptimizerSettings)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from merak.optim.settings import LR_SCHEDULES, OPTIMIZERS, OptimizerSettings


def build_optimizer(named_params: Iterable[tuple[str, nn.Parameter]],
                    settings: OptimizerSettings) -> torch.optim.Optimizer:
    """The optimizer of a whole model: weight decay on matrices only (biases and norm weights are not decayed)."""
    return make_optimizer([(p, p.ndim >= 2) for _, p in named_params if p.requires_grad], settings)


def make_optimizer(params: Iterable[tuple[torch.Tensor, bool]], settings: OptimizerSettings) -> torch.optim.Optimizer:
    """The ``settings.optim`` optimizer (Hugging Face ``optim`` names) over ``(tensor, decays)`` pairs.

    ``decays`` says whether weight decay applies; it is passed separately because
    the tensors may be flat shards of the parameters they update.
    """
    kind, learning_rate, weight_decay = settings.optim, settings.learning_rate, settings.weight_decay
    betas, eps = (settings.adam_beta1, settings.adam_beta2), settings.adam_epsilon
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


def lr_factor(step: int, settings: OptimizerSettings, total_steps: int) -> float:
    """Multiplier of the base learning rate at ``step`` (0-based) of a run of ``total_steps``."""
    kind, warmup_steps = settings.lr_scheduler_type, settings.warmup_steps_for(total_steps)
    if kind not in LR_SCHEDULES:
        raise ValueError(f"unknown lr_scheduler_type {kind!r}; choose one of {', '.join(LR_SCHEDULES)}")
    if kind == "constant":
        return 1.0
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    if kind == "constant_with_warmup":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    decay = 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    floor = settings.min_lr_rate
    return floor + (1.0 - floor) * max(0.0, decay)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, settings: OptimizerSettings, *,
                       total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR following :func:`lr_factor`."""
    lr_factor(0, settings, total_steps)  # validates the schedule's name
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, settings, total_steps))
