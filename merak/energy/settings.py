"""Checks of the energy settings (``trainer.profile``, ``pfo_server_url``, ...) before any worker starts."""

from __future__ import annotations

import importlib.util
import logging

logger = logging.getLogger(__name__)

DEVICES = ("auto", "none", "nvml", "simulated")


def energy_enabled(trainer) -> bool:
    """Whether the run uses a GPU device for energy: profiling, a plan, zeus, or an explicit device."""
    return bool(trainer.profile or trainer.frequency_plan or trainer.pfo_server_url
                or trainer.energy_device in ("nvml", "simulated"))


def _server_problem(url: str) -> str | None:
    import httpx

    try:
        httpx.get(url.rstrip("/") + "/docs", timeout=5.0)
    except httpx.HTTPError as error:
        return (f"trainer.pfo_server_url={url!r}: cannot reach the zeus server ({type(error).__name__}: {error}); "
                "start it first (merak-energy serve PLAN.py)")
    return None


def energy_problems(trainer, grid, num_microbatches: int, num_chunks: int) -> list[str]:
    """Everything wrong with the energy settings, as messages naming the fields."""
    from merak.energy.simulated import SPECS

    problems: list[str] = []
    if trainer.energy_device not in DEVICES:
        problems.append(f"trainer.energy_device={trainer.energy_device!r}; use one of {', '.join(DEVICES)}")
    if str(trainer.simulated_gpu).upper() not in SPECS:
        problems.append(f"trainer.simulated_gpu={trainer.simulated_gpu!r}; use one of {', '.join(SPECS)}")
    if not (isinstance(trainer.simulated_tflops, (int, float)) and trainer.simulated_tflops > 0):
        problems.append(f"trainer.simulated_tflops={trainer.simulated_tflops!r} must be a positive number")
    if not (isinstance(trainer.num_warmup_steps, int) and trainer.num_warmup_steps >= 0):
        problems.append(f"trainer.num_warmup_steps={trainer.num_warmup_steps!r} must be an integer >= 0")
    if not (isinstance(trainer.num_prof_steps, int) and trainer.num_prof_steps >= 1):
        problems.append(f"trainer.num_prof_steps={trainer.num_prof_steps!r} must be a positive integer")
    chosen = [name for name in ("profile", "frequency_plan", "pfo_server_url") if getattr(trainer, name)]
    if len(chosen) > 1:
        problems.append(f"trainer.{' and trainer.'.join(chosen)} are exclusive: profile, run a plan file, or "
                        "take plans from a zeus server")
    if energy_enabled(trainer) and trainer.energy_device == "none":
        problems.append(f"trainer.{chosen[0] if chosen else 'energy_device'} needs a GPU device: set "
                        "trainer.energy_device to auto, nvml or simulated")
    if trainer.profile and num_microbatches != 1:
        problems.append(f"trainer.profile=true profiles one microbatch per step; set gradient_accumulation_steps=1 "
                        f"(and global_batch_size=null), not {num_microbatches} microbatches")
    if trainer.frequency_plan:
        from merak.energy.dag import step_graph
        from merak.energy.plans import PlanError, check_plan, read_plan

        try:
            graph = step_graph(trainer.train_schedule, grid.pp, num_microbatches, num_chunks)
            check_plan(read_plan(trainer.frequency_plan), graph, source=f"trainer.frequency_plan={trainer.frequency_plan}")
        except (PlanError, ValueError) as error:
            problems.append(str(error))
    if trainer.pfo_server_url:
        if importlib.util.find_spec("zeus") is None:
            problems.append("trainer.pfo_server_url needs zeus: pip install 'merak[energy]'")
        else:
            problem = _server_problem(trainer.pfo_server_url)
            if problem:
                problems.append(problem)
    return problems
