"""NVMLDevice against a fake ``pynvml`` module (no GPU needed)."""

from __future__ import annotations

import sys
import types

import pytest

from merak.energy.device import ClockControlError
from merak.energy.nvml import NVMLDevice

NO_PERMISSION, NOT_SUPPORTED, LIBRARY_NOT_FOUND = 4, 3, 12


class FakeNVML(types.ModuleType):
    """The slice of pynvml's API NVMLDevice uses, recording calls."""

    def __init__(self, *, energy_mj=None, power_mw=250_000, init_error=None):
        super().__init__("pynvml")

        class NVMLError(Exception):
            def __init__(self, value):
                super().__init__(value)
                self.value = value

        self.NVMLError = NVMLError
        self.NVMLError_NoPermission = type("NVMLError_NoPermission", (NVMLError,), {})
        self.NVML_ERROR_NO_PERMISSION = NO_PERMISSION
        self.NVML_ERROR_NOT_SUPPORTED = NOT_SUPPORTED
        self.NVML_ERROR_LIBRARY_NOT_FOUND = LIBRARY_NOT_FOUND
        self.calls: list[tuple] = []
        self.energy_mj = energy_mj  # None: no energy counter
        self.power_mw = power_mw
        self.init_error = init_error
        self.set_error = None

    def nvmlInit(self):
        self.calls.append(("init",))
        if self.init_error is not None:
            raise self.NVMLError(self.init_error)

    def nvmlShutdown(self):
        self.calls.append(("shutdown",))

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("handle", index)

    def nvmlDeviceGetName(self, handle):
        return b"NVIDIA Fake 80GB"

    def nvmlDeviceGetSupportedMemoryClocks(self, handle):
        self.calls.append(("mem_clocks",))
        return [405, 2619, 810]

    def nvmlDeviceGetSupportedGraphicsClocks(self, handle, memory_mhz):
        self.calls.append(("gfx_clocks", memory_mhz))
        return [1200, 1980, 210, 1500] if memory_mhz == 2619 else [100]

    def nvmlDeviceSetGpuLockedClocks(self, handle, lo, hi):
        self.calls.append(("lock", handle, lo, hi))
        if self.set_error is not None:
            raise self.set_error

    def nvmlDeviceResetGpuLockedClocks(self, handle):
        self.calls.append(("reset", handle))

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        if self.energy_mj is None:
            raise self.NVMLError(NOT_SUPPORTED)
        return self.energy_mj

    def nvmlDeviceGetPowerUsage(self, handle):
        return self.power_mw

    def count(self, name):
        return sum(1 for call in self.calls if call[0] == name)


@pytest.fixture
def nvml(monkeypatch):
    fake = FakeNVML(energy_mj=123_456)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def test_name_and_clocks_sorted_and_cached(nvml):
    dev = NVMLDevice(1)
    assert dev.name == "NVIDIA Fake 80GB"
    assert dev.supported_clocks() == [1980, 1500, 1200, 210]
    assert dev.max_clock() == 1980
    assert ("gfx_clocks", 2619) in nvml.calls  # asked at the highest memory clock
    assert nvml.count("mem_clocks") == 1 and nvml.count("gfx_clocks") == 1


def test_set_clock_locks_min_max_and_skips_repeats(nvml):
    dev = NVMLDevice(2)
    dev.set_clock(1500)
    dev.set_clock(1500)
    assert [c for c in nvml.calls if c[0] == "lock"] == [("lock", ("handle", 2), 1500, 1500)]
    dev.set_clock(1200)
    assert nvml.count("lock") == 2


def test_unsupported_clock_raises_value_error(nvml):
    dev = NVMLDevice()
    with pytest.raises(ValueError, match="210..1980"):
        dev.set_clock(1000)
    assert nvml.count("lock") == 0


def test_permission_error_becomes_clock_control_error(nvml):
    dev = NVMLDevice()
    nvml.set_error = nvml.NVMLError_NoPermission(NO_PERMISSION)
    with pytest.raises(ClockControlError, match="root|rights"):
        dev.set_clock(1980)
    nvml.set_error = nvml.NVMLError(NOT_SUPPORTED)
    with pytest.raises(ClockControlError, match="does not support"):
        dev.set_clock(1980)
    dev.close()
    assert nvml.count("reset") == 0  # never locked, nothing to reset


def test_energy_counter_in_joules(nvml):
    dev = NVMLDevice()
    assert dev.energy() == pytest.approx(123.456)
    assert isinstance(dev.energy(), float)
    assert dev.power() == pytest.approx(250.0)


def test_power_integration_fallback(monkeypatch):
    fake = FakeNVML(energy_mj=None, power_mw=100_000)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    now = [10.0]
    dev = NVMLDevice(clock=lambda: now[0])
    assert dev.energy() == 0.0
    now[0], fake.power_mw = 12.0, 300_000  # 2 s ramping 100 W -> 300 W: 400 J
    assert dev.energy() == pytest.approx(400.0)
    now[0] = 13.0  # 1 s at 300 W
    assert dev.energy() == pytest.approx(700.0)


def test_close_resets_only_if_locked_and_shuts_down_once(nvml):
    dev = NVMLDevice()
    dev.close()
    assert nvml.count("reset") == 0 and nvml.count("shutdown") == 1
    dev = NVMLDevice()
    dev.set_clock(1200)
    dev.close()
    dev.close()
    assert nvml.count("reset") == 1 and nvml.count("shutdown") == 2
    assert nvml.calls[-2:] == [("reset", ("handle", 0)), ("shutdown",)]


def test_reset_clock_then_set_same_clock_locks_again(nvml):
    dev = NVMLDevice()
    dev.set_clock(1200)
    dev.reset_clock()
    dev.reset_clock()
    assert nvml.count("reset") == 1
    dev.set_clock(1200)
    assert nvml.count("lock") == 2


def test_missing_pynvml_suggests_simulated(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    with pytest.raises(RuntimeError, match="simulated"):
        NVMLDevice()


def test_missing_nvml_library_suggests_simulated(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML(init_error=LIBRARY_NOT_FOUND))
    with pytest.raises(RuntimeError, match="NVML is unavailable.*simulated"):
        NVMLDevice()


def test_synchronize_is_a_no_op_without_cuda(nvml):
    NVMLDevice().synchronize()
