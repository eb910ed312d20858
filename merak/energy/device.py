"""One interface over the GPUs whose clocks and energy merak's energy features use.

Two backends implement it: :class:`merak.energy.nvml.NVMLDevice` (a real NVIDIA GPU through
NVML) and :class:`merak.energy.simulated.SimulatedGPU` (a power model that lets the same
profiling and frequency plans run on CPU machines).
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class ClockControlError(RuntimeError):
    """The device refused a clock change (usually: the process lacks the rights to lock clocks)."""


class GPUDevice(ABC):
    """A GPU whose graphics clock can be locked and whose energy counter can be read.

    Clocks are in MHz, energy in joules and power in watts.
    """

    #: A short human-readable name ("NVIDIA H100 80GB HBM3", "simulated A100").
    name: str = "gpu"

    @abstractmethod
    def supported_clocks(self) -> list[int]:
        """The graphics clocks the device can be locked to, highest first."""

    def max_clock(self) -> int:
        """The highest supported graphics clock."""
        return self.supported_clocks()[0]

    @abstractmethod
    def set_clock(self, mhz: int) -> None:
        """Lock the graphics clock to ``mhz`` (one of :meth:`supported_clocks`).

        Raises:
            ClockControlError: the device or the process's rights do not allow it.
        """

    @abstractmethod
    def reset_clock(self) -> None:
        """Return the graphics clock to the driver's default policy."""

    @abstractmethod
    def energy(self) -> float:
        """Energy used since an arbitrary fixed origin, in joules (differences are meaningful)."""

    @abstractmethod
    def power(self) -> float:
        """The current power draw in watts."""

    def synchronize(self) -> None:  # noqa: B027  (optional hook: a no-op unless a device overrides it)
        """Wait until the work queued on the device has finished (no-op where nothing is queued)."""

    def close(self) -> None:  # noqa: B027  (optional hook: a no-op unless a device overrides it)
        """Release the device (reset locked clocks this object set)."""
