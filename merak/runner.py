"""merak.run(spec, cfg): validate, launch workers, train, and summarize.

The Hydra process validates the config and prepares the data once, then
either joins the processes an outside launcher started (torchrun, srun) or
starts ``dp*tp*pp`` workers itself. Each worker builds the model, keeps its
own stage and trains it; rank 0 writes ``metrics.jsonl`` and ``summary.json``
in the run directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from dataclasses import replace

import torch
from omegaconf import OmegaConf

from merak.autoplan.auto import plan_layout, wants_auto
from merak.checkpoint import CheckpointError, find_checkpoint
from merak.checkpoint.files import read_manifest
from merak.checkpoint.identity import checkpoints_that_conflict
from merak.compat.allocator import keep_freed_memory
from merak.config import ConfigError, RunSettings, resolve_settings, total_steps
from merak.config.overrides import hydra_run_record
from merak.core.files import write_json_atomic
from merak.core.partition import PartitionError
from merak.data.batching import BatchPlan
from merak.distributed import groups
from merak.distributed.launch import (
    RunInterrupted,
    WorkerFailed,
    default_start_method,
    existing_world_size,
    interrupts_raise,
    spawn_workers,
)
from merak.energy.profile import run_profile
from merak.energy.runtime import start_energy
from merak.report.console import configure_worker_logging, only_errors, use_merak_format
from merak.report.metrics import (
    format_partition,
    format_summary,
    peak_rss_bytes,
)
from merak.session.run_directory import RunDirectoryBusy, RunDirectoryLock
from merak.session.training import TrainingSession, assemble_worker
from merak.shard.split import ShardingError
from merak.tensor_parallel.options import tensor_parallel_state_kept
from merak.tensor_parallel.plan import TPPlanError
from merak.trace.capture import TraceError
from merak.trace.meta import parameters_on_meta
from merak.trace.reuse import captures_reused

logger = logging.getLogger(__name__)

__all__ = ["ConfigError", "run", "run_command"]

# Exit statuses of run_command: a run that cannot start as configured, and one that failed.
EXIT_CANNOT_START = 2
EXIT_FAILED = 1


def _steps_per_epoch(settings: RunSettings, num_samples: int) -> int:
    plan = BatchPlan(num_samples=num_samples, micro_batch_size=settings.trainer.batch.per_device_train_batch_size,
                     num_microbatches=settings.num_microbatches, dp_size=settings.grid.dp)
    return plan.steps_per_epoch


def run(spec, cfg) -> dict:
    """Train ``spec`` with the composed Hydra config ``cfg`` and return the run summary.

    Raises:
        ConfigError: before any worker starts, when the config cannot work.
        merak.session.run_directory.RunDirectoryBusy: another run is using the output directory.
        merak.distributed.launch.WorkerFailed: when a worker fails (others are stopped).
        merak.distributed.launch.RunInterrupted: on SIGINT or SIGTERM (workers are stopped).
    """
    return _run(spec, cfg, records_job=True)


def _run(spec, cfg, *, records_job: bool) -> dict:
    use_merak_format()
    outside_world = existing_world_size()
    if wants_auto(cfg):  # trial runs do not write the job's record: the run they choose does
        cfg = plan_layout(spec, cfg, outside_world=outside_world,
                          train=lambda trial: _run(spec, trial, records_job=False))
    settings = resolve_settings(spec, cfg, world_size=outside_world)
    _check_output_dir(settings.output_dir)
    lock = _run_directory_lock(settings.output_dir, outside_world)
    record = hydra_run_record(cfg) if records_job and isinstance(lock, RunDirectoryLock) else contextlib.nullcontext()
    with interrupts_raise(), lock, record:
        return _run_locked(spec, cfg, settings, outside_world)


def run_command(spec, cfg) -> dict:
    """:func:`run` as a command (a recipe's ``train.py``): a config error, a busy run directory, a
    damaged checkpoint or a failed worker is logged as its message alone, without the launcher's
    traceback, and the process exits with status 2 (cannot start) or 1 (failed); SIGINT/SIGTERM end
    it with 128 + the signal number. In a Hydra sweep (``-m``) the errors are raised as they are, so
    the sweep records the failed job and goes on with the others.
    """
    try:
        return run(spec, cfg)
    except RunInterrupted as interrupt:
        logger.error("%s", interrupt)
        raise SystemExit(interrupt.exit_code) from None
    except (ConfigError, RunDirectoryBusy, CheckpointError, WorkerFailed) as error:
        if _in_sweep():
            raise
        logger.error("%s", error)
        raise SystemExit(EXIT_FAILED if isinstance(error, WorkerFailed) else EXIT_CANNOT_START) from None


def _in_sweep() -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        return HydraConfig.get().mode == RunMode.MULTIRUN
    except (ImportError, ValueError):  # not under Hydra
        return False


def _check_output_dir(output_dir: str) -> None:
    """The run directory exists (or can be made) and takes files: said in one line before anything starts."""
    try:
        os.makedirs(output_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=output_dir):
            pass
    except OSError as error:
        why = f"{error.strerror}: {error.filename}" if error.strerror and error.filename else str(error)
        raise ConfigError(f"invalid configuration:\n  - the run directory {output_dir} cannot be written ({why}); "
                          f"choose another (hydra.run.dir=... or trainer.output_dir=...)") from None


def _run_directory_lock(output_dir: str, outside_world: int | None):
    """The output directory's lock, taken by the launcher (or rank 0 of an outside launcher)."""
    launcher_rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))  # torchrun, or srun
    if outside_world is not None and launcher_rank != "0":
        return contextlib.nullcontext()
    return RunDirectoryLock(output_dir)


