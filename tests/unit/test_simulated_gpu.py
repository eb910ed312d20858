"""The simulated GPU with a fake clock: its clocks, timing, energy and shared clock."""

from __future__ import annotations

import itertools
import multiprocessing

import pytest

from merak.energy.simulated import SPECS, SimulatedGPU, gpu_spec

A100 = SPECS["A100"]


class FakeTime:
    """A wall clock that only moves when slept on (or advanced by the test)."""

    def __init__(self, start: float = 100.0):
        self.now = [start]
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now[0]

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now[0] += seconds

    def advance(self, seconds: float) -> None:
        self.now[0] += seconds


@pytest.fixture
def fake():
    t = FakeTime()
    return t, SimulatedGPU("A100", clock_source=t.clock, sleep=t.sleep)


def test_supported_clocks_and_set_clock(fake):
    _, gpu = fake
    clocks = gpu.supported_clocks()
    assert len(clocks) == 81
    assert clocks == list(range(1410, 209, -15))
    assert clocks[0] == 1410 and clocks[-1] == 210
    assert gpu.max_clock() == 1410
    assert gpu.clock == 1410
    assert gpu.name == "simulated A100"
    gpu.set_clock(1005)
    assert gpu.clock == 1005
    for bad in (1400, 1425, 195, 0):
        with pytest.raises(ValueError, match="210-1410 MHz in 15 MHz steps"):
            gpu.set_clock(bad)
    assert gpu.clock == 1005
    gpu.reset_clock()
    assert gpu.clock == 1410
    assert SimulatedGPU("h100").supported_clocks()[:2] == [1980, 1965]
    with pytest.raises(ValueError, match="unknown simulated GPU 'V100'"):
        gpu_spec("V100")


def test_compute_at_max_clock_sleeps_the_rest(fake):
    t, gpu = fake
    assert gpu.energy() == 0.0
    gpu.begin_compute()
    assert gpu.power() == pytest.approx(400.0)
    t.advance(0.004)  # the CPU part of the instruction
    duration = gpu.end_compute(0.01)
    assert duration == pytest.approx(0.01, abs=1e-15)
    assert t.sleeps == [pytest.approx(0.006, abs=1e-12)]
    assert t.now[0] == pytest.approx(100.01, abs=1e-12)
    assert A100.busy_power(1410) == 400.0
    assert gpu.energy() == pytest.approx(400.0 * 0.01, rel=1e-9)
    assert gpu.power() == pytest.approx(80.0)
    assert gpu.overruns == 0


def test_lower_clock_follows_the_model(fake):
    t, gpu = fake
    gpu.set_clock(705)
    gpu.begin_compute()
    duration = gpu.end_compute(0.01)
    expected = 0.01 * (0.3 + 0.7 * 1410 / 705)
    assert expected == pytest.approx(0.017)
    assert A100.time(0.01, 705) == pytest.approx(expected, rel=1e-12)
    assert duration == pytest.approx(expected, rel=1e-12)
    assert t.sleeps == [pytest.approx(expected, rel=1e-12)]
    power = 120.0 + 280.0 * 0.5 ** 3
    assert A100.busy_power(705) == pytest.approx(power) == pytest.approx(155.0)
    assert gpu.energy() == pytest.approx(155.0 * 0.017, rel=1e-9)


def test_blocked_time_and_monotone_energy(fake):
    t, gpu = fake
    readings = [gpu.energy()]
    t.advance(0.5)  # blocked before the first instruction
    readings.append(gpu.energy())
    assert readings[-1] == pytest.approx(80.0 * 0.5)
    gpu.begin_compute()
    gpu.end_compute(0.02)
    readings.append(gpu.energy())
    assert readings[-1] == pytest.approx(40.0 + 400.0 * 0.02)
    t.advance(0.25)  # blocked between instructions
    gpu.begin_compute()
    readings.append(gpu.energy())  # busy: nothing accrues until end_compute
    assert readings[-1] == pytest.approx(40.0 + 8.0 + 80.0 * 0.25)
    gpu.set_clock(1005)
    gpu.end_compute(0.02)
    readings.append(gpu.energy())
    assert readings[-1] == pytest.approx(68.0 + A100.busy_power(1005) * A100.time(0.02, 1005))
    t.advance(1.0)
    readings.append(gpu.energy())
    assert readings[-1] == pytest.approx(readings[-2] + 80.0)
    readings.append(gpu.energy())  # no time passed
    assert readings[-1] == readings[-2]
    assert all(b >= a for a, b in itertools.pairwise(readings))
    assert all(b > a for a, b in itertools.pairwise(readings[:-1]))


def test_overrun_charges_the_real_duration(fake):
    t, gpu = fake
    gpu.begin_compute()
    t.advance(0.05)  # CPU work slower than the 10 ms the GPU would take
    assert gpu.end_compute(0.01) == pytest.approx(0.05)
    assert t.sleeps == []
    assert gpu.overruns == 1
    assert gpu.energy() == pytest.approx(400.0 * 0.05)
    gpu.begin_compute()
    t.advance(0.002)
    gpu.end_compute(0.01)
    assert gpu.overruns == 1
    gpu.begin_compute()
    t.advance(0.03)
    gpu.end_compute(0.01)
    assert gpu.overruns == 2
    assert gpu.energy() == pytest.approx(400.0 * (0.05 + 0.01 + 0.03))


def test_end_without_begin_raises(fake):
    _, gpu = fake
    with pytest.raises(RuntimeError, match="end_compute without begin_compute"):
        gpu.end_compute(0.01)
    gpu.begin_compute()
    gpu.end_compute(0.01)
    with pytest.raises(RuntimeError, match="end_compute without begin_compute"):
        gpu.end_compute(0.01)


def test_clock_is_shared_with_a_forked_child():
    gpu = SimulatedGPU("A100")
    assert gpu.clock == 1410
    process = multiprocessing.get_context("fork").Process(target=gpu.set_clock, args=(1005,))
    process.start()
    process.join(timeout=10)
    if process.is_alive():
        process.kill()
        process.join(timeout=5)
        pytest.fail("the child process did not finish")
    assert process.exitcode == 0
    assert gpu.clock == 1005
    assert gpu.power() == pytest.approx(A100.blocked_power)


def test_energy_minimal_clock_is_inside_the_range():
    clocks = A100.clocks()
    energies = {c: A100.energy(1.0, c) for c in clocks}
    best = min(energies, key=energies.get)
    assert A100.min_clock < best < A100.max_clock
    assert energies[A100.min_clock] > energies[best]
    assert energies[A100.max_clock] > energies[best]
    # near 55 % of the highest clock, with about a third less energy (the module's calibration)
    assert 0.45 < best / A100.max_clock < 0.65
    assert 0.55 < energies[best] / energies[A100.max_clock] < 0.8
    # time only grows as the clock falls
    times = [A100.time(1.0, c) for c in clocks]
    assert times[0] == pytest.approx(1.0)
    assert all(b > a for a, b in itertools.pairwise(times))
