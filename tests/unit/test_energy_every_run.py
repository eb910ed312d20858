"""Energy on every run, in one process and with scripted devices: which device measures (or why none
does), the step-level meter's readings, and the figures each logged step and the run summary report,
computed exactly from a device whose energy counter and clock are scripted."""

from __future__ import annotations

import json
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from merak.distributed import groups
from merak.energy import runtime as energy_runtime
from merak.energy.device import GPUDevice
from merak.energy.figures import run_figures, step_figures
from merak.energy.hooks import InstructionMeter, SimulatedCompute
from merak.energy.runtime import CPU_WORKERS, NO_NVML_PACKAGE, EnergyOff, EnergyRuntime, start_energy
from merak.energy.settings import EnergySettings
from merak.energy.simulated import SimulatedGPU
from merak.pipeline import instructions as ins
from merak.pipeline.hooks import HookList, InstructionEvent
from merak.report.metrics import MetricsWriter, format_energy, format_summary


class ScriptedGPU(GPUDevice):
    """A GPU whose energy counter and the clock beside it move only as the test says; counts readings
    and synchronizations."""

    name = "scripted GPU"

    def __init__(self) -> None:
        self.joules, self.now = 1_000.0, 50.0
        self.reads = self.synchronizations = 0

    def run(self, seconds: float, joules: float) -> None:
        """Time passes and the counter rises."""
        self.now += seconds
        self.joules += joules

    def clock(self) -> float:
        return self.now

    def supported_clocks(self) -> list[int]:
        return [1000]

    def set_clock(self, mhz: int) -> None:
        pass

    def reset_clock(self) -> None:
        pass

    def energy(self) -> float:
        self.reads += 1
        return self.joules

    def power(self) -> float:
        return 0.0

    def synchronize(self) -> None:
        self.synchronizations += 1


def _event(instruction) -> InstructionEvent:
    return InstructionEvent.of(instruction, stage=0, step=0, chunk_forward_flops=1_000)


def _one_step(hooks, gpu: ScriptedGPU, seconds: float, joules: float, instructions: int = 2) -> None:
    """A step of ``instructions`` forwards that takes ``seconds`` and ``joules`` in all (numbers chosen
    so that every sum is exact in binary: the figures must come out exactly)."""
    hooks.on_step_begin()
    for microbatch in range(instructions):
        hooks.on_instruction_begin(_event(ins.Forward(microbatch)))
        gpu.run(seconds / instructions, joules / instructions)
        hooks.on_instruction_end(_event(ins.Forward(microbatch)))
    hooks.on_step_end()


def _state(device: str = "cpu") -> SimpleNamespace:
    grid = SimpleNamespace(dp=1, tp=1, pp=1, world_size=1)
    return SimpleNamespace(rank=0, grid=grid, coordinates=SimpleNamespace(dp=0, pp=0, tp=0),
                           device=torch.device(device, 0) if device == "cuda" else torch.device(device))


def _measuring(gpu: ScriptedGPU, settings: EnergySettings | None = None) -> EnergyRuntime:
    runtime = EnergyRuntime(settings or EnergySettings(energy_device="nvml"), _state(), device=gpu)
    runtime.meter.clock = gpu.clock
    return runtime


# -- the meter -------------------------------------------------------------------------------------


def test_step_meter_reads_the_device_only_at_step_boundaries():
    gpu = ScriptedGPU()
    meter = InstructionMeter(gpu, clock=gpu.clock, per_instruction=False)
    _one_step(meter, gpu, seconds=0.6, joules=180.0, instructions=4)
    (step,) = meter.steps
    assert (gpu.synchronizations, gpu.reads) == (2, 2)  # one at the step's start, one at its end
    assert step.time == pytest.approx(0.6) and step.energy == pytest.approx(180.0)
    assert step.instructions == [] and step.compute_span == step.time


def test_per_instruction_meter_synchronizes_around_every_instruction():
    gpu = ScriptedGPU()
    meter = InstructionMeter(gpu, clock=gpu.clock)
    _one_step(meter, gpu, seconds=0.6, joules=180.0, instructions=4)
    assert gpu.synchronizations == 2 + 2 * 4
    assert [joules for _, _, joules in meter.steps[0].instructions] == pytest.approx([45.0] * 4)


def test_only_features_measure_instruction_by_instruction():
    assert not _measuring(ScriptedGPU()).meter.per_instruction
    assert _measuring(ScriptedGPU(), EnergySettings(profile=True)).meter.per_instruction
    # The simulated GPU keeps its per-instruction compute (that is how it simulates), not the readings.
    simulated = EnergyRuntime(EnergySettings(energy_device="simulated"), _state())
    assert isinstance(simulated.device, SimulatedGPU) and not simulated.meter.per_instruction
    assert [type(hook) for hook in simulated.hooks] == [SimulatedCompute, InstructionMeter]