def _run_locked(spec, cfg, settings: RunSettings, outside_world: int | None) -> dict:
    prepared = spec.prepare_data(settings.data_cfg, settings.model_cfg)
    os.makedirs(settings.output_dir, exist_ok=True)
    if cfg.get("dry_run"):  # it plans, it does not train: the data need not hold a global batch
        priced = (cfg.get("parallel") or {}).get("priced")
        return dry_run(spec, settings, prepared,
                       priced=OmegaConf.to_container(priced) if priced is not None else None)
    num_samples = len(spec.load_dataset(prepared, settings.model_cfg))
    try:
        steps = total_steps(settings, _steps_per_epoch(settings, num_samples))
    except ValueError as error:
        raise ConfigError(f"invalid configuration:\n  - {error}") from None
    resume = _checkpoint_to_resume(settings)
    _check_checkpoints_fit(spec, settings, resume)
    plans_first = (settings.trainer.sharding.trace_method is not None and settings.grid.pp > 1) \
        or settings.grid.tp > 1 or settings.trainer.schedule.chunks > 1
    # The planning capture is rebuilt, not traced again, by the worker in this process or the workers it
    # forks (spawned workers start afresh: remembering would only cost a copy of the graph).
    reused = plans_first and (outside_world is not None or settings.grid.world_size == 1
                              or _forks_workers(settings, outside_world))
    with captures_reused() if reused else contextlib.nullcontext():
        return _plan_and_train(spec, settings, prepared, steps, resume, outside_world, plans_first=plans_first)


def _plan_and_train(spec, settings: RunSettings, prepared, steps: int, resume: str | None,
                    outside_world: int | None, *, plans_first: bool) -> dict:
    if plans_first:
        # To fail early: the workers plan again, identically, and report it then (once, on rank 0).
        with only_errors():
            plan_before_launch(spec, settings, prepared)
            if _forks_workers(settings, outside_world):
                for tp_rank in range(1, settings.grid.tp):  # each tp rank's slice is its own graph
                    plan_before_launch(spec, settings, prepared, tp_rank=tp_rank)
    warn_about_idle_stages(settings)
    grid = settings.grid
    logger.info("training %s/%s with dp=%d tp=%d pp=%d (%d process%s), %d steps, schedule %s",
                spec.name, settings.model_cfg.get("name", "?"), grid.dp, grid.tp, grid.pp, grid.world_size,
                "" if grid.world_size == 1 else "es", steps, settings.trainer.schedule.train_schedule)
    args = (spec, settings, prepared, steps, resume)
    if outside_world is not None or grid.world_size == 1:
        # This process is a worker; only rank 0 gets the summary.
        summary = train_worker(*args, in_launcher=outside_world is None)
        if summary is None:
            return {}
    else:
        spawn_workers(train_worker, world_size=grid.world_size, args=args,
                      start_method=settings.launcher.start_method, store_timeout_s=settings.launcher.timeout_s,
                      env={"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS":
                           str(settings.launcher.threads_per_rank)})
        with open(os.path.join(settings.output_dir, "summary.json"), encoding="utf-8") as handle:
            summary = json.load(handle)
    if "profile" in summary:
        logger.info("instruction profile: %s", summary["profile"])
    else:
        logger.info("%s", format_summary(summary))
    # Only rank 0 (or the launcher of the workers) gets here: the other ranks returned above.
    logger.info("run directory: %s", os.path.abspath(settings.output_dir))
    return summary


