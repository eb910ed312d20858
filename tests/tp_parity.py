"""Tensor-parallel workers' losses and gradients against a single-process reference.

Each worker saves its records with :func:`save_worker`; :func:`compare_workers`
checks every rank's loss and gradients against the reference run
(microbatch_reference.train_microbatches). A worker's gradient of a sliced
parameter is its slice of the reference gradient
(merak.core.slices records which slice).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from merak.core.slices import parameter_slices

LOSS_RTOL = 1e-6
GRAD_RTOL = 5e-6


def save_worker(out_dir: str, rank: int, model, results: list, changes: int) -> None:
    """Write this rank's per-step records (:func:`step_record`) and which parameters it holds slices of."""
    torch.save({"records": results, "slices": parameter_slices(model), "changes": changes},
               Path(out_dir) / f"rank{rank}.pt")


def step_record(engine, result) -> dict:
    """One step's loss and gradients, read right after ``engine.train_step``."""
    grads = {n: p.grad.detach().clone() for n, p in engine.named_parameters() if p.grad is not None}
    return {"loss": result.loss, "grads": grads}


def compare_workers(out_dir, world_size: int, reference: list[dict], case: str) -> set[str]:
    """Assert every rank matches ``reference``; returns the names of the parameters that were split."""
    seen, sliced = set(), set()
    for rank in range(world_size):
        saved = torch.load(Path(out_dir) / f"rank{rank}.pt", weights_only=False)
        assert saved["changes"] > 0, case
        for step, (got, want) in enumerate(zip(saved["records"], reference, strict=True)):
            where = f"{case} rank {rank} step {step}"
            assert got["loss"] == pytest.approx(want["loss"], rel=LOSS_RTOL), where
            for param_name, grad in got["grads"].items():
                expected = want["grads"][param_name]
                if param_name in saved["slices"]:
                    expected = saved["slices"][param_name].take(expected)
                    sliced.add(param_name)
                assert grad.shape == expected.shape, f"{where}: gradient of {param_name}"
                # Relative to the gradient, with a floor: attention key biases get ~1e-11 gradients.
                error = float((grad - expected).norm() / expected.norm().clamp_min(1e-4))
                assert error < GRAD_RTOL, f"{where}: gradient of {param_name} off by {error:.2e}"
                seen.add(param_name)
    assert seen == set(reference[0]["grads"]), case
    assert sliced, f"{case}: no parameter was split"
    return sliced