# -- the figures -----------------------------------------------------------------------------------


def test_a_logged_step_reports_its_energy_per_token_and_power():
    gpu = ScriptedGPU()
    runtime = _measuring(gpu)
    _one_step(HookList(runtime.hooks), gpu, seconds=0.5, joules=150.0)
    # A text recipe: a global batch of 8 samples of 64 tokens.
    assert runtime.step_report(samples_per_step=8, tokens_per_sample=64) == {
        "energy_j": 150.0, "joules_per_token": 150.0 / (8 * 64), "power_w": 150.0 / 0.5 / 1}
    # Images: one "token" per sample, so per sample.
    assert runtime.step_report(samples_per_step=8, tokens_per_sample=1) == {
        "energy_j": 150.0, "joules_per_sample": 150.0 / 8, "power_w": 300.0}


def test_the_step_figures_sum_over_devices():
    # Four devices' step: 800 J over 4 x 0.5 s -> 400 W each, 800 J / (16 x 128 tokens).
    assert step_figures(800.0, 4 * 0.5, samples=16, tokens_per_sample=128) == {
        "energy_j": 800.0, "joules_per_token": 800.0 / 2048, "power_w": 400.0}


def test_the_summary_reports_joules_per_step_token_power_and_flop_per_joule():
    gpu = ScriptedGPU()
    runtime = _measuring(gpu)
    hooks = HookList(runtime.hooks)
    for seconds, joules in ((2.0, 900.0), (0.5, 100.0), (0.25, 60.0)):  # the first step warms up
        _one_step(hooks, gpu, seconds=seconds, joules=joules)
    report = runtime.summary(samples_per_step=4, tokens_per_sample=32, model_flops_per_step=2e11)
    mean_joules, mean_seconds = (100.0 + 60.0) / 2, (0.5 + 0.25) / 2
    assert report["measured"] is True and report["device"] == "scripted GPU" and report["measured_steps"] == 2
    assert report["iteration_energy_j"] == report["joules_per_step"] == mean_joules
    assert report["joules_per_token"] == mean_joules / (4 * 32)
    assert report["power_w_per_device"] == mean_joules / mean_seconds
    assert report["devices"] == 1
    assert report["flop_per_joule"] == 2e11 / mean_joules
    assert format_energy(report) == "80.0 J/step on 1 scripted GPU, 0.625 J/token, 213 W per device, 2.5 GFLOP/J"


def test_the_summary_line_of_several_devices_per_sample():
    figures = run_figures(812.3, 4 * 1.0, devices=4, samples=2030, tokens_per_sample=1, model_flops_per_step=8.53e11)
    energy = {"measured": True, "device": "simulated A100", **figures}
    assert format_energy(energy) == "812.3 J/step on 4 simulated A100, 0.4 J/sample, 203 W per device, 1.05 GFLOP/J"
    unknown_flops = run_figures(812.3, 4.0, devices=4, samples=2030, tokens_per_sample=1, model_flops_per_step=None)
    assert unknown_flops["flop_per_joule"] is None
    assert "FLOP/J" not in format_energy({"device": "simulated A100", **unknown_flops})


# -- which device measures, or why none does -------------------------------------------------------


def test_auto_on_cpu_workers_measures_nothing_and_says_why():
    off = start_energy(EnergySettings(), _state("cpu"))
    assert isinstance(off, EnergyOff) and off.hooks == () and off.why == CPU_WORKERS
    session = SimpleNamespace(summary_sections=[], step_sections=[])
    off.attach(session)
    assert session.step_sections == []  # no collective per step where nothing is measured
    (section,) = session.summary_sections
    assert section() == {"energy": {"measured": False, "why": CPU_WORKERS}}
    assert format_energy(section()["energy"]) == ("not measured: CPU workers have no energy counter "
                                                  "(trainer.energy_device=simulated simulates a GPU)")
    assert start_energy(EnergySettings(energy_device="none"), _state()).why == "trainer.energy_device=none"


def test_explicit_devices_and_features_measure_as_before():
    assert isinstance(start_energy(EnergySettings(energy_device="simulated"), _state()).device, SimulatedGPU)
    # A feature on CPU workers with auto: the simulated GPU, instruction by instruction.
    profiling = start_energy(EnergySettings(profile=True), _state())
    assert isinstance(profiling.device, SimulatedGPU) and profiling.meter.per_instruction