def warn_about_idle_stages(settings: RunSettings) -> None:
    """Fewer microbatches than pipeline stages leave most stages idle most of the step."""
    stages, microbatches = settings.grid.pp, settings.num_microbatches
    if microbatches < stages:
        logger.warning("pp=%d stages but %d microbatches per step: each stage idles for most of the step; "
                       "set trainer.gradient_accumulation_steps (or global_batch_size) to at least %d",
                       stages, microbatches, stages)


def _forks_workers(settings: RunSettings, outside_world: int | None) -> bool:
    method = settings.launcher.start_method
    return outside_world is None and settings.grid.world_size > 1 and \
        (method == "fork" or method == "auto" and default_start_method() == "fork")


def plan_before_launch(spec, settings: RunSettings, prepared: str, *, tp_rank: int = 0, only_plans: bool = False):
    """Capture, shard and partition in this process (as the workers of ``tp_rank`` will), so impossible
    splits fail before any worker starts (a giant model stays on the meta device). ``only_plans``: no
    worker follows (a dry run), so the model is built on the meta device whatever its size. Returns the
    assembled model and plan."""
    if only_plans and settings.trainer.sharding.init_device == "auto":
        settings = replace(settings, trainer=replace(
            settings.trainer, sharding=replace(settings.trainer.sharding, init_device="meta")))
    try:
        with tensor_parallel_state_kept():
            return assemble_worker(spec, settings, prepared, stage_id=0, device=torch.device("cpu"),
                                   tp_rank=tp_rank, planning=True)
    except (TraceError, ShardingError, PartitionError, TPPlanError) as error:
        raise ConfigError(f"invalid configuration:\n  - {error}") from error


def dry_run(spec, settings: RunSettings, prepared: str, *, priced: dict | None = None) -> dict:
    """Build, capture, shard and partition in this process; report and write partition.json; no training.
    ``priced``: the planner's pricing of this layout on its cluster (``parallel=auto``), shown instead of
    this machine's."""
    started = time.perf_counter()
    # The table below says what was built, captured and cut: their own lines would repeat it.
    with only_errors("merak.session", "merak.trace", "merak.tensor_parallel", "merak.shard"):
        built = plan_before_launch(spec, settings, prepared, only_plans=True)
    if built.plan is None:
        raise ConfigError("dry_run needs a captured graph: set trainer.trace_method to fx or dynamo")
    report = {"recipe": spec.name, "model": settings.model_cfg.get("name", "?"),
              "layout": {"dp": settings.grid.dp, "tp": settings.grid.tp, "pp": settings.grid.pp},
              "built_on_meta": built.on_meta, **built.plan.to_json(),
              "seconds": round(time.perf_counter() - started, 3), "peak_rss_bytes": peak_rss_bytes()}
    if priced is not None:
        report["priced_on_cluster"] = priced
    if built.tp_plan is not None:
        report["tensor_parallel"] = {"tp": built.tp_plan.tp, "changes": [str(c) for c in built.tp_plan.changes]}
        # One line per changed module (hundreds for a large model): a file, not the console.
        plan_path = os.path.join(settings.output_dir, "tp_plan.txt")
        with open(plan_path, "w", encoding="utf-8") as handle:
            handle.write(f"tensor-parallel plan (tp={built.tp_plan.tp}), what changes:\n{built.tp_plan.describe()}\n")
        logger.info("tensor-parallel plan (tp=%d): %d changes, listed in %s", built.tp_plan.tp,
                    len(built.tp_plan.changes), plan_path)
    path = os.path.join(settings.output_dir, "partition.json")
    write_json_atomic(path, report)
    logger.info("\n%s\nwrote %s", format_partition(report), path)
    return report


