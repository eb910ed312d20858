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
from merak.energy.simulated import SimulatedGPU
from merak.pipeline.hooks import PipelineHook

logger = logging.getLogger(__name__)


def make_device(energy, device: torch.device, pipeline: int = 0) -> GPUDevice:
    """The GPU backend ``trainer.energy_device`` names (auto: NVML on CUDA machines, else simulated); a
    simulated GPU of pipeline ``trainer.simulated_straggler_pipeline`` is capped at its straggler clock."""
    choice = energy.energy_device
    if choice == "auto":
        choice = "nvml" if device.type == "cuda" else "simulated"
        if choice == "simulated":
            logger.info("no GPU: energy features run on a simulated %s", energy.simulated_gpu)
    if choice == "nvml":
        from merak.energy.nvml import NVMLDevice

        index = device.index if device.index is not None else 0
        return NVMLDevice(index, cuda_index=index)
    straggler = energy.simulated_straggler_pipeline is not None and energy.simulated_straggler_pipeline == pipeline
    return SimulatedGPU(energy.simulated_gpu, clock_cap=energy.simulated_straggler_clock if straggler else None)


class EnergyRuntime:
    """This worker's device and energy listeners.

    Args:
        trainer: the trainer settings.
        state: the worker's parallel state.
        device: the GPU backend (default: :func:`make_device`).
    """

    def __init__(self, energy, state, device: GPUDevice | None = None) -> None:
        self.energy, self.state = energy, state
        self.device = device if device is not None else make_device(energy, state.device, state.coordinates.dp)
        self.meter = InstructionMeter(self.device)
        self.zeus = None
        self.straggler = None
        controls: list[PipelineHook] = []
        if energy.frequency_plan:
            from merak.energy.plans import read_plan

            stage = state.coordinates.pp
            controls.append(FrequencyPlanHook(self.device, read_plan(energy.frequency_plan)[stage], stage))
        elif energy.frequency_frontier:
            controls.append(self._straggler_aware_plans(energy, state))
        elif energy.pfo_server_url:
            from merak.energy.zeus_client import ZeusClient

            self.zeus = ZeusClient(energy, state, self.device, self.meter)
            controls.append(self.zeus.control)
        simulated = [SimulatedCompute(self.device, energy.simulated_tflops * 1e12)] \
            if isinstance(self.device, SimulatedGPU) else []
        reporters = [self.zeus.reporter] if self.zeus is not None else []
        self.hooks: list[PipelineHook] = [*controls, *simulated, self.meter, *reporters]

    def _straggler_aware_plans(self, energy, state) -> PipelineHook:
        from merak.energy.frontier import read_frontier
        from merak.energy.straggler import StragglerAwarePlans

        frontier = read_frontier(energy.frequency_frontier)
        deadline = energy.frontier_deadline
        base = frontier.index_within(deadline) if deadline is not None else 0
        coords, dp = state.coordinates, state.grid.dp
        self.straggler = StragglerAwarePlans(
            self.device, frontier, self.meter, stage=coords.pp, pipeline=coords.dp, pipelines=dp, base=base,
            window=energy.straggler_window if dp > 1 else 0, hysteresis=energy.straggler_hysteresis,
            margin=energy.straggler_margin)
        return self.straggler

    def summary(self, skip_steps: int = 1) -> dict | None:
        """Mean step time and energy per rank (after ``skip_steps`` warm-up steps, and since the last
        change of frontier point) and the job's iteration energy (all ranks' sum); with a frontier,
        each pipeline's measurement beside the prediction of the point it ran. Collective; rank 0
        gets the dict, others None."""
        first = max(skip_steps, self.straggler.since_step if self.straggler is not None else 0)
        steps = self.meter.steps[first:] or self.meter.steps[-1:]
        coords = self.state.coordinates
        local = {"rank": self.state.rank, "stage": coords.pp, "pipeline": coords.dp, "device": self.device.name,
                 "steps": len(steps),
                 "step_time_s": statistics.fmean(s.time for s in steps) if steps else None,
                 "step_energy_j": statistics.fmean(s.energy for s in steps) if steps else None,
                 "compute_span_s": statistics.fmean(s.compute_span for s in steps) if steps else None,
                 "overruns": getattr(self.device, "overruns", 0)}
        everyone = groups.gather_from_all(local)
        if self.state.rank != 0:
            return None
        measured = [r for r in everyone if r["steps"]]
        report = {"device": self.device.name, "measured_steps": local["steps"],
                  "iteration_time_s": max((r["step_time_s"] for r in measured), default=None),
                  "iteration_energy_j": sum(r["step_energy_j"] for r in measured) if measured else None,
                  "plan": self.energy.frequency_plan, "pfo_server_url": self.energy.pfo_server_url,
                  "zeus_job_id": self.zeus.job_id if self.zeus is not None else None,
                  "ranks": sorted(everyone, key=lambda r: r["rank"])}
        if self.straggler is not None and measured:
            report.update(self._frontier_report(measured, report["iteration_time_s"]))
        return report

    def _frontier_report(self, measured: list[dict], step_time: float) -> dict:
        """Per pipeline: the point it ran, the measured time and energy, and the point's predictions,
        both for its own step and stretched to the job's step (waiting for a straggler)."""
        # Every tensor-parallel rank of a stage is a GPU running the stage's plan.
        frontier, tp = self.straggler.frontier, self.state.grid.tp
        pipelines = []
        for pipeline, point in enumerate(self.straggler.switcher.current):
            ranks = [r for r in measured if r["pipeline"] == pipeline]
            time_s = max(r["step_time_s"] for r in ranks)
            energy_j = sum(r["step_energy_j"] for r in ranks)
            predicted_time = frontier.points[point].iteration_time
            predicted_energy = tp * frontier.points[point].energy
            stretched_energy = tp * frontier.energy_at(point, step_time)
            pipelines.append({
                "pipeline": pipeline, "point": point, "step_time_s": time_s, "step_energy_j": energy_j,
                "compute_span_s": max(r["compute_span_s"] for r in ranks),
                "predicted_step_time_s": predicted_time, "predicted_step_energy_j": predicted_energy,
                "predicted_energy_at_job_step_j": stretched_energy,
                "time_error": time_s / predicted_time - 1, "energy_error": energy_j / predicted_energy - 1,
                "energy_error_at_job_step": energy_j / stretched_energy - 1})
        return {"frontier": self.energy.frequency_frontier, "base_point": self.straggler.switcher.base,
                "straggler_target_s": self.straggler.switcher.target,
                "switches": [vars(s) for s in self.straggler.switches], "pipelines": pipelines}

    def close(self) -> None:
        """Stop zeus's clock controller (if any) and return the clock to the driver."""
        if self.zeus is not None:
            self.zeus.close()
        self.device.reset_clock()
        self.device.close()


def start_energy(energy, state) -> EnergyRuntime | None:
    """The worker's EnergyRuntime, or None when the run uses no energy feature."""
    return EnergyRuntime(energy, state) if energy.enabled else None


__all__ = ["EnergyRuntime", "make_device", "start_energy"]
