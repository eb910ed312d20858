"""A worker's energy measurement and features: its GPU device, the listeners it adds to the pipeline,
its reports.

:func:`start_energy` reads the trainer settings and gives an :class:`EnergyRuntime` where the run
measures (an energy feature, an explicit device, or ``auto`` where NVML answers), else an
:class:`EnergyOff` that says why. The worker passes ``.hooks`` to the engine, ``.attach(session)``
to report each logged step's energy and the run's (summary.json), and at the end calls ``.close()``.
The listeners learn everything about an instruction (its name and FLOPs) from the executor's
instruction events.
"""

from __future__ import annotations

import logging
import statistics

import torch

from merak.distributed import groups
from merak.energy.device import GPUDevice
from merak.energy.figures import run_figures, step_figures
from merak.energy.hooks import FrequencyPlanHook, InstructionMeter, SimulatedCompute
from merak.energy.simulated import SimulatedGPU
from merak.pipeline.hooks import PipelineHook

logger = logging.getLogger(__name__)


# Why a run with energy_device=auto measures nothing, as the run summary says it.
CPU_WORKERS = "CPU workers have no energy counter (trainer.energy_device=simulated simulates a GPU)"
NO_NVML_PACKAGE = ("CUDA workers, but nvidia-ml-py is not installed: pip install nvidia-ml-py (or merak[energy]) "
                   "to measure with NVML")
DEVICE_NONE = "trainer.energy_device=none"


def make_device(energy, device: torch.device, pipeline: int = 0) -> GPUDevice:
    """The GPU backend ``trainer.energy_device`` names for a run that must measure (auto: NVML on CUDA
    machines, else simulated); a simulated GPU of pipeline ``trainer.simulated_straggler_pipeline`` is
    capped at its straggler clock."""
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
        # Instructions are measured one by one only for the features that use their times and energies:
        # plain measuring reads the device at the steps' boundaries alone.
        self.meter = InstructionMeter(self.device, per_instruction=energy.features)
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

    def attach(self, session) -> None:
        """Report through ``session`` (a :class:`~merak.session.training.TrainingSession`): each logged
        step's energy figures join its metrics.jsonl line and the trackers, and the run's join
        summary.json as ``energy``."""
        samples, tokens = session.settings.global_batch_size, session.tokens_per_sample
        session.step_sections.append(lambda: self.step_report(samples_per_step=samples, tokens_per_sample=tokens))
        session.summary_sections.append(lambda: {"energy": self.summary(
            samples_per_step=samples, tokens_per_sample=tokens, model_flops_per_step=session.model_flops_per_step())})

    def step_report(self, *, samples_per_step: int, tokens_per_sample: int) -> dict[str, float]:
        """The last step's energy summed over every rank's device, per token (or sample) and the mean
        power per device (:func:`merak.energy.figures.step_figures`). Collective: one small all-reduce."""
        last = self.meter.steps[-1]
        joules, device_seconds = groups.sum_over_all([last.energy, last.time])
        return step_figures(joules, device_seconds, samples=samples_per_step, tokens_per_sample=tokens_per_sample)

    def summary(self, skip_steps: int = 1, *, samples_per_step: int | None = None, tokens_per_sample: int = 1,
                model_flops_per_step: float | None = None) -> dict | None:
        """Mean step time and energy per rank (after ``skip_steps`` warm-up steps, and since the last
        change of frontier point) and the job's iteration energy (all ranks' sum); with a frontier,
        each pipeline's measurement beside the prediction of the point it ran. With
        ``samples_per_step``, also the figures of :func:`merak.energy.figures.run_figures` (joules per
        step, per token or sample, power per device, devices, FLOP per joule). Collective; rank 0
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
        report = {"measured": True, "device": self.device.name, "measured_steps": local["steps"],
                  "iteration_time_s": max((r["step_time_s"] for r in measured), default=None),
                  "iteration_energy_j": sum(r["step_energy_j"] for r in measured) if measured else None,
                  "plan": self.energy.frequency_plan, "pfo_server_url": self.energy.pfo_server_url,
                  "zeus_job_id": self.zeus.job_id if self.zeus is not None else None,
                  "ranks": sorted(everyone, key=lambda r: r["rank"])}
        if samples_per_step is not None and measured:
            device_seconds = sum(r["step_time_s"] for r in measured)
            report.update(run_figures(report["iteration_energy_j"], device_seconds, devices=len(measured),
                                      samples=samples_per_step, tokens_per_sample=tokens_per_sample,
                                      model_flops_per_step=model_flops_per_step))
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


class EnergyOff:
    """A run that measures no energy, and why: :meth:`attach` puts the reason in the run summary
    (``energy: {"measured": false, "why": ...}``), the one place that says it."""

    hooks: tuple[PipelineHook, ...] = ()

    def __init__(self, why: str) -> None:
        self.why = why

    def attach(self, session) -> None:
        """Put the reason in ``session``'s summary."""
        session.summary_sections.append(lambda: {"energy": {"measured": False, "why": self.why}})

    def close(self) -> None:
        """Nothing to release."""


def nvml_where_it_answers(device: torch.device) -> tuple[GPUDevice | None, str | None]:
    """``(NVML device, None)`` for a CUDA worker whose GPU NVML reads, else ``(None, why not)``."""
    if device.type != "cuda":
        return None, CPU_WORKERS
    try:
        import pynvml  # noqa: F401  (only whether it is installed)
    except ImportError:
        return None, NO_NVML_PACKAGE
    from merak.energy.nvml import NVMLDevice

    index = device.index if device.index is not None else 0
    try:
        return NVMLDevice(index, cuda_index=index), None
    except RuntimeError as error:  # no NVML library or driver, or no such GPU: the message says which
        return None, f"CUDA workers, but NVML does not answer: {error}"


def _first_reason(why: str | None) -> str | None:
    """Every rank's reason not to measure, agreed: the first rank's that has one (None: all measure).
    Each logged step's report is a collective, so the ranks measure all together or not at all."""
    everyone = groups.gather_from_all(why)
    for rank, reason in enumerate(everyone):
        if reason is not None:
            return reason if len(everyone) == 1 or reason == why else f"rank {rank}: {reason}"
    return None


def start_energy(energy, state) -> EnergyRuntime | EnergyOff:
    """The worker's energy measurement: an :class:`EnergyRuntime` for an energy feature or an explicit
    ``energy_device`` (as configured: an unavailable NVML fails), and with ``auto`` where every rank's
    NVML answers; else an :class:`EnergyOff` saying why. Collective with ``auto`` (the ranks agree)."""
    if energy.enabled:
        return EnergyRuntime(energy, state)
    if energy.energy_device == "none":
        return EnergyOff(DEVICE_NONE)
    device, why = nvml_where_it_answers(state.device)
    why = _first_reason(why)
    if why is not None:
        if device is not None:
            device.close()
        logger.debug("energy not measured: %s", why)
        return EnergyOff(why)
    logger.info("measuring energy with NVML (%s)", device.name)
    return EnergyRuntime(energy, state, device=device)


__all__ = ["EnergyOff", "EnergyRuntime", "make_device", "nvml_where_it_answers", "start_energy"]
