"""Training under a zeus pipeline-frequency (Perseus) server.

zeus's own ``PipelineFrequencyOptimizer`` registers the job and this rank, fetches this
rank's plan, and locks the clock before each compute instruction. It runs unchanged; on a
simulated GPU, three stand-ins replace what it would find on a CUDA machine:

- zeus's GPU singleton (``zeus.device.gpu._gpus``) becomes :class:`SimulatedZeusGPUs`, so
  zeus's clock controller process locks the simulated GPU's shared clock;
- ``torch.cuda.set_device`` is a no-op while the optimizer is built;
- the optimizer's ``sync_execution`` calls the device's ``synchronize``.

After ``num_warmup_steps`` + ``num_prof_steps`` steps every rank reports the measured steps
(``ProfilingResult``: iteration times and energies, per-instruction breakdowns) to the
server's ``/result`` endpoint.
"""

from __future__ import annotations

import contextlib
import logging
from unittest import mock

import torch

from merak.energy.device import GPUDevice
from merak.energy.hooks import InstructionMeter
from merak.energy.simulated import SimulatedGPU
from merak.pipeline.hooks import PipelineHook

logger = logging.getLogger(__name__)

MEMORY_CLOCK_MHZ = 1215  # what a simulated GPU reports as its only memory clock


class SimulatedZeusGPUs:
    """zeus's ``GPUs`` calls that the pipeline-frequency optimizer uses, on a simulated GPU."""

    def __init__(self, device: SimulatedGPU) -> None:
        self.device = device

    def get_supported_memory_clocks(self, gpu_index: int) -> list[int]:
        return [MEMORY_CLOCK_MHZ]

    def get_supported_graphics_clocks(self, gpu_index: int, memory_clock_mhz: int | None = None) -> list[int]:
        return self.device.supported_clocks()

    def set_gpu_locked_clocks(self, gpu_index: int, min_clock_mhz: int, max_clock_mhz: int, block: bool = True) -> None:
        self.device.set_clock(min_clock_mhz)

    def reset_gpu_locked_clocks(self, gpu_index: int, block: bool = True) -> None:
        self.device.reset_clock()

    def reset_power_management_limit(self, gpu_index: int, block: bool = True) -> None:
        """A simulated GPU has no power limit to reset."""

    def set_memory_locked_clocks(self, gpu_index: int, min_clock_mhz: int, max_clock_mhz: int,
                                 block: bool = True) -> None:
        """The simulated memory clock is fixed."""

    def reset_memory_locked_clocks(self, gpu_index: int, block: bool = True) -> None:
        """The simulated memory clock is fixed."""


@contextlib.contextmanager
def _simulated_cuda(device: SimulatedGPU):
    import zeus.device.gpu as zeus_gpu

    zeus_gpu._gpus = SimulatedZeusGPUs(device)
    with mock.patch.object(torch.cuda, "set_device", lambda *args, **kwargs: None):
        yield


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
    """zeus's optimizer for this rank, and the reporting of measured steps."""

    def __init__(self, trainer, state, device: GPUDevice, meter: InstructionMeter) -> None:
        from zeus.optimizer.pipeline_frequency import optimizer as zeus_optimizer

        self.url, self.state, self.device, self.meter = trainer.pfo_server_url.rstrip("/"), state, device, meter
        grid, coords = state.grid, state.coordinates
        index = state.device.index if state.device.type == "cuda" and state.device.index is not None else 0
        arguments = dict(rank=state.rank, dp_rank=coords.dp, pp_rank=coords.pp, tp_rank=coords.tp, device_id=index,
                         dp_degree=grid.dp, pp_degree=grid.pp, tp_degree=grid.tp, world_size=grid.world_size,
                         server_url=self.url, job_metadata="merak")
        if isinstance(device, SimulatedGPU):
            zeus_optimizer.sync_execution = lambda devices, sync_with="torch": device.synchronize()
            with _simulated_cuda(device):
                self.optimizer = zeus_optimizer.PipelineFrequencyOptimizer(**arguments)
        else:
            self.optimizer = zeus_optimizer.PipelineFrequencyOptimizer(**arguments)
        self.job_id = self.optimizer.job_id
        logger.info("zeus job %s: %d planned compute instructions per step on this rank", self.job_id,
                    len(self.optimizer.freq_schedule))
        measured = trainer.num_prof_steps
        self.reporter = _Reporter(self, trainer.num_warmup_steps + measured, measured)

    def report(self, steps) -> None:
        """POST a ProfilingResult of ``steps`` to ``/result/{job_id}``."""
        import httpx
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
        response = httpx.post(self.url + REPORT_PROFILING_RESULT_URL.format(job_id=self.job_id), json=result.dict(),
                              timeout=30.0)
        if response.status_code != 200:
            raise RuntimeError(f"zeus server refused the profiling result ({response.status_code}): {response.text}")
        logger.info("reported %d measured steps to zeus job %s", len(steps), self.job_id)

    def close(self) -> None:
        """Stop zeus's clock controller process (it would otherwise outlive the worker)."""
        controller = self.optimizer.frequency_controller
        controller.end()
        controller._proc.join(timeout=10)
        if controller._proc.is_alive():
            controller._proc.terminate()
