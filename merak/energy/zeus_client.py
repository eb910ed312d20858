"""Training under a zeus pipeline-frequency (Perseus) server.

The server hands each rank a clock for every compute instruction of a step. Who sets the
clock depends on the GPU:

- on an NVIDIA GPU (:class:`~merak.energy.nvml.NVMLDevice`), zeus's own
  ``PipelineFrequencyOptimizer``, unchanged, behind :class:`ZeusCallbackHook`;
- on any other device (the simulated GPU), which zeus cannot drive, merak joins the job through
  the server's protocol (:mod:`merak.energy.zeus_schedule`) and a
  :class:`~merak.energy.hooks.FrequencyPlanHook` runs the schedule.

After ``num_warmup_steps`` + ``num_prof_steps`` steps every rank reports the measured steps
(``ProfilingResult``: iteration times and energies, per-instruction breakdowns) to the
server's ``/result`` endpoint.
"""

from __future__ import annotations

import logging

import httpx

from merak.energy.device import GPUDevice
from merak.energy.hooks import FrequencyPlanHook, InstructionMeter, StepMeasurement
from merak.energy.nvml import NVMLDevice
from merak.energy.zeus_schedule import REQUEST_TIMEOUT_S, join_zeus_job
from merak.pipeline.hooks import InstructionEvent, PipelineHook

logger = logging.getLogger(__name__)


class ZeusCallbackHook(PipelineHook):
    """A zeus ``Callback`` as a merak pipeline listener.

    zeus's callbacks take an instruction's name ("forward", "backward", ...), merak's listeners
    an :class:`~merak.pipeline.hooks.InstructionEvent`; this passes each event's plan name
    (``forward``, ``backward``, and ``forward@1`` ... for an interleaved stage's later chunks) on.

    Args:
        callback: any object with zeus's ``Callback`` methods (``on_step_begin``, ``on_step_end``,
            ``on_instruction_begin(name)``, ``on_instruction_end(name)``).
    """

    def __init__(self, callback) -> None:
        self.callback = callback

    def on_step_begin(self) -> None:
        self.callback.on_step_begin()

    def on_step_end(self) -> None:
        self.callback.on_step_end()

    def on_instruction_begin(self, event: InstructionEvent) -> None:
        self.callback.on_instruction_begin(event.plan_name)

    def on_instruction_end(self, event: InstructionEvent) -> None:
        self.callback.on_instruction_end(event.plan_name)


class _Reporter(PipelineHook):
    """Posts this rank's measured steps to the server once enough have run."""

    def __init__(self, client: ZeusClient, after_steps: int, measured_steps: int) -> None:
        self.client, self.after_steps, self.measured_steps = client, after_steps, measured_steps
        self.reported = False

    def on_step_end(self) -> None:
        steps = self.client.meter.steps
        if self.reported or len(steps) < self.after_steps:
            return
        self.client.report(steps[-self.measured_steps:])
        self.reported = True


class ZeusClient:
    """This rank's part in a zeus pipeline-frequency job: clock control and reporting.

    Args:
        trainer: the trainer settings (``pfo_server_url``, ``num_warmup_steps``, ``num_prof_steps``).
        state: the worker's parallel state.
        device: this rank's GPU.
        meter: the listener whose measured steps are reported.
        http: the HTTP client for merak's own requests (default: a new one, closed by :meth:`close`).

    Attributes:
        control: the listener that sets the clock before each compute instruction.
        reporter: the listener that reports the measured steps once.
        job_id: the job's id on the server.
    """

    def __init__(self, energy, state, device: GPUDevice, meter: InstructionMeter, *,
                 http: httpx.Client | None = None) -> None:
        self.url, self.state, self.device, self.meter = energy.pfo_server_url.rstrip("/"), state, device, meter
        self._http = http if http is not None else httpx.Client(timeout=REQUEST_TIMEOUT_S)
        self._owns_http = http is None
        self._zeus_optimizer = None
        if isinstance(device, NVMLDevice):
            self._zeus_optimizer = self._zeus_optimizer_for(state, device)
            self.job_id = self._zeus_optimizer.job_id
            planned = len(self._zeus_optimizer.freq_schedule)
            self.control: PipelineHook = ZeusCallbackHook(self._zeus_optimizer)
        else:
            job = join_zeus_job(self.url, state, device.supported_clocks(), http=self._http)
            self.job_id, planned = job.job_id, len(job.schedule)
            self.control = FrequencyPlanHook(device, job.schedule, state.coordinates.pp)
        logger.info("zeus job %s: %d planned compute instructions per step on this rank", self.job_id, planned)
        measured = energy.num_prof_steps
        self.reporter = _Reporter(self, energy.num_warmup_steps + measured, measured)

    def _zeus_optimizer_for(self, state, device: NVMLDevice):
        from zeus.optimizer.pipeline_frequency import PipelineFrequencyOptimizer

        grid, coords = state.grid, state.coordinates
        return PipelineFrequencyOptimizer(rank=state.rank, dp_rank=coords.dp, pp_rank=coords.pp, tp_rank=coords.tp,
                                          device_id=device.cuda_index, dp_degree=grid.dp, pp_degree=grid.pp,
                                          tp_degree=grid.tp, world_size=grid.world_size, server_url=self.url,
                                          job_metadata="merak")

    def report(self, steps: list[StepMeasurement]) -> None:
        """POST a ProfilingResult of ``steps`` to ``/result/{job_id}``."""
        from zeus.optimizer.pipeline_frequency.common import (
            REPORT_PROFILING_RESULT_URL,
            ProfilingResult,
        )

        times, energies = {}, {}
        for step in steps:
            step_times, step_energies = step.breakdown()
            for name in step_times:
                times.setdefault(name, []).append(step_times[name])
                energies.setdefault(name, []).append(step_energies[name])
        result = ProfilingResult(rank=self.state.rank, iter_time=[s.time for s in steps],
                                 iter_energy=[s.energy for s in steps], time_breakdown=times,
                                 energy_breakdown=energies)
        response = self._http.post(self.url + REPORT_PROFILING_RESULT_URL.format(job_id=self.job_id),
                                   json=result.dict())
        if response.status_code != 200:
            raise RuntimeError(f"zeus server refused the profiling result ({response.status_code}): {response.text}")
        logger.info("reported %d measured steps to zeus job %s", len(steps), self.job_id)

    def close(self) -> None:
        """Stop zeus's clock controller process, if zeus sets the clock, and close the HTTP client."""
        if self._zeus_optimizer is not None:
            # The controller returns the clocks to the driver and exits; multiprocessing joins it
            # when the worker exits.
            self._zeus_optimizer.frequency_controller.end()
        if self._owns_http:
            self._http.close()


__all__ = ["ZeusCallbackHook", "ZeusClient"]
