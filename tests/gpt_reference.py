"""The single-process GPT-2 run every parallel layout is compared against."""

from __future__ import annotations

import torch

from merak.data.batching import BatchPlan, stack_samples
from merak.optim.schedule import build_lr_scheduler, build_optimizer
from merak.optim.settings import OptimizerSettings
from recipes.gpt import data, model

# The optimizer of the layout parity tests: clipping is active on the first step, warm-up then cosine.
PARITY_OPTIONS = OptimizerSettings(learning_rate=1e-3, weight_decay=0.01, max_grad_norm=1.0, lr_scheduler_type="cosine",
                                   warmup_steps=1)


def train_reference(model_cfg, tokens: str, *, options: OptimizerSettings, steps: int, global_batch: int,
                    seed: int) -> list[dict]:
    """Loss, exact gradient norm and clipped gradients of each step of the plain Hugging Face model."""
    torch.manual_seed(seed)
    full = model.build_model(model_cfg)
    dataset = data.load(tokens, model_cfg)
    plan = BatchPlan(num_samples=len(dataset), micro_batch_size=global_batch, num_microbatches=1, seed=seed)
    optimizer = build_optimizer(full.named_parameters(), options)
    scheduler = build_lr_scheduler(optimizer, options, total_steps=steps)
    records = []
    for step in range(steps):
        batch = stack_samples([dataset[i] for i in plan.global_batch(step).tolist()])
        optimizer.zero_grad(set_to_none=True)
        loss = model.causal_lm_loss(full(input_ids=batch["input_ids"]).logits, batch)
        loss.backward()
        # The exact norm (float64 sums): torch's fp32 norm of a 1.6M-element embedding
        # is itself ~2e-6 off, more than the parity tolerance.
        norm = torch.stack([p.grad.double().pow(2).sum() for p in full.parameters()]).sum().sqrt()
        torch.nn.utils.clip_grads_with_norm_(full.parameters(), options.max_grad_norm, norm.float())
        records.append({"loss": loss.item(), "grad_norm": float(norm),
                        "grads": {n: p.grad.detach().clone() for n, p in full.named_parameters()}})
        optimizer.step()
        scheduler.step()
    return records


def vocab_padded(model_cfg):
    """The toy config with a vocabulary divisible by tp (GPT-2's 50257 is prime to 2)."""
    from omegaconf import OmegaConf

    return OmegaConf.merge(model_cfg, {"vocab_size": 50304})


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def assert_steps_match(records: list[dict], reference: list[dict], where: str, *, loss_rtol: float,
                       grad_rtol: float) -> set[str]:
    """Every step's loss, gradient norm and each held gradient equal the reference's; returns the
    names of the gradients checked (a rank holds only its stage's)."""
    import pytest

    assert len(records) == len(reference), where
    seen = set()
    for step, (got, want) in enumerate(zip(records, reference, strict=True)):
        at = f"{where} step {step}"
        assert got["loss"] == pytest.approx(want["loss"], rel=loss_rtol), at
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=loss_rtol), at
        for name, grad in got["grads"].items():
            error = relative_error(grad, want["grads"][name])
            assert error < grad_rtol, f"{at}: gradient of {name} off by {error:.2e}"
            seen.add(name)
    return seen
