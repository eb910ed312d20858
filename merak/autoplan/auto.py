"""``parallel=auto``: plan the layout before the run is resolved, then run the chosen one.

The config selects ``parallel: auto`` and optionally a ``cluster`` (``cluster=h100-80 cluster.nodes=64``;
default: this machine's processes). The planner ranks every layout for ``trainer.global_batch_size``; on
this machine the trials then choose (:mod:`merak.autoplan.trials`). It writes ``plan.json``, logs the table
and returns the config with the chosen settings (``dry_run=true``: only partitioned, no trials).
"""

from __future__ import annotations

import logging
import math
import os
import sys

from omegaconf import DictConfig, OmegaConf, open_dict

from merak.autoplan.cluster import THIS, Cluster, load_cluster, usable_cores
from merak.autoplan.commands import format_commands, launch_commands
from merak.autoplan.energy import Objective, frontier_for_run
from merak.autoplan.planner import PlanError, plan_for_settings, requested_global_batch, single_process_settings
from merak.autoplan.table import format_table
from merak.autoplan.trials import TRIAL_SECONDS, TRIAL_STEPS, TRIALS, Train, layout_config, run_trials
from merak.config import ConfigError
from merak.core.files import write_json_atomic

logger = logging.getLogger(__name__)

PLAN_FILE = "plan.json"
FRONTIER_FILE = "frontier.json"  # with an energy objective: the chosen layout's clock plans


def wants_auto(cfg: DictConfig) -> bool:
    """Whether the config asks merak to choose the layout (``parallel=auto``)."""
    parallel = cfg.get("parallel") or {}
    return bool(parallel.get("auto", False))


def _cluster(cfg: DictConfig, world_size: int | None) -> Cluster:
    spec = cfg.get("cluster")
    spec = OmegaConf.to_container(spec, resolve=True) if spec is not None else THIS
    try:
        return load_cluster(spec, processes=world_size)
    except ValueError as error:
        raise ConfigError(f"invalid configuration:\n  - cluster: {error}") from None


def _world_size(cfg: DictConfig, outside_world: int | None) -> int | None:
    if outside_world is not None:
        return outside_world
    value = (cfg.get("parallel") or {}).get("world_size")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"invalid configuration:\n  - parallel.world_size={value!r} must be a positive integer")
    return value


def plan_layout(spec, cfg: DictConfig, *, outside_world: int | None, train: Train | None = None) -> DictConfig:
    """The config with ``parallel`` and the trainer settings chosen (see the module docstring). Under an
    outside launcher (torchrun, srun) every rank plans by itself and nothing is tried; ``train`` runs a composed
    config of this recipe (:func:`merak.runner.run`) for the trials (``parallel.trials=0``: none)."""
    deterministic = outside_world is not None
    world = _world_size(cfg, outside_world)
    trials, trial_steps, trial_seconds = _trial_settings(cfg)
    cluster = _cluster(cfg, world or usable_cores())
    if world is None:
        world = cluster.world_size
    settings = single_process_settings(spec, cfg)
    objective = _objective(cfg)
    try:
        report = plan_for_settings(spec, settings, world_size=world, cluster=cluster,
                                   global_batch_size=requested_global_batch(cfg), objective=objective)
    except PlanError as error:
        raise ConfigError(f"invalid configuration:\n  - parallel=auto: {error}") from None
    outcome = None
    if train is not None and not deterministic and not cfg.get("dry_run") and trials > 0 \
            and cluster.cores_per_node is not None and world <= cluster.devices_per_node:
        if objective.wants_energy:  # trials time the layouts; the energy prediction decides
            logger.info("parallel.objective=%s: no trials, the least predicted energy is chosen", objective)
        else:
            outcome = run_trials(report.candidates, cfg, train, count=trials, steps=trial_steps,
                                 seconds=trial_seconds)
    best = outcome.chosen.layout if outcome is not None else report.best.layout
    # Every rank writes the same frontier (the planner is deterministic): under torchrun/srun each plans alone.
    clock_plan = _clock_plan(report, objective, settings.output_dir) if objective.wants_energy else {}
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        os.makedirs(settings.output_dir, exist_ok=True)
        path = os.path.join(settings.output_dir, PLAN_FILE)
        plan = report.to_json(top=50)
        if outcome is not None:
            plan["trials"] = outcome.to_json()
        plan["run_clock_plan"] = clock_plan or None
        write_json_atomic(path, plan)
        tried = f"\n{outcome.describe()}" if outcome is not None and outcome.trials else ""
        table = format_table(report, chosen=outcome.chosen if outcome is not None else None)
        logger.info("parallel=auto chose %s\n%s%s\nwrote %s", best.key(), table, tried, path)
        if cfg.get("dry_run") and cluster.device_type == "cuda":
            overrides = [*_task_overrides(), *(f"trainer.{k}={v}" for k, v in clock_plan.items())]
            commands = launch_commands(sys.argv[0], overrides, best, cluster)
            logger.info("to run it on %s:\n%s", cluster.name, format_commands(commands))
    chosen = layout_config(cfg, best)
    if clock_plan:
        with open_dict(chosen):
            for key, value in clock_plan.items():
                OmegaConf.update(chosen, f"trainer.{key}", value)
    if cfg.get("dry_run") and outcome is None:
        with open_dict(chosen):  # the dry run's stage table is priced as the table above, not on this machine
            chosen.parallel.priced = priced_stages(report, report.best)
    return chosen


