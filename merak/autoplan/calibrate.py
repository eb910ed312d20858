"""A few seconds of measurement that anchor the cost model to this machine and this model.

The rates of a device (FLOP/s, bytes/s, seconds per operation) price matrix products and memory
traffic well, but not everything a training step runs: the loss in float32, allocator traffic,
autograd's bookkeeping. On the machine at hand the model itself is timed: one process runs the
recipe's model, loss and backward on real weights for a few microbatches, and the ratio of that time
to the rate-based estimate scales every compute cost. The optimizer step is timed the same way.
Only for models small enough to build here (GPU presets plan giant models from their rates alone).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from merak.assemble import CallModel, default_input_names
from merak.autoplan.cost import BACKWARD_FACTOR
from merak.autoplan.profile import GraphProfile
from merak.shard.costs import LOSS_OPS, LOSS_PASSES_BACKWARD, LOSS_PASSES_FORWARD, MachineRates

logger = logging.getLogger(__name__)

MAX_CALIBRATED_PARAMETERS = 300_000_000
REPEATS = 3


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Measured over estimated compute time, and the optimizer's seconds per parameter."""

    compute_scale: float = 1.0
    optimizer_seconds_per_parameter: float | None = None
    micro_batch_size: int = 0
    measured_step_s: float = 0.0


def estimated_seconds(profile: GraphProfile, rates: MachineRates) -> float:
    """Forward, loss and backward of the profiled model at the profile's microbatch, from the rates."""
    forward = sum(rates.seconds(f, b, o) for f, b, o in zip(profile.flops, profile.bytes_moved, profile.ops))
    loss = rates.seconds(0, (LOSS_PASSES_FORWARD + LOSS_PASSES_BACKWARD) * profile.output_bytes, 2 * LOSS_OPS)
    return forward * (1 + BACKWARD_FACTOR) + loss


def _best_of(function, repeats: int) -> float:
    function()  # warm-up: allocator, lazy initialization
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - started)
    return best


def measure(spec, settings, profile: GraphProfile, rates: MachineRates, *, threads: int = 1) -> Calibration:
    """Time the recipe's model on one process at ``profile``'s microbatch and compare with the estimate."""
    model_cfg = settings.model_cfg
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(settings.trainer.seed)
        model = spec.build_model(model_cfg)
        count = sum(p.numel() for p in model.parameters())
        if count > MAX_CALIBRATED_PARAMETERS:
            logger.info("not timing %s here (%s parameters): compute costs from the device rates alone",
                        spec.name, f"{count:,}")
            return Calibration()
        model.train()
        prepared = spec.prepare_data(settings.data_cfg, model_cfg)
        dataset = spec.load_dataset(prepared, model_cfg)
        batch = spec.collate([dataset[i % len(dataset)] for i in range(profile.micro_batch_size)])
        names = settings.trainer.input_names or spec.input_names or default_input_names(model, batch)
        runner = CallModel(model, list(names))

        def step() -> None:
            model.zero_grad(set_to_none=True)
            spec.loss_fn(runner(batch), batch).backward()

        seconds = _best_of(step, REPEATS)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        optimizer_seconds = _best_of(optimizer.step, REPEATS)
    finally:
        torch.set_num_threads(previous_threads)
    estimate = estimated_seconds(profile, rates)
    scale = seconds / estimate if estimate > 0 else 1.0
    logger.info("timed %s at microbatch %d: %.1f ms for forward, loss and backward (%.2fx the estimate); "
                "optimizer step %.1f ms", spec.name, profile.micro_batch_size, seconds * 1e3, scale,
                optimizer_seconds * 1e3)
    return Calibration(compute_scale=scale, optimizer_seconds_per_parameter=optimizer_seconds / max(count, 1),
                       micro_batch_size=profile.micro_batch_size, measured_step_s=seconds)
