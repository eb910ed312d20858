"""merak.run(spec, cfg): validate, launch workers, train, and summarize.

The Hydra process validates the config and prepares the data once, then
either joins the processes an outside launcher started (torchrun, srun) or
starts ``dp*tp*pp`` workers itself. Each worker builds the model, keeps its
own stage and trains it; rank 0 writes ``metrics.jsonl`` and ``summary.json``
in the run directory.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time

import torch

from merak.assemble import assemble
from merak.checkpoint import (
    CheckpointError,
    find_checkpoint,
    load_checkpoint,
    load_pretrained,
    save_checkpoint,
)
from merak.checkpoint.files import read_manifest
from merak.checkpoint.load import LoadOptions
from merak.checkpoint.save import SaveOptions
from merak.compat.allocator import keep_freed_memory
from merak.config import (
    ConfigError,
    RunSettings,
    pipeline_chunks,
    precision_options,
    resolve_settings,
    total_steps,
    warmup_steps,
    zero_options,
)
from merak.data.batching import BatchPlan, MicrobatchLoader, stack_samples
from merak.distributed import groups
from merak.distributed.launch import existing_world_size, spawn_workers
from merak.engine import OptimizerOptions, PipelineEngine, RecomputeOptions
from merak.pipeline.wall_clock import write_timelines
from merak.report import (
    MetricsWriter,
    format_partition,
    format_summary,
    peak_rss_bytes,
    write_json_atomic,
)
from merak.shard.partition import PartitionError
from merak.shard.plan import ShardingOptions
from merak.shard.split import ShardingError
from merak.tensor_parallel.options import TensorParallelOptions
from merak.tensor_parallel.plan import TPPlanError
from merak.trace.capture import TraceError

logger = logging.getLogger(__name__)

__all__ = ["ConfigError", "run"]


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
    resume = _checkpoint_to_resume(settings)
    if cfg.get("dry_run"):
        return dry_run(spec, settings, prepared)
    if (settings.trainer.trace_method is not None and settings.grid.pp > 1) or settings.grid.tp > 1 \
            or pipeline_chunks(settings.trainer) > 1:
        plan_before_launch(spec, settings, prepared)  # only to fail early; workers plan again, identically
    grid = settings.grid
    logger.info("training %s/%s with dp=%d tp=%d pp=%d (%d processes), %d steps, schedule %s",
                spec.name, settings.model_cfg.get("name", "?"), grid.dp, grid.tp, grid.pp, grid.world_size,
                steps, settings.trainer.train_schedule)
    args = (spec, settings, prepared, steps, resume)
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


def sharding_options(spec, settings: RunSettings) -> ShardingOptions:
    """Capture/shard/partition options: the trainer settings over the recipe's defaults."""
    trainer = settings.trainer
    return ShardingOptions(
        trace_method=trainer.trace_method, split_method=trainer.split_method, shard_count=trainer.shard_count,
        split_points=tuple(trainer.custom_split_points or spec.split_points),
        partition_method=trainer.partition_method,
        custom_partition=tuple(trainer.custom_partition) if trainer.custom_partition else None,
        leaf_modules=tuple(spec.leaf_modules) + tuple(trainer.leaf_modules or ()),
        input_names=tuple(trainer.input_names or spec.input_names or ()) or None,
        autopipe_costs=trainer.autopipe_costs)


def example_inputs(spec, settings: RunSettings, prepared: str) -> dict[str, torch.Tensor]:
    """One microbatch-shaped input: from the recipe's config shapes, else the first samples of the data."""
    size = settings.trainer.per_device_train_batch_size
    if spec.example_inputs is not None:
        return dict(spec.example_inputs(settings.model_cfg, size))
    dataset = spec.load_dataset(prepared, settings.model_cfg)
    return stack_samples([dataset[i] for i in range(min(size, len(dataset)))])


def tensor_parallel_options(spec, settings: RunSettings, tp_rank: int) -> TensorParallelOptions:
    """The tensor-parallel settings of the worker at ``tp_rank``."""
    trainer = settings.trainer
    return TensorParallelOptions(
        plan=spec.tensor_parallel_plan(settings.model_cfg), size=settings.grid.tp, rank=tp_rank, parallel_vocab=trainer.parallel_vocab,
        sequence_parallel=trainer.sequence_parallel, sequence_dim=trainer.sequence_dim,
        overlap_level=trainer.tp_overlapping_level)


def recompute_options(settings: RunSettings) -> RecomputeOptions:
    """The activation-checkpointing settings (same field names as the trainer settings)."""
    trainer = settings.trainer
    ratio = trainer.activation_checkpoint_ratio
    return RecomputeOptions(activation_checkpointing=trainer.activation_checkpointing,
                            checkpoint_num_layers=trainer.checkpoint_num_layers,
                            activation_checkpoint_ratio=tuple(ratio) if isinstance(ratio, list) else ratio)


