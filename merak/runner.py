"""merak.run(spec, cfg): validate, launch workers, train, and summarize.

The Hydra process validates the config and prepares the data once, then
either joins the processes an outside launcher started (torchrun, srun) or
starts ``dp*tp*pp`` workers itself. Each worker builds the model, keeps its
own stage and trains it; rank 0 writes ``metrics.jsonl`` and ``summary.json``
in the run directory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import torch
import torch.distributed as dist

from merak.compat.allocator import keep_freed_memory
from merak.config import ConfigError, RunSettings, resolve_settings, total_steps, warmup_steps
from merak.data.batching import BatchPlan, MicrobatchLoader
from merak.distributed import groups
from merak.distributed.launch import existing_world_size, spawn_workers
from merak.engine import OptimizerOptions, PipelineEngine
from merak.report import MetricsWriter, format_summary, peak_rss_bytes, write_json_atomic

logger = logging.getLogger(__name__)

__all__ = ["run", "ConfigError"]


def _configure_worker_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING, force=True,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def _steps_per_epoch(settings: RunSettings, num_samples: int) -> int:
    plan = BatchPlan(num_samples=num_samples, micro_batch_size=settings.trainer.per_device_train_batch_size,
                     num_microbatches=settings.num_microbatches, dp_size=settings.grid.dp)
    return plan.steps_per_epoch


def _optimizer_options(settings: RunSettings, steps: int) -> OptimizerOptions:
    """OptimizerOptions from the trainer settings (same field names), warm-up resolved."""
    names = {field.name for field in dataclasses.fields(OptimizerOptions)}
    values = {name: getattr(settings.trainer, name) for name in names}
    return OptimizerOptions(**{**values, "warmup_steps": warmup_steps(settings, steps)})


def run(spec, cfg) -> dict:
    """Train ``spec`` with the composed Hydra config ``cfg`` and return the run summary.

    Raises:
        ConfigError: before any worker starts, when the config cannot work.
        merak.distributed.launch.WorkerFailed: when a worker fails (others are stopped).
    """
    outside_world = existing_world_size()
    settings = resolve_settings(spec, cfg, world_size=outside_world)
    prepared = spec.prepare_data(settings.data_cfg, settings.model_cfg)
    num_samples = len(spec.load_dataset(prepared, settings.model_cfg))
    try:
        steps = total_steps(settings, _steps_per_epoch(settings, num_samples))
    except ValueError as error:
        raise ConfigError(f"invalid configuration:\n  - {error}") from None
    os.makedirs(settings.output_dir, exist_ok=True)
    grid = settings.grid
    logger.info("training %s/%s with dp=%d tp=%d pp=%d (%d processes), %d steps, schedule %s",
                spec.name, settings.model_cfg.get("name", "?"), grid.dp, grid.tp, grid.pp, grid.world_size,
                steps, settings.trainer.train_schedule)
    args = (spec, settings, prepared, steps)
    if outside_world is not None or grid.world_size == 1:
        summary = train_worker(*args)  # this process is a worker; only rank 0 gets the summary
        if summary is None:
            return {}
    else:
        spawn_workers(train_worker, world_size=grid.world_size, args=args,
                      start_method=settings.launcher.start_method,
                      env={"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS":
                           str(settings.launcher.threads_per_rank)})
        with open(os.path.join(settings.output_dir, "summary.json"), encoding="utf-8") as handle:
            summary = json.load(handle)
    logger.info("\n%s", format_summary(summary))
    return summary


def train_worker(spec, settings: RunSettings, prepared: str, steps: int) -> dict | None:
    """The body of one worker: join the grid, build the stage, train, report.

    Returns the run summary on rank 0, None on the other ranks.
    """
    torch.set_num_threads(settings.launcher.threads_per_rank)
    if settings.launcher.keep_freed_memory:
        keep_freed_memory()
    trainer = settings.trainer
    grid = settings.grid
    state = groups.init(grid.dp, grid.tp, grid.pp, backend=settings.launcher.backend,
                        timeout_s=settings.launcher.timeout_s)
    rank = state.rank
    _configure_worker_logging(rank)
    try:
        started = time.perf_counter()
        torch.manual_seed(trainer.seed)  # every rank builds the same model
        model = spec.build_model(settings.model_cfg)
        stages = spec.build_stages(model, grid.pp)
        engine = PipelineEngine(
            model=model, stages=stages, loss_fn=spec.loss_fn, state=state, schedule=trainer.train_schedule,
            num_microbatches=settings.num_microbatches, total_steps=steps,
            optimizer=_optimizer_options(settings, steps))
        del model, stages  # the engine keeps this rank's stage only
        torch.manual_seed(trainer.seed + rank)  # dropout masks differ between ranks
        loader = None
        if state.is_first_stage or state.is_last_stage:  # only they consume data
            dataset = spec.load_dataset(prepared, settings.model_cfg)
            plan = BatchPlan(num_samples=len(dataset), micro_batch_size=trainer.per_device_train_batch_size,
                             num_microbatches=settings.num_microbatches, dp_size=grid.dp,
                             dp_rank=state.coordinates.dp, seed=trainer.seed)
            loader = MicrobatchLoader(dataset, plan, device=state.device)
        metrics = MetricsWriter(output_dir=settings.output_dir, total_steps=steps,
                                samples_per_step=settings.global_batch_size,
                                tokens_per_sample=spec.tokens_per_sample(settings.model_cfg),
                                enabled=rank == 0, logging_steps=trainer.logging_steps)
        for step in range(steps):
            step_start = time.perf_counter()
            microbatches = loader.load_step(step) if loader else None
            result = engine.train_step(microbatches)
            metrics.log_step(step=step + 1, loss=result.loss, lr=result.learning_rate,
                             grad_norm=result.grad_norm, step_time_s=time.perf_counter() - step_start)
        metrics.close()
        return _write_summary(spec, settings, engine, metrics, steps, time.perf_counter() - started, rank)
    finally:
        groups.shutdown()


def _write_summary(spec, settings: RunSettings, engine: PipelineEngine, metrics: MetricsWriter, steps: int,
                   wall_time_s: float, rank: int) -> dict | None:
    """Gather every rank's memory figures; rank 0 writes summary.json and returns the summary."""
    local = {"stage": engine.stage_id, "rank": rank,
             "num_parameters": sum(p.numel() for _, p in engine.named_parameters()),
             "peak_rss_bytes": peak_rss_bytes(), **engine.memory_report()}
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, local)
    else:
        everyone = [local]
    if rank != 0:
        return None
    stages = []
    for stage_id in range(settings.grid.pp):
        rows = [r for r in everyone if r["stage"] == stage_id]
        merged = {key: max(r[key] for r in rows) for key in rows[0] if key not in ("stage", "rank")}
        stages.append({"stage": stage_id, "ranks": sorted(r["rank"] for r in rows), **merged})
    grid = settings.grid
    summary = {
        "recipe": spec.name, "model": settings.model_cfg.get("name", "?"),
        "layout": {"dp": grid.dp, "tp": grid.tp, "pp": grid.pp},
        "schedule": settings.trainer.train_schedule, "steps": steps,
        "global_batch_size": settings.global_batch_size, "num_microbatches": settings.num_microbatches,
        "first_loss": metrics.records[0].loss, "final_loss": metrics.records[-1].loss,
        **metrics.throughput(), "wall_time_s": wall_time_s, "stages": stages,
    }
    write_json_atomic(os.path.join(settings.output_dir, "summary.json"), summary)
    return summary
