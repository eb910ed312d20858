"""A worker's energy features: its GPU device, the listeners it adds to the pipeline, its report.

:func:`start_energy` reads the trainer settings; the worker passes ``runtime.hooks`` to the
engine, and at the end calls :meth:`EnergyRuntime.summary` (collective) and
:meth:`EnergyRuntime.close`. The listeners learn everything about an instruction (its name and
FLOPs) from the executor's instruction events.
"""

from __future__ import annotations

import logging
import statistics

import torch

from merak.distributed import groups
from merak.energy.device import GPUDevice
from merak.energy.hooks import FrequencyPlanHook, InstructionMeter, SimulatedCompute
from merak.energy.settings import energy_enabled
from merak.energy.simulated import SimulatedGPU
from merak.pipeline.hooks import PipelineHook

logger = logging.getLogger(__name__)


def make_device(trainer, device: torch.device) -> GPUDevice:
    """The GPU backend ``trainer.energy_device`` names (auto: NVML on CUDA machines, else simulated)."""
    choice = trainer.energy_device
    if choice == "auto":
        choice = "nvml" if device.type == "cuda" else "simulated"
        if choice == "simulated":
            logger.info("no GPU: energy features run on a simulated %s", trainer.simulated_gpu)
    if choice == "nvml":
        from merak.energy.nvml import NVMLDevice

        index = device.index if device.index is not None else 0
        return NVMLDevice(index, cuda_index=index)
    return SimulatedGPU(trainer.simulated_gpu)


class EnergyRuntime:
    """This worker's device and energy listeners.

    Args:
        trainer: the trainer settings.
        state: the worker's parallel state.
        device: the GPU backend (default: :func:`make_device`).
    """

    def __init__(self, trainer, state, device: GPUDevice | None = None) -> None:
        self.trainer, self.state = trainer, state
        self.device = device if device is not None else make_device(trainer, state.device)
        self.meter = InstructionMeter(self.device)
        self.zeus = None
        controls: list[PipelineHook] = []
        if trainer.frequency_plan:
            from merak.energy.plans import read_plan

            stage = state.coordinates.pp
            controls.append(FrequencyPlanHook(self.device, read_plan(trainer.frequency_plan)[stage], stage))
        elif trainer.pfo_server_url:
            from merak.energy.zeus_client import ZeusClient

            self.zeus = ZeusClient(trainer, state, self.device, self.meter)
            controls.append(self.zeus.control)
        simulated = [SimulatedCompute(self.device, trainer.simulated_tflops * 1e12)] \
            if isinstance(self.device, SimulatedGPU) else []
        reporters = [self.zeus.reporter] if self.zeus is not None else []
        self.hooks: list[PipelineHook] = [*controls, *simulated, self.meter, *reporters]

    def summary(self, skip_steps: int = 1) -> dict | None:
        """Mean step time and energy per rank (after ``skip_steps`` warm-up steps) and the job's
        iteration energy (all ranks' sum). Collective; rank 0 gets the dict, others None."""
        steps = self.meter.steps[skip_steps:] or self.meter.steps
        local = {"rank": self.state.rank, "stage": self.state.coordinates.pp, "device": self.device.name,
                 "steps": len(steps),
                 "step_time_s": statistics.fmean(s.time for s in steps) if steps else None,
                 "step_energy_j": statistics.fmean(s.energy for s in steps) if steps else None,
                 "overruns": getattr(self.device, "overruns", 0)}
        everyone = groups.gather_from_all(local)
        if self.state.rank != 0:
            return None
        measured = [r for r in everyone if r["steps"]]
        return {"device": self.device.name, "measured_steps": local["steps"],
                "iteration_time_s": max((r["step_time_s"] for r in measured), default=None),
                "iteration_energy_j": sum(r["step_energy_j"] for r in measured) if measured else None,
                "plan": self.trainer.frequency_plan, "pfo_server_url": self.trainer.pfo_server_url,
                "zeus_job_id": self.zeus.job_id if self.zeus is not None else None,
                "ranks": sorted(everyone, key=lambda r: r["rank"])}

    def close(self) -> None:
        """Stop zeus's clock controller (if any) and return the clock to the driver."""
        if self.zeus is not None:
            self.zeus.close()
        self.device.reset_clock()
        self.device.close()


def start_energy(trainer, state) -> EnergyRuntime | None:
    """The worker's EnergyRuntime, or None when the run uses no energy feature."""
    return EnergyRuntime(trainer, state) if energy_enabled(trainer) else None


__all__ = ["EnergyRuntime", "make_device", "start_energy"]