def _assemble(spec, settings: RunSettings, prepared: str, *, stage_id: int, device, tp_rank: int = 0,
              planning: bool = False):
    """This worker's model and stages; ``planning``: nothing materialized on meta (the model is built
    as the workers build it, so the plan is theirs: export graphs can differ between meta and real).
    With interleaved schedules the model is cut into pp x chunks pieces and the worker keeps
    pieces ``stage_id, stage_id + pp, ...``."""
    chunks, pp = pipeline_chunks(settings.trainer), settings.grid.pp
    return assemble(
        build=functools.partial(spec.build_model, settings.model_cfg), seed=settings.trainer.seed,
        init_device=settings.trainer.init_device, options=sharding_options(spec, settings),
        num_stages=pp * chunks, num_microbatches=settings.num_microbatches,
        stage_id=tuple(stage_id + c * pp for c in range(chunks)),
        device=device, example_inputs=example_inputs(spec, settings, prepared), build_stages=spec.build_stages,
        materialize_stage=not planning, tensor_parallel=tensor_parallel_options(spec, settings, tp_rank),
        dtype=precision_options(settings.trainer).dtype)


def plan_before_launch(spec, settings: RunSettings, prepared: str):
    """Capture, shard and partition in this process, so impossible splits fail before any worker
    starts (a giant model stays on the meta device). Returns the assembled model and plan."""
    try:
        return _assemble(spec, settings, prepared, stage_id=0, device=torch.device("cpu"), planning=True)
    except (TraceError, ShardingError, PartitionError, TPPlanError) as error:
        raise ConfigError(f"invalid configuration:\n  - {error}") from error


def dry_run(spec, settings: RunSettings, prepared: str) -> dict:
    """Build, capture, shard and partition in this process; report and write partition.json; no training."""
    started = time.perf_counter()
    built = plan_before_launch(spec, settings, prepared)
    if built.plan is None:
        raise ConfigError("dry_run needs a captured graph: set trainer.trace_method to fx or dynamo")
    report = {"recipe": spec.name, "model": settings.model_cfg.get("name", "?"),
              "layout": {"dp": settings.grid.dp, "tp": settings.grid.tp, "pp": settings.grid.pp},
              "built_on_meta": built.on_meta, **built.plan.to_json(),
              "seconds": round(time.perf_counter() - started, 3), "peak_rss_bytes": peak_rss_bytes()}
    if built.tp_plan is not None:
        report["tensor_parallel"] = {"tp": built.tp_plan.tp, "changes": [str(c) for c in built.tp_plan.changes]}
        logger.info("tensor-parallel plan (tp=%d), what changes:\n%s", built.tp_plan.tp, built.tp_plan.describe())
    path = os.path.join(settings.output_dir, "partition.json")
    write_json_atomic(path, report)
    logger.info("\n%s\nwrote %s", format_partition(report), path)
    return report


def _checkpoint_to_resume(settings: RunSettings) -> str | None:
    """The checkpoint this run starts from, checked before any worker starts."""
    trainer = settings.trainer
    try:
        path = find_checkpoint(trainer.resume_from_checkpoint, settings.output_dir)
        if path is not None:
            read_manifest(path)
    except CheckpointError as error:
        raise ConfigError(f"invalid configuration:\n  - trainer.resume_from_checkpoint: {error}") from None
    if path is None and trainer.resume_from_checkpoint not in (None, False, ""):
        if trainer.finetune:
            raise ConfigError("invalid configuration:\n  - trainer.finetune=true but no checkpoint was found "
                              f"in {settings.output_dir}")
        logger.warning("resume_from_checkpoint=%s: no checkpoint in %s yet; starting from the beginning",
                       trainer.resume_from_checkpoint, settings.output_dir)
    if trainer.pretrained_weights and not os.path.isdir(trainer.pretrained_weights):
        raise ConfigError(f"invalid configuration:\n  - trainer.pretrained_weights={trainer.pretrained_weights}: "
                          "no such directory")
    if path is not None:
        logger.info("resuming from %s", path)
    return path


def _run_info(spec, settings: RunSettings) -> dict:
    from omegaconf import OmegaConf

    return {"recipe": spec.name, "model": OmegaConf.to_container(settings.model_cfg, resolve=True),
            "seed": settings.trainer.seed, "global_batch_size": settings.global_batch_size}


def _start(engine: PipelineEngine, settings: RunSettings, resume: str | None) -> int:
    """Load the checkpoint or pretrained weights this run starts from; return the first step."""
    trainer = settings.trainer
    if resume is not None:
        state = load_checkpoint(engine, resume, options=LoadOptions(
            finetune=trainer.finetune, no_load_rng=trainer.no_load_rng, no_load_optim=trainer.no_load_optim))
        return int(state["step"])
    if trainer.pretrained_weights:
        count = load_pretrained(engine, trainer.pretrained_weights)
        logger.info("loaded %d tensors from %s", count, trainer.pretrained_weights)
    return 0


