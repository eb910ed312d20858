"""The single-process run a multi-process test compares with: one model, the same microbatches."""

from __future__ import annotations

import torch

from merak.optim.schedule import build_lr_scheduler, build_optimizer
from merak.optim.settings import OptimizerSettings


def train_microbatches(model, loss_fn, data: list[dict], *, steps: int, microbatches: int,
                       options: OptimizerSettings) -> list[dict]:
    """Per step: the summed microbatch loss and the clipped gradients (constant learning rate).

    One thread, as the workers: convolution kernels sum in a thread-dependent order.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(model, loss_fn, data, steps=steps, microbatches=microbatches, options=options)
    finally:
        torch.set_num_threads(threads)


def _train(model, loss_fn, data, *, steps, microbatches, options) -> list[dict]:
    model.train()
    params = list({id(p): p for p in model.parameters()}.values())
    optimizer = build_optimizer(model.named_parameters(), options)
    scheduler = build_lr_scheduler(optimizer, OptimizerSettings(lr_scheduler_type="constant"), total_steps=steps)
    records = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for batch in data[step * microbatches:(step + 1) * microbatches]:
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            loss = loss_fn(model(**inputs), batch) / microbatches
            loss.backward()
            total += loss.item()
        norm = torch.stack([p.grad.double().pow(2).sum() for p in params if p.grad is not None]).sum().sqrt()
        torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None], options.max_grad_norm,
                                             norm.float())
        # The engine's gradients are read after its step, so clipped: compare clipped with clipped.
        records.append({"loss": total, "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                                 if p.grad is not None}})
        optimizer.step()
        scheduler.step()
    return records
