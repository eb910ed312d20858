"""A simulated GPU: supported clocks, and time and power as functions of the locked clock.

It lets profiling, frequency plans and the zeus protocol run on machines without GPUs. The
work of a compute instruction is given as its duration at the highest clock; running it at
clock ``f`` takes::

    time(f) = t_max * (memory_bound + (1 - memory_bound) * f_max / f)

(the compute-bound part scales with the clock, the memory-bound part does not), and the
GPU draws::

    power(f) = static_power + (max_power - static_power) * (f / f_max) ** 3

(dynamic power goes with f * V**2, and the voltage with the clock) while it computes, and
``blocked_power`` while it waits (on communication or its peers). Energy is power integrated
over wall time. The instruction really takes ``time(f)`` of wall time:
:meth:`SimulatedGPU.end_compute` sleeps for what the CPU work left of it, so pipeline stages
wait for each other exactly as GPUs would.

Calibration (``SPECS``): the clock ranges are the data sheets' supported graphics clocks in
15 MHz steps (A100 SXM4: 210-1410 MHz; H100 SXM5: 345-1980 MHz) and ``max_power`` is the
board's TDP (400 W, 700 W). ``static_power``, ``blocked_power`` and ``memory_bound`` are
modelling choices of the order published for these boards, not measurements: they put the
energy-minimal clock near 55 % of the maximum, with about a third less energy than at the
highest clock, and make slowing a critical instruction near the highest clock save more than
the blocked power of eight waiting GPUs, as on real pipelines.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from dataclasses import dataclass

from merak.energy.device import GPUDevice

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GPUSpec:
    """The clock range and power figures of one simulated board."""

    name: str
    min_clock: int
    max_clock: int
    clock_step: int
    max_power: float
    static_power: float
    blocked_power: float
    memory_bound: float = 0.3

    def clocks(self) -> list[int]:
        """Supported graphics clocks, highest first."""
        return list(range(self.max_clock, self.min_clock - 1, -self.clock_step))

    def time(self, seconds_at_max: float, clock: int) -> float:
        """How long work taking ``seconds_at_max`` at the highest clock takes at ``clock``."""
        return seconds_at_max * (self.memory_bound + (1.0 - self.memory_bound) * self.max_clock / clock)

    def busy_power(self, clock: int) -> float:
        """Watts drawn while computing at ``clock``."""
        return self.static_power + (self.max_power - self.static_power) * (clock / self.max_clock) ** 3

    def energy(self, seconds_at_max: float, clock: int) -> float:
        """Joules used by work taking ``seconds_at_max`` at the highest clock, run at ``clock``."""
        return self.busy_power(clock) * self.time(seconds_at_max, clock)


SPECS: dict[str, GPUSpec] = {
    "A100": GPUSpec("A100", min_clock=210, max_clock=1410, clock_step=15,
                    max_power=400.0, static_power=120.0, blocked_power=80.0),
    "H100": GPUSpec("H100", min_clock=345, max_clock=1980, clock_step=15,
                    max_power=700.0, static_power=200.0, blocked_power=130.0),
}


def gpu_spec(name: str) -> GPUSpec:
    """The spec called ``name`` (case-insensitive), or a ValueError naming the known ones."""
    spec = SPECS.get(name.upper())
    if spec is None:
        raise ValueError(f"unknown simulated GPU {name!r}; choose one of {', '.join(SPECS)}")
    return spec


class SimulatedGPU(GPUDevice):
    """A GPU that exists as a power model (see the module docstring).

    The locked clock lives in shared memory, so a helper process forked from this one (a clock
    controller like the one zeus runs for real GPUs) can change it, as it would change a real GPU's.

    Args:
        spec: a :class:`GPUSpec` or the name of one in ``SPECS``.
        clock_source: ``time.perf_counter``-like function (tests pass a fake one).
        sleep: ``time.sleep``-like function.
        clock_cap: the highest clock it really runs at, whatever it is set to (a throttled or slower
            GPU: a straggler for tests); one of the supported clocks.
    """

    def __init__(self, spec: GPUSpec | str = "A100", *, clock_source=time.perf_counter, sleep=time.sleep,
                 clock_cap: int | None = None) -> None:
        self.spec = gpu_spec(spec) if isinstance(spec, str) else spec
        self.name = f"simulated {self.spec.name}"
        self._clocks = self.spec.clocks()
        if clock_cap is not None and clock_cap not in self._clocks:
            raise ValueError(f"{self.name} has no clock {clock_cap} MHz to cap at ({self.spec.min_clock}-"
                             f"{self.spec.max_clock} MHz in {self.spec.clock_step} MHz steps)")
        self.clock_cap = clock_cap if clock_cap is not None else self.spec.max_clock
        if clock_cap is not None:
            self.name += f" capped at {clock_cap} MHz"
        self._locked = multiprocessing.Value("i", self.clock_cap, lock=False)
        self._now, self._sleep = clock_source, sleep
        self._joules = 0.0
        self._last = self._now()
        self._busy_since: float | None = None
        self.overruns = 0  # instructions whose CPU work took longer than the simulated GPU would

    def supported_clocks(self) -> list[int]:
        return list(self._clocks)

    def set_clock(self, mhz: int) -> None:
        if mhz not in self._clocks:
            raise ValueError(f"{self.name} supports {self.spec.min_clock}-{self.spec.max_clock} MHz in "
                             f"{self.spec.clock_step} MHz steps, not {mhz}")
        self._locked.value = min(int(mhz), self.clock_cap)

    def reset_clock(self) -> None:
        self._locked.value = self.clock_cap

    @property
    def clock(self) -> int:
        """The graphics clock it runs at (MHz): the locked one, at most the cap."""
        return self._locked.value

    def energy(self) -> float:
        if self._busy_since is None:
            self._accrue_blocked()
        return self._joules

    def power(self) -> float:
        return self.spec.busy_power(self.clock) if self._busy_since is not None else self.spec.blocked_power

    def _accrue_blocked(self) -> None:
        now = self._now()
        self._joules += self.spec.blocked_power * (now - self._last)
        self._last = now

    def begin_compute(self) -> None:
        """Start a compute instruction (the time since the last one was spent blocked)."""
        self._accrue_blocked()
        self._busy_since = self._last

    def end_compute(self, seconds_at_max: float) -> float:
        """Finish the instruction begun last: wait until it has taken ``time(clock)`` and charge its
        energy. The clock is read now, so a change made while it ran (asynchronously, as zeus's
        controller does) applies to it. Returns the simulated duration."""
        if self._busy_since is None:
            raise RuntimeError("end_compute without begin_compute")
        clock = self.clock
        target = self.spec.time(seconds_at_max, clock)
        elapsed = self._now() - self._busy_since
        if elapsed < target:
            self._sleep(target - elapsed)
        elif target > 0:
            self.overruns += 1
            if self.overruns == 1:
                logger.warning("the CPU work of an instruction took %.1f ms, longer than the simulated %s would "
                               "(%.1f ms): lower trainer.simulated_tflops so the simulated GPU is the bottleneck",
                               elapsed * 1e3, self.spec.name, target * 1e3)
        duration = max(target, elapsed)
        self._joules += self.spec.busy_power(clock) * duration
        self._last = self._busy_since + duration
        self._busy_since = None
        return duration
