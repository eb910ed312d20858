"""The energy listeners on instruction events, and zeus's protocol without a GPU or a server process."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest

from merak.distributed.topology import RankGrid
from merak.energy.hooks import FrequencyPlanHook, InstructionMeter, PlanMismatchError, SimulatedCompute
from merak.energy.runtime import EnergyRuntime
from merak.energy.settings import EnergySettings
from merak.energy.simulated import SimulatedGPU
from merak.pipeline import instructions as ins
from merak.pipeline.hooks import HookList, InstructionEvent


class FakeTime:
    """A clock that moves only when slept on or advanced."""

    def __init__(self) -> None:
        self.now = 100.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _event(instruction, flops: int | None = 1_000, stage: int = 0) -> InstructionEvent:
    """The event of ``instruction`` in a chunk whose forward takes ``flops``."""
    return InstructionEvent.of(instruction, stage=stage, step=0, chunk_forward_flops=flops)


def _gpu(time: FakeTime) -> SimulatedGPU:
    return SimulatedGPU("A100", clock_source=time.clock, sleep=time.sleep)


def test_simulated_compute_takes_the_event_flops_at_the_given_speed():
    time = FakeTime()
    gpu = _gpu(time)
    hook = SimulatedCompute(gpu, flops_per_second=1_000.0)
    hook.on_instruction_begin(_event(ins.Backward(0)))
    hook.on_instruction_end(_event(ins.Backward(0)))
    assert time.now == pytest.approx(102.0)  # a backward is two forwards of 1000 FLOPs at 1000 FLOP/s
    gpu.set_clock(705)
    hook.on_instruction_begin(_event(ins.Forward(1)))
    hook.on_instruction_end(_event(ins.Forward(1)))
    assert time.now - 102.0 == pytest.approx(gpu.spec.time(1.0, 705))


def test_simulated_compute_needs_a_flop_count():
    gpu = _gpu(FakeTime())
    hook = SimulatedCompute(gpu, flops_per_second=1e12)
    hook.on_instruction_begin(_event(ins.Forward(0), flops=None, stage=1))
    with pytest.raises(RuntimeError, match="stage 1 ran forward of chunk 0 with no FLOP count"):
        hook.on_instruction_end(_event(ins.Forward(0), flops=None, stage=1))
    with pytest.raises(ValueError, match="flops_per_second"):
        SimulatedCompute(gpu, flops_per_second=0.0)


def test_instruction_meter_records_each_event_by_name():
    time = FakeTime()
    gpu = _gpu(time)
    meter = InstructionMeter(gpu, clock=time.clock)
    hooks = HookList([SimulatedCompute(gpu, 1_000.0), meter])
    hooks.on_step_begin()
    for instruction in (ins.Forward(0), ins.Backward(0)):
        hooks.on_instruction_begin(_event(instruction))
        hooks.on_instruction_end(_event(instruction))
    hooks.on_step_end()
    (step,) = meter.steps
    assert [name for name, _, _ in step.instructions] == ["forward", "backward"]
    assert [seconds for _, seconds, _ in step.instructions] == pytest.approx([1.0, 2.0])
    assert step.time == pytest.approx(3.0)


def test_frequency_plan_hook_locks_each_planned_clock_and_names_a_mismatch():
    gpu = _gpu(FakeTime())
    hook = FrequencyPlanHook(gpu, [("forward", 1005), ("backward", 705)], stage=0)
    hook.on_step_begin()
    hook.on_instruction_begin(_event(ins.Forward(0)))
    assert gpu.clock == 1005
    hook.on_instruction_begin(_event(ins.Backward(0)))
    assert gpu.clock == 705
    hook.on_step_end()
    hook.on_step_begin()
    with pytest.raises(PlanMismatchError,
                       match=r"#0 is 'backward' \(microbatch 3, chunk 0\) but its plan says 'forward'"):
        hook.on_instruction_begin(_event(ins.Backward(3)))


def test_energy_runtime_sizes_simulated_work_from_events_alone():
    time = FakeTime()
    gpu = _gpu(time)
    # Profiling: a feature that measures every instruction. 1000 FLOP/s.
    trainer = EnergySettings(profile=True, simulated_tflops=1e-9)
    state = SimpleNamespace(rank=0, coordinates=SimpleNamespace(pp=0))
    runtime = EnergyRuntime(trainer, state, device=gpu)
    hooks = HookList(runtime.hooks)
    hooks.on_step_begin()
    hooks.on_instruction_begin(_event(ins.RecomputeForward(0, chunk=1)))
    hooks.on_instruction_end(_event(ins.RecomputeForward(0, chunk=1)))
    hooks.on_step_end()
    assert not hasattr(runtime, "bind")
    assert [name for name, _, _ in runtime.meter.steps[0].instructions] == ["recompute@1"]  # chunk 1: named apart
    assert time.now == pytest.approx(101.0)


# -- zeus ----------------------------------------------------------------------------------------


class RecordingCallback:
    """What zeus's ``Callback`` protocol receives."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str | None]] = []

    def on_step_begin(self) -> None:
        self.calls.append(("step_begin", None))

    def on_step_end(self) -> None:
        self.calls.append(("step_end", None))

    def on_instruction_begin(self, name: str) -> None:
        self.calls.append(("begin", name))

    def on_instruction_end(self, name: str) -> None:
        self.calls.append(("end", name))