def _saves_after(settings: RunSettings, step: int, steps: int) -> bool:
    trainer = settings.trainer
    return trainer.save and (step % trainer.save_steps == 0 or step == steps)


def train_worker(spec, settings: RunSettings, prepared: str, steps: int, resume: str | None = None) -> dict | None:
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
        built = _assemble(spec, settings, prepared, stage_id=state.coordinates.pp, device=state.device,
                          tp_rank=state.coordinates.tp)
        engine = PipelineEngine(
            model=built.model, stages=built.stages, loss_fn=spec.loss_fn, state=state,
            schedule=trainer.train_schedule, num_microbatches=settings.num_microbatches, total_steps=steps,
            optimizer=_optimizer_options(settings, steps), recompute=recompute_options(settings),
            num_chunks=pipeline_chunks(trainer), dropout_seed=trainer.seed,
            dealloc_pipeoutput=trainer.dealloc_pipeoutput, record_timeline=trainer.wall_clock_breakdown,
            zero=zero_options(trainer), precision=precision_options(trainer))
        del built  # the engine keeps this rank's stage only
        # Dropout masks differ between replicas and stages, but not within a tensor-parallel group,
        # whose ranks hold the same replicated activations.
        torch.manual_seed(trainer.seed + grid.rank_of(pp=state.coordinates.pp, dp=state.coordinates.dp, tp=0))
        first_step = _start(engine, settings, resume)  # after seeding: a checkpoint's RNG states win
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
                                enabled=rank == 0, logging_steps=trainer.logging_steps, start_step=first_step)
        save_options = SaveOptions(save_total_limit=trainer.save_total_limit, no_save_rng=trainer.no_save_rng,
                                   no_save_optim=trainer.no_save_optim)
        saved = []
        for step in range(first_step, steps):
            step_start = time.perf_counter()
            microbatches = loader.load_step(step) if loader else None
            result = engine.train_step(microbatches)
            metrics.log_step(step=step + 1, loss=result.loss, lr=result.learning_rate,
                             grad_norm=result.grad_norm, step_time_s=time.perf_counter() - step_start,
                             skipped=result.skipped, loss_scale=result.loss_scale)
            if _saves_after(settings, step + 1, steps):
                saved.append(save_checkpoint(
                    engine, settings.output_dir, step=step + 1, run_info=_run_info(spec, settings),
                    trainer_state={"consumed_samples": (step + 1) * settings.global_batch_size},
                    options=save_options))
        metrics.close()
        timeline = write_timelines(engine, schedule=trainer.train_schedule, output_dir=settings.output_dir,
                                   rank=rank) if trainer.wall_clock_breakdown else None
        checkpoints = {"resumed_from": resume, "saved": saved}
        return _write_summary(spec, settings, engine, metrics, steps, time.perf_counter() - started, rank, timeline,
                              checkpoints)
    finally:
        groups.shutdown()


def _write_summary(spec, settings: RunSettings, engine: PipelineEngine, metrics: MetricsWriter, steps: int,
                   wall_time_s: float, rank: int, timeline: dict | None = None,
                   checkpoints: dict | None = None) -> dict | None:
    """Gather every rank's memory figures; rank 0 writes summary.json (per stage: the most any of its
    ranks holds; per rank: everything) and returns the summary."""
    local = {"stage": engine.stage_id, "rank": rank,
             "num_parameters": sum(p.numel() for _, p in engine.named_parameters()),
             "peak_rss_bytes": peak_rss_bytes(), **engine.memory_report()}
    everyone = groups.gather_from_all(local)
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
        "first_loss": metrics.records[0].loss if metrics.records else None,
        "final_loss": metrics.records[-1].loss if metrics.records else None,
        **(metrics.throughput() if metrics.records else {}), "wall_time_s": wall_time_s, "stages": stages,
        "recompute": {"activation_checkpointing": settings.trainer.activation_checkpointing,
                      "activation_checkpoint_ratio": settings.trainer.activation_checkpoint_ratio,
                      "pipeline_chunks": engine.num_chunks},
        "ranks": sorted(everyone, key=lambda r: r["rank"]),
        "checkpoints": checkpoints,
        "precision": {"dtype": str(engine.optimizer.precision.dtype).removeprefix("torch."),
                      "zero_stage": engine.optimizer.zero.stage, "loss_scale": engine.optimizer.loss_scale,
                      "skipped_steps": sum(r.skipped for r in metrics.records)},
    }
    if timeline is not None:
        summary["timeline"] = timeline
    write_json_atomic(os.path.join(settings.output_dir, "summary.json"), summary)
    return summary