class FakeNVML(types.ModuleType):
    """The slice of pynvml that reading a GPU's energy uses."""

    def __init__(self, init_error: str | None = None) -> None:
        super().__init__("pynvml")
        self.NVMLError = type("NVMLError", (Exception,), {})
        self.NVML_ERROR_NOT_SUPPORTED = 3
        self.init_error, self.energy_mj, self.shut_down = init_error, 5_000_000, False

    def nvmlInit(self):
        if self.init_error:
            raise self.NVMLError(self.init_error)

    def nvmlShutdown(self):
        self.shut_down = True

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("handle", index)

    def nvmlDeviceGetName(self, handle):
        return b"NVIDIA Fake 80GB"

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        return self.energy_mj

    def nvmlDeviceGetPowerUsage(self, handle):
        return 250_000


def test_auto_on_cuda_workers_measures_with_nvml_where_it_answers(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML())
    measuring = start_energy(EnergySettings(), _state("cuda"))
    assert isinstance(measuring, EnergyRuntime) and measuring.device.name == "NVIDIA Fake 80GB"
    assert not measuring.meter.per_instruction  # plain measuring: readings at the steps' boundaries only
    assert measuring.device.energy() == 5_000.0


def test_auto_on_cuda_workers_without_nvml_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    off = start_energy(EnergySettings(), _state("cuda"))
    assert isinstance(off, EnergyOff) and off.why == NO_NVML_PACKAGE and "pip install nvidia-ml-py" in off.why
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML(init_error="Driver Not Loaded"))
    off = start_energy(EnergySettings(), _state("cuda"))
    assert isinstance(off, EnergyOff) and "NVML does not answer" in off.why and "Driver Not Loaded" in off.why


def test_the_ranks_agree_on_the_first_reason(monkeypatch):
    monkeypatch.setattr(groups, "gather_from_all", lambda why: [None, "no driver", None])
    assert energy_runtime._first_reason(None) == "rank 1: no driver"
    monkeypatch.setattr(groups, "gather_from_all", lambda why: [None, None])
    assert energy_runtime._first_reason(None) is None


# -- metrics.jsonl, the trackers and the table -----------------------------------------------------


class RecordingTrackers:
    def __init__(self) -> None:
        self.logged: list[tuple[dict, int]] = []

    def log(self, metrics: dict, step: int) -> None:
        self.logged.append((metrics, step))

    def close(self) -> None:
        pass


def test_measured_steps_carry_their_energy_and_unmeasured_ones_leave_it_out(tmp_path):
    trackers = RecordingTrackers()
    writer = MetricsWriter(output_dir=str(tmp_path), total_steps=2, samples_per_step=4, tokens_per_sample=1,
                           enabled=True, progress_bar=False, trackers=trackers)
    writer.log_step(step=1, loss=2.0, lr=0.1, grad_norm=1.0, step_time_s=0.5,
                    measured={"energy_j": 100.0, "joules_per_sample": 25.0, "power_w": 200.0})
    writer.log_step(step=2, loss=1.5, lr=0.1, grad_norm=1.0, step_time_s=0.5)
    trackers_before_close = list(trackers.logged)
    writer.close()
    first, second = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert (first["energy_j"], first["joules_per_sample"], first["power_w"]) == (100.0, 25.0, 200.0)
    assert "joules_per_token" not in first
    assert not {"energy_j", "joules_per_token", "joules_per_sample", "power_w"} & set(second)
    assert trackers_before_close[0][0]["train/energy_j"] == 100.0
    assert trackers_before_close[0][0]["train/joules_per_sample"] == 25.0
    assert trackers_before_close[0][0]["train/power_w"] == 200.0
    assert "train/energy_j" not in trackers_before_close[1][0]


def test_the_summary_table_has_one_energy_line():
    summary = {"recipe": "gpt", "model": "toy", "layout": {"dp": 2, "tp": 1, "pp": 2}, "schedule": "1f1b", "steps": 3,
               "global_batch_size": 8, "num_microbatches": 2, "first_loss": 3.0, "final_loss": 2.0,
               "median_step_time_s": 0.5, "samples_per_s": 16.0, "tokens_per_s": 512.0, "wall_time_s": 3.0,
               "stages": [], "energy": {"measured": True, "device": "simulated A100", "iteration_energy_j": 812.3,
                                        "iteration_time_s": 0.5, "plan": "plan/plan.py",
                                        **run_figures(812.3, 2.0, devices=4, samples=8, tokens_per_sample=32,
                                                      model_flops_per_step=None)}}
    lines = [line for line in format_summary(summary).splitlines() if line.strip().startswith("energy")]
    assert lines == ["  energy             812.3 J/step on 4 simulated A100, 3.17 J/token, 406 W per device, "
                     "plan plan/plan.py"]