def test_zeus_callbacks_receive_instruction_names():
    pytest.importorskip("zeus")
    from zeus.callback import Callback

    from merak.energy.zeus_client import ZeusCallbackHook

    class ZeusRecorder(RecordingCallback, Callback):
        pass

    callback = ZeusRecorder()
    hook = ZeusCallbackHook(callback)
    hook.on_step_begin()
    for instruction in (ins.PreCheckpointForward(0), ins.BackwardWeight(0)):
        hook.on_instruction_begin(_event(instruction))
        hook.on_instruction_end(_event(instruction))
    hook.on_step_end()
    assert callback.calls == [("step_begin", None), ("begin", "forward"), ("end", "forward"),
                              ("begin", "backward_weight"), ("end", "backward_weight"), ("step_end", None)]


class FakeZeusServer:
    """Answers zeus's pipeline-frequency requests for a one-rank job (an httpx transport)."""

    def __init__(self, schedule: list[tuple[str, int]], *, schedule_rank: int = 0, job_status: int = 200) -> None:
        self.schedule, self.schedule_rank, self.job_status = schedule, schedule_rank, job_status
        self.requests: list[tuple[str, str, dict | None]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.requests.append((request.method, request.url.path, body))
        if request.url.path == "/register_job":
            if self.job_status != 200:
                return httpx.Response(self.job_status, text="no scheduler")
            return httpx.Response(200, json="job-1")
        if request.url.path == "/register_rank/job-1":
            return httpx.Response(200, json=None)
        if request.url.path == "/schedule/job-1":
            assert request.url.params["rank"] == "0"
            return httpx.Response(200, json={"rank": self.schedule_rank, "frequencies": self.schedule})
        if request.url.path == "/result/job-1":
            return httpx.Response(200, json=None)
        return httpx.Response(404)

    def client(self) -> httpx.Client:
        return httpx.Client(transport=httpx.MockTransport(self))


def _one_rank_state():
    grid = RankGrid(dp=1, tp=1, pp=1)
    return SimpleNamespace(rank=0, grid=grid, coordinates=grid.coordinates(0))


def test_join_zeus_job_registers_and_fetches_the_schedule():
    pytest.importorskip("zeus")
    from merak.energy.zeus_schedule import join_zeus_job

    server = FakeZeusServer([("forward", 1005), ("backward", 1410)])
    job = join_zeus_job("http://zeus", _one_rank_state(), [705, 1410, 1005], http=server.client())
    assert job.job_id == "job-1" and job.schedule == [("forward", 1005), ("backward", 1410)]
    (_, _, job_info), (_, _, rank_info), _ = server.requests
    assert (job_info["pp_degree"], job_info["world_size"], job_info["job_metadata"]) == (1, 1, "merak")
    assert rank_info["available_frequencies"] == [1410, 1005, 705]


def test_join_zeus_job_reports_a_refusal_and_a_schedule_for_another_rank():
    pytest.importorskip("zeus")
    from merak.energy.zeus_schedule import join_zeus_job

    refusing = FakeZeusServer([], job_status=500)
    with pytest.raises(RuntimeError, match="rank 0 could not register the job.*500"):
        join_zeus_job("http://zeus", _one_rank_state(), [1410], http=refusing.client())
    confused = FakeZeusServer([("forward", 1410)], schedule_rank=3)
    with pytest.raises(RuntimeError, match="sent rank 0 the schedule of rank 3"):
        join_zeus_job("http://zeus", _one_rank_state(), [1410], http=confused.client())


def test_zeus_client_on_a_simulated_gpu_runs_the_served_schedule_and_reports():
    pytest.importorskip("zeus")
    from merak.energy.zeus_client import ZeusClient

    time = FakeTime()
    gpu = _gpu(time)
    meter = InstructionMeter(gpu, clock=time.clock)
    server = FakeZeusServer([("forward", 1005), ("backward", 705)])
    trainer = SimpleNamespace(pfo_server_url="http://zeus/", num_warmup_steps=1, num_prof_steps=1)
    client = ZeusClient(trainer, _one_rank_state(), gpu, meter, http=server.client())
    assert client.job_id == "job-1"
    hooks = HookList([client.control, SimulatedCompute(gpu, 1_000.0), meter, client.reporter])
    clocks = []
    for _ in range(2):
        hooks.on_step_begin()
        for instruction in (ins.Forward(0), ins.Backward(0)):
            hooks.on_instruction_begin(_event(instruction))
            clocks.append(gpu.clock)
            hooks.on_instruction_end(_event(instruction))
        hooks.on_step_end()
    assert clocks == [1005, 705, 1005, 705]
    method, path, result = server.requests[-1]
    assert (method, path, result["rank"]) == ("POST", "/result/job-1", 0)
    assert len(result["iter_time"]) == 1 and set(result["time_breakdown"]) == {"forward", "backward"}
    client.close()


def test_zeus_client_on_an_nvidia_gpu_runs_zeus_own_optimizer(monkeypatch):
    pytest.importorskip("zeus")
    import zeus.optimizer.pipeline_frequency as zeus_pfo

    from merak.energy.nvml import NVMLDevice
    from merak.energy.zeus_client import ZeusCallbackHook, ZeusClient

    class FakeOptimizer(RecordingCallback):
        """Stands in for zeus's optimizer, which needs a GPU, NVML and a process group."""

        def __init__(self, **arguments) -> None:
            super().__init__()
            self.arguments, self.job_id, self.freq_schedule = arguments, "job-9", [("forward", 1410)]
            self.frequency_controller = SimpleNamespace(ended=False)
            self.frequency_controller.end = lambda: setattr(self.frequency_controller, "ended", True)

    monkeypatch.setattr(zeus_pfo, "PipelineFrequencyOptimizer", FakeOptimizer)
    gpu = NVMLDevice.__new__(NVMLDevice)  # no NVML here: only the CUDA index is read
    gpu.cuda_index = 3
    trainer = SimpleNamespace(pfo_server_url="http://zeus/", num_warmup_steps=0, num_prof_steps=1)
    client = ZeusClient(trainer, _one_rank_state(), gpu, InstructionMeter(gpu), http=FakeZeusServer([]).client())
    optimizer = client.control.callback
    assert isinstance(client.control, ZeusCallbackHook) and client.job_id == "job-9"
    assert optimizer.arguments["device_id"] == 3 and optimizer.arguments["server_url"] == "http://zeus"
    client.control.on_instruction_begin(_event(ins.Forward(0)))
    assert optimizer.calls == [("begin", "forward")]
    client.close()
    assert optimizer.frequency_controller.ended