def priced_stages(report, candidate) -> dict:
    """The planner's pricing of ``candidate`` per pipeline stage on the report's cluster: forward + backward
    (+ recomputation) seconds per microbatch and memory per device, with the step and what it assumed."""
    layout = candidate.layout
    pieces = report.cost_model.pieces(layout)
    stages = []
    for stage in range(layout.pp):
        mine = [pieces[chunk * layout.pp + stage] for chunk in range(layout.chunks)]
        seconds = sum(p.forward + p.backward + (p.recompute if layout.recomputes else 0.0) for p in mine)
        stages.append({"fwd_bwd_s": seconds, "memory_bytes": int(candidate.prediction.stage_memory[stage])})
    cluster = report.cluster
    return {"cluster": cluster.name, "devices": f"{report.world_size} x {cluster.accelerator.name}",
            "schedule": layout.schedule if layout.chunks == 1 else f"{layout.schedule} x{layout.chunks}",
            "num_microbatches": layout.num_microbatches, "zero_stage": layout.zero_stage,
            "recompute": layout.recompute, "step_s": candidate.prediction.step_s, "stages": stages}


def _clock_plan(report, objective: Objective, output_dir: str) -> dict:
    """The trainer settings that run the chosen layout's clock plan: its frontier, written into the run
    directory, and the deadline selecting the objective's plan on it."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.abspath(os.path.join(output_dir, FRONTIER_FILE))
    deadline = frontier_for_run(report, report.best, objective, path)
    return {"frequency_frontier": path, "frontier_deadline": deadline}


def _objective(cfg: DictConfig) -> Objective:
    """``parallel.objective``, checked."""
    value = (cfg.get("parallel") or {}).get("objective", "time")
    try:
        return Objective.parse(value)
    except ValueError as error:
        raise ConfigError(f"invalid configuration:\n  - parallel.{error}") from None


def _task_overrides() -> list[str]:
    """The command line's overrides of this Hydra job (none outside Hydra)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return [str(o) for o in HydraConfig.get().overrides.task]
    except (ImportError, ValueError):
        return []


def _trial_settings(cfg: DictConfig) -> tuple[int, int, float]:
    """(``parallel.trials``, ``parallel.trial_steps``, ``parallel.trial_seconds``), checked."""
    parallel = cfg.get("parallel") or {}
    values = {"trials": parallel.get("trials", TRIALS), "trial_steps": parallel.get("trial_steps", TRIAL_STEPS)}
    minimum = {"trials": 0, "trial_steps": 1}
    problems = [f"parallel.{name}={value!r} must be an integer >= {minimum[name]}" for name, value in values.items()
                if isinstance(value, bool) or not isinstance(value, int) or value < minimum[name]]
    seconds = parallel.get("trial_seconds", TRIAL_SECONDS)
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < math.inf:
        problems.append(f"parallel.trial_seconds={seconds!r} must be a number >= 0 (0: exactly trial_steps steps)")
    if problems:
        raise ConfigError("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))
    return values["trials"], values["trial_steps"], float(seconds)
