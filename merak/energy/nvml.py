"""A real NVIDIA GPU as a :class:`~merak.energy.device.GPUDevice`, through NVML (``pynvml``).

Needs the ``nvidia-ml-py`` package and the driver's ``libnvidia-ml.so.1``. Reading names,
clocks, power and energy needs no special rights; *locking* clocks does: run as root, or have
an administrator run ``nvidia-smi -acp UNRESTRICTED`` (containers also need ``SYS_ADMIN``).

What each method maps to:

* :attr:`name` -- ``nvmlDeviceGetName``.
* :meth:`supported_clocks` -- ``nvmlDeviceGetSupportedGraphicsClocks`` at the highest of
  ``nvmlDeviceGetSupportedMemoryClocks``.
* :meth:`set_clock` / :meth:`reset_clock` -- ``nvmlDeviceSetGpuLockedClocks(h, mhz, mhz)`` /
  ``nvmlDeviceResetGpuLockedClocks``.
* :meth:`energy` -- ``nvmlDeviceGetTotalEnergyConsumption`` (mJ, Volta and later); on older GPUs
  a coarse trapezoid integral of ``nvmlDeviceGetPowerUsage`` taken between calls.
* :meth:`power` -- ``nvmlDeviceGetPowerUsage`` (mW).

On machines without NVIDIA GPUs use ``trainer.energy_device=simulated`` instead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from merak.energy.device import ClockControlError, GPUDevice

logger = logging.getLogger(__name__)


class NVMLDevice(GPUDevice):
    """The NVIDIA GPU with NVML index ``index``.

    Args:
        index: the NVML device index (PCI bus order; not remapped by ``CUDA_VISIBLE_DEVICES``).
        cuda_index: the torch CUDA index of the same GPU for :meth:`synchronize`
            (defaults to ``index``).
        clock: monotonic seconds, used by the power-integration fallback of :meth:`energy`.

    Raises:
        RuntimeError: ``pynvml`` or the NVML library is unavailable, or there is no such GPU.
    """

    def __init__(self, index: int = 0, cuda_index: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        try:
            import pynvml
            pynvml.nvmlInit()
        except Exception as err:  # ImportError, or pynvml.NVMLError (no library, no driver)
            raise RuntimeError(
                f"NVML is unavailable ({type(err).__name__}: {err}); NVMLDevice needs an NVIDIA "
                "GPU, its driver and the nvidia-ml-py package. On machines without NVIDIA GPUs "
                "use trainer.energy_device=simulated.") from err
        self._nvml = pynvml
        self._open = True
        try:
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(self._handle)
        except pynvml.NVMLError as err:
            self._shutdown()
            raise RuntimeError(f"NVML has no usable GPU with index {index}: {err}") from err
        self.name = name.decode() if isinstance(name, bytes) else str(name)
        self.index, self.cuda_index = index, index if cuda_index is None else cuda_index
        self._clock = clock
        self._clocks: list[int] | None = None
        self._locked: int | None = None  # the clock this object locked, if any
        self._has_counter = True  # False once the energy counter proved unsupported
        self._integrated = 0.0  # joules, for the power-integration fallback
        self._last_sample: tuple[float, float] | None = None  # (seconds, watts)

    def _is(self, err: Exception, code_name: str) -> bool:  # matches subclasses and bare codes
        return getattr(err, "value", None) == getattr(self._nvml, code_name)

    def supported_clocks(self) -> list[int]:
        """Graphics clocks supported at the highest memory clock, highest first (cached)."""
        if self._clocks is None:
            nvml = self._nvml
            mems = nvml.nvmlDeviceGetSupportedMemoryClocks(self._handle)
            clocks = mems and nvml.nvmlDeviceGetSupportedGraphicsClocks(self._handle, max(mems))
            if not clocks:
                raise ClockControlError(f"{self.name} reports no supported graphics clocks")
            self._clocks = sorted({int(c) for c in clocks}, reverse=True)
        return list(self._clocks)

    def set_clock(self, mhz: int) -> None:
        """Lock the graphics clock to ``mhz``; a no-op when this object already locked it there.

        Raises:
            ValueError: ``mhz`` is not one of :meth:`supported_clocks`.
            ClockControlError: NVML refused (missing rights, or unsupported by the GPU).
        """
        if mhz == self._locked:
            return
        clocks = self.supported_clocks()
        if mhz not in clocks:
            raise ValueError(f"{mhz} MHz is not a supported clock of {self.name} "
                             f"({clocks[-1]}..{clocks[0]} MHz, {len(clocks)} steps)")
        try:
            self._nvml.nvmlDeviceSetGpuLockedClocks(self._handle, mhz, mhz)
        except self._nvml.NVMLError as err:
            if self._is(err, "NVML_ERROR_NO_PERMISSION"):
                msg = ("locking GPU clocks needs root rights, or an administrator's "
                       "`nvidia-smi -acp UNRESTRICTED` (plus SYS_ADMIN in containers)")
            elif self._is(err, "NVML_ERROR_NOT_SUPPORTED"):
                msg = f"{self.name} does not support locking its graphics clock"
            else:
                msg = f"NVML refused to lock the clock at {mhz} MHz: {err}"
            raise ClockControlError(msg) from err
        self._locked = mhz

    def reset_clock(self) -> None:
        """Undo this object's clock lock (``nvmlDeviceResetGpuLockedClocks``); else a no-op."""
        if self._locked is None:
            return
        try:
            self._nvml.nvmlDeviceResetGpuLockedClocks(self._handle)
        except self._nvml.NVMLError as err:
            raise ClockControlError(f"NVML could not reset the locked clock: {err}") from err
        self._locked = None

    def energy(self) -> float:
        """Joules since an arbitrary origin (the driver load, or this object's first call).

        Without a hardware energy counter (before Volta) this integrates the power draw with a
        trapezoid between successive calls: coarse, and only as good as the call frequency.
        """
        if self._has_counter:
            try:
                return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) / 1000.0
            except self._nvml.NVMLError as err:
                if not self._is(err, "NVML_ERROR_NOT_SUPPORTED"):
                    raise
                logger.warning("%s has no energy counter; integrating power draw instead "
                               "(coarse)", self.name)
                self._has_counter = False
        now, watts = self._clock(), self.power()
        if self._last_sample is not None:
            then, before = self._last_sample
            self._integrated += 0.5 * (before + watts) * max(now - then, 0.0)
        self._last_sample = (now, watts)
        return self._integrated

    def power(self) -> float:
        """The current power draw in watts (``nvmlDeviceGetPowerUsage``)."""
        return self._nvml.nvmlDeviceGetPowerUsage(self._handle) / 1000.0

    def synchronize(self) -> None:
        """``torch.cuda.synchronize`` on this GPU once CUDA is initialised; else a no-op."""
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize(self.cuda_index)

    def close(self) -> None:
        """Reset the clock if this object locked it, then shut NVML down (once)."""
        if not self._open:
            return
        try:
            self.reset_clock()
        except ClockControlError as err:
            logger.warning("%s: %s", self.name, err)
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        if self._open:
            self._open = False
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError as err:
                logger.warning("nvmlShutdown failed: %s", err)