def _checkpoint_to_resume(settings: RunSettings) -> str | None:
    """The checkpoint this run starts from, checked before any worker starts."""
    checkpoint = settings.trainer.checkpoint
    try:
        path = find_checkpoint(checkpoint.resume_from_checkpoint, settings.output_dir)
        manifest = read_manifest(path) if path is not None else None
    except CheckpointError as error:
        raise ConfigError(f"invalid configuration:\n  - trainer.resume_from_checkpoint: {error}") from None
    if manifest is not None and not checkpoint.finetune:
        _warn_if_batch_changed(path, manifest, settings.global_batch_size)
    if path is None and checkpoint.resume_from_checkpoint not in (None, False, ""):
        if checkpoint.finetune:
            raise ConfigError("invalid configuration:\n  - trainer.finetune=true but no checkpoint was found "
                              f"in {settings.output_dir}")
        logger.warning("resume_from_checkpoint=%s: no checkpoint in %s yet; starting from the beginning",
                       checkpoint.resume_from_checkpoint, settings.output_dir)
    if checkpoint.pretrained_weights and not os.path.isdir(checkpoint.pretrained_weights):
        raise ConfigError(f"invalid configuration:\n  - trainer.pretrained_weights={checkpoint.pretrained_weights}: "
                          "no such directory")
    if path is not None:
        logger.info("resuming from %s", path)
    return path


def _check_checkpoints_fit(spec, settings: RunSettings, resume: str | None) -> None:
    """Refuse, before any worker starts, to resume another model or to save over its checkpoints
    (the model is built on the meta device to compare: names and shapes, no memory)."""
    def on_meta():
        with parameters_on_meta():
            return spec.build_model(settings.model_cfg)

    problems = checkpoints_that_conflict(on_meta, resume=resume, output_dir=settings.output_dir,
                                         options=settings.trainer.checkpoint)
    if problems:
        raise ConfigError("invalid configuration:\n" + "\n".join(f"  - {problem}" for problem in problems))


def _warn_if_batch_changed(path: str, manifest: dict, global_batch_size: int) -> None:
    """Resuming with another global batch is allowed, but the run then differs from one that kept it."""
    saved = (manifest.get("run") or {}).get("global_batch_size")
    if saved is not None and saved != global_batch_size:
        logger.warning("%s was trained with a global batch of %d samples, this run uses %d: the data order and the "
                       "learning-rate schedule continue by step, so the run does not continue as it would have "
                       "(set trainer.global_batch_size=%d to keep it)", path, saved, global_batch_size, saved)


def _agree_on_output_dir(settings: RunSettings, resume: str | None) -> tuple[RunSettings, str | None]:
    """Rank 0's run directory (and checkpoint to resume) for every rank. Under torchrun or srun each
    rank composed its own Hydra config: the default, timestamped run directory differs between ranks
    started in different seconds, which would split checkpoints across directories."""
    everyone = groups.gather_from_all((settings.output_dir, resume))
    if len({directory for directory, _ in everyone}) > 1:
        logger.warning("the ranks' run directories differ (%s): all use rank 0's; pass hydra.run.dir (the same "
                       "on every rank) to torchrun/srun runs", ", ".join(sorted({d for d, _ in everyone})))
    return replace(settings, output_dir=everyone[0][0]), everyone[0][1]


def train_worker(spec, settings: RunSettings, prepared: str, steps: int, resume: str | None = None, *,
                 in_launcher: bool = False) -> dict | None:
    """The body of one worker: join the grid, build the stage, train, report. ``in_launcher``: the one
    worker of a single-process run, in the launching process, which keeps its logging (format and the
    run's log file).

    Returns the run summary on rank 0, None on the other ranks.
    """
    torch.set_num_threads(settings.launcher.threads_per_rank)
    if settings.launcher.keep_freed_memory:
        keep_freed_memory()
    grid = settings.grid
    state = groups.init(grid.dp, grid.tp, grid.pp, backend=settings.launcher.backend,
                        timeout_s=settings.launcher.timeout_s)
    if not in_launcher or settings.launcher.quiet_workers:
        configure_worker_logging(state.rank, quiet=settings.launcher.quiet_workers)
    energy = None
    finished = False
    try:
        settings, resume = _agree_on_output_dir(settings, resume)
        energy = start_energy(settings.trainer.energy, state)
        session = TrainingSession(spec, settings, prepared, steps=steps, state=state, resume=resume,
                                  hooks=energy.hooks)
        if settings.trainer.energy.profile:
            result = run_profile(session, energy)
        else:
            energy.attach(session)  # each logged step's energy, and the run's (or why it is not measured)
            result = session.train()
        finished = True
        return result
    finally:
        if energy is not None:
            energy.close()
        groups.shutdown(synchronize=finished)
