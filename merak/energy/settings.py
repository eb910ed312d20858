"""The energy section of the ``trainer`` config (docs/energy.md): instruction profiling and
per-instruction GPU clocks, and its checks before any worker starts. Consumed by merak.energy.runtime."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

from merak.core.fields import non_negative, positive, positive_finite, setting

logger = logging.getLogger(__name__)

DEVICES = ("auto", "none", "nvml", "simulated")


@dataclass(frozen=True)
class EnergySettings:
    """Profiling, frequency plans and the GPU device that measures energy (the first four are
    Merak-Zeus's names)."""

    profile: bool = setting(False, "profile every instruction at every clock (fastest with the fewest microbatches "
                                   "the schedule allows: gradient_accumulation_steps=1); writes merak+...csv")
    num_warmup_steps: int = setting(2, "profile: unmeasured steps per clock; with pfo_server_url: steps before "
                                       "the measured ones", check=non_negative, requirement="must be an integer >= 0")
    num_prof_steps: int = setting(4, "profile: measured steps per clock; with pfo_server_url: steps reported to "
                                     "the server", check=positive, requirement="must be a positive integer")
    profile_clock_step: int | None = setting(None, "profile: MHz between profiled clocks, from the highest down "
                                                   "(null: every supported clock; a coarser profile is quicker "
                                                   "and gives the planner fewer clocks to choose from)",
                                             check=positive, requirement="must be a positive integer")
    pfo_server_url: str | None = setting(None, "a zeus pipeline-frequency server (merak-energy serve) to take "
                                               "the clock plan from")
    energy_device: str = setting("auto", "auto (NVML on CUDA when it answers, else: energy features on a "
                                         "simulated GPU, plain runs unmeasured) | nvml | simulated | none")
    simulated_gpu: str = setting("A100", "A100 | H100: the simulated GPU's clock range and power model")
    simulated_tflops: float = setting(0.004, "simulated GPU speed at its highest clock (small: the CPU work of "
                                             "an instruction must fit inside it)",
                                      check=positive_finite, requirement="must be a positive number")
    frequency_plan: str | None = setting(None, "a plan file (merak-energy plan's plan.py) to run locally, "
                                               "without a server")
    frequency_frontier: str | None = setting(None, "a frontier file (merak-energy plan's frontier.json): run its "
                                                   "fastest plan (or frontier_deadline's) and, with dp > 1, slow "
                                                   "the pipelines that wait for a straggler")
    frontier_deadline: float | None = setting(None, "with frequency_frontier: start at the least-energy plan "
                                                    "predicted to take at most this many seconds per step",
                                              check=positive_finite, requirement="must be a positive number")
    straggler_window: int = setting(4, "with frequency_frontier: steps whose mean time each pipeline measures "
                                       "before the slowest sets the target (0: never switch plans)",
                                    check=non_negative, requirement="must be an integer >= 0")
    straggler_hysteresis: float = setting(0.02, "switch plans only when the straggler's time moved by more than "
                                                "this fraction since the last switch",
                                          check=non_negative, requirement="must be a number >= 0")
    straggler_margin: float = setting(0.01, "a slowed pipeline aims this fraction below the straggler's time",
                                      check=non_negative, requirement="must be a number >= 0")
    simulated_straggler_pipeline: int | None = setting(None, "testing: the data-parallel rank whose simulated "
                                                             "GPUs run no faster than simulated_straggler_clock",
                                                       check=non_negative, requirement="must be an integer >= 0")
    simulated_straggler_clock: int | None = setting(None, "testing: the straggler's clock cap in MHz",
                                                    check=positive, requirement="must be a positive integer")

    @property
    def features(self) -> bool:
        """Whether an energy feature is on (profiling, a plan, a frontier, zeus): they need a GPU device
        and every compute instruction's time and energy."""
        return bool(self.profile or self.frequency_plan or self.frequency_frontier or self.pfo_server_url)

    @property
    def enabled(self) -> bool:
        """Whether the run must measure with a GPU device: an energy feature, or an explicit device.
        (With ``auto`` and no feature a run still measures where NVML answers: merak.energy.runtime.)"""
        return self.features or self.energy_device in ("nvml", "simulated")

    def problems(self, *, schedule: str, pp: int, num_microbatches: int, num_chunks: int, dp: int = 1) -> list[str]:
        """Everything wrong with these values for the run's schedule and layout."""
        return energy_problems(self, schedule, pp, num_microbatches, num_chunks, dp)


def _answer(response) -> str:
    """What a response was, in one line: status, server, content type and the start of its body."""
    kind = response.headers.get("content-type", "no content type").split(";")[0]
    who = ", ".join(filter(None, (response.headers.get("server"), kind)))
    start = " ".join(response.text[:400].split())[:80]
    return f"{response.status_code} {response.reason_phrase} ({who}: {start!r})"


def _server_problem(url: str) -> str | None:
    """Why ``url`` is not a zeus pipeline-frequency server, or None.

    Answering is not enough: any web server answers. zeus's server is a FastAPI app, whose
    OpenAPI description lists the endpoints that merak's and zeus's clients call; another web
    server answers 404, HTML, or an API without them.
    """
    import httpx
    from zeus.optimizer.pipeline_frequency.common import (
        GET_FREQUENCY_SCHEDULE_URL,
        REGISTER_JOB_URL,
        REGISTER_RANK_URL,
        REPORT_PROFILING_RESULT_URL,
    )

    where = f"trainer.pfo_server_url={url!r}"
    asked = url.rstrip("/") + "/openapi.json"
    try:
        response = httpx.get(asked, timeout=5.0)
    except (httpx.HTTPError, httpx.InvalidURL) as error:
        return (f"{where}: cannot reach the zeus server ({type(error).__name__}: {error}); "
                "start it first (merak-energy serve PLAN.py)")
    needed = (REGISTER_JOB_URL, REGISTER_RANK_URL, GET_FREQUENCY_SCHEDULE_URL, REPORT_PROFILING_RESULT_URL)
    paths = None
    if response.status_code == 200:
        try:
            paths = response.json().get("paths")
        except (ValueError, AttributeError):  # not JSON, or JSON but not an object
            paths = None
    if isinstance(paths, dict) and all(path in paths for path in needed):
        return None
    if isinstance(paths, dict):
        missing = [path for path in needed if path not in paths]
        answer = f"an API without {', '.join(missing)}"
    else:
        answer = _answer(response)
    return (f"{where} is not a zeus pipeline-frequency server: GET {asked} answered {answer}; "
            "point it at merak-energy serve (or zeus's server)")


def energy_problems(energy, schedule: str, pp: int, num_microbatches: int, num_chunks: int,
                    dp: int = 1) -> list[str]:
    """Everything wrong with the energy settings, as messages naming the fields."""
    from merak.energy.simulated import SPECS

    problems: list[str] = []
    if energy.energy_device not in DEVICES:
        problems.append(f"trainer.energy_device={energy.energy_device!r}; use one of {', '.join(DEVICES)}")
    if str(energy.simulated_gpu).upper() not in SPECS:
        problems.append(f"trainer.simulated_gpu={energy.simulated_gpu!r}; use one of {', '.join(SPECS)}")
    if not (isinstance(energy.simulated_tflops, (int, float)) and energy.simulated_tflops > 0):
        problems.append(f"trainer.simulated_tflops={energy.simulated_tflops!r} must be a positive number")
    if not (isinstance(energy.num_warmup_steps, int) and energy.num_warmup_steps >= 0):
        problems.append(f"trainer.num_warmup_steps={energy.num_warmup_steps!r} must be an integer >= 0")
    if not (isinstance(energy.num_prof_steps, int) and energy.num_prof_steps >= 1):
        problems.append(f"trainer.num_prof_steps={energy.num_prof_steps!r} must be a positive integer")
    chosen = [name for name in ("profile", "frequency_plan", "frequency_frontier", "pfo_server_url")
              if getattr(energy, name)]
    if len(chosen) > 1:
        problems.append(f"trainer.{' and energy.'.join(chosen)} are exclusive: profile, run a plan file, run "
                        "a frontier, or take plans from a zeus server")
    if energy.enabled and energy.energy_device == "none":
        problems.append(f"trainer.{chosen[0] if chosen else 'energy_device'} needs a GPU device: set "
                        "trainer.energy_device to auto, nvml or simulated")
    if energy.frequency_plan:
        from merak.energy.dag import step_graph
        from merak.energy.plans import PlanError, check_plan, read_plan

        try:
            graph = step_graph(schedule, pp, num_microbatches, num_chunks)
            check_plan(read_plan(energy.frequency_plan), graph,
                       source=f"trainer.frequency_plan={energy.frequency_plan}")
        except (PlanError, ValueError) as error:
            problems.append(str(error))
    if energy.frequency_frontier:
        from merak.energy.frontier import FrontierError, read_frontier

        try:
            read_frontier(energy.frequency_frontier).check(schedule, pp, num_microbatches, num_chunks,
                                                            source=f"trainer.frequency_frontier={energy.frequency_frontier}")
        except FrontierError as error:
            problems.append(str(error))
    elif energy.frontier_deadline is not None:
        problems.append("trainer.frontier_deadline needs trainer.frequency_frontier")
    problems += _straggler_problems(energy, dp)
    if energy.pfo_server_url:
        if importlib.util.find_spec("zeus") is None:
            problems.append("trainer.pfo_server_url needs zeus: pip install 'merak[energy]'")
        else:
            problem = _server_problem(energy.pfo_server_url)
            if problem:
                problems.append(problem)
    return problems


def _straggler_problems(energy, dp: int) -> list[str]:
    """The simulated straggler's settings: both or neither, on a simulated GPU, a real pipeline and clock."""
    from merak.energy.simulated import SPECS

    pipeline, clock = energy.simulated_straggler_pipeline, energy.simulated_straggler_clock
    if pipeline is None and clock is None:
        return []
    if pipeline is None or clock is None:
        return ["trainer.simulated_straggler_pipeline and trainer.simulated_straggler_clock go together: set both"]
    problems = []
    if energy.energy_device not in ("auto", "simulated"):
        problems.append(f"trainer.simulated_straggler_pipeline needs a simulated GPU, not "
                        f"energy_device={energy.energy_device!r}")
    if not 0 <= pipeline < dp:
        problems.append(f"trainer.simulated_straggler_pipeline={pipeline} is not a data-parallel rank of dp={dp}")
    spec = SPECS.get(str(energy.simulated_gpu).upper())
    if spec is not None and clock not in spec.clocks():
        problems.append(f"trainer.simulated_straggler_clock={clock} is not a clock of the simulated {spec.name} "
                        f"({spec.min_clock}-{spec.max_clock} MHz in {spec.clock_step} MHz steps)")
    return problems
