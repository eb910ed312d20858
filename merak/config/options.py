"""The options the engine, the planner and the optimizer take, built from the validated run settings:
one place where config sections become runtime options (each section keeps its own defaults and
checks; merak.config composes them)."""

from __future__ import annotations

import dataclasses

from merak.config import RunSettings, TrainerSettings
from merak.engine import OptimizerOptions, RecomputeOptions
from merak.optim.distributed import ZeroOptions
from merak.optim.precision import PrecisionOptions
from merak.pipeline.compiled import CompileOptions
from merak.shard.plan import ShardingOptions
from merak.tensor_parallel.options import TensorParallelOptions


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


def tensor_parallel_options(spec, settings: RunSettings, tp_rank: int) -> TensorParallelOptions:
    """The tensor-parallel options of one tp rank."""
    return settings.trainer.tensor_parallel.options(plan=spec.tensor_parallel_plan(settings.model_cfg),
                                                    size=settings.grid.tp, rank=tp_rank)


def recompute_options(settings: RunSettings) -> RecomputeOptions:
    """The activation-checkpointing settings (same field names as the trainer settings)."""
    trainer = settings.trainer
    ratio = trainer.activation_checkpoint_ratio
    return RecomputeOptions(activation_checkpointing=trainer.activation_checkpointing,
                            checkpoint_num_layers=trainer.checkpoint_num_layers,
                            activation_checkpoint_ratio=tuple(ratio) if isinstance(ratio, list) else ratio)


def optimizer_options(settings: RunSettings, steps: int) -> OptimizerOptions:
    """OptimizerOptions from the trainer settings (same field names), warm-up resolved."""
    optimizer = settings.trainer.optimizer
    names = {field.name for field in dataclasses.fields(OptimizerOptions)}
    values = {name: getattr(optimizer, name) for name in names}
    return OptimizerOptions(**{**values, "warmup_steps": optimizer.warmup_steps_for(steps)})


def pipeline_chunks(trainer: TrainerSettings) -> int:
    """Model chunks per pipeline rank: the setting, else 2 for interleaved schedules and 1 otherwise."""
    return trainer.schedule.chunks


def compile_options(trainer: TrainerSettings) -> CompileOptions:
    """The compiled-stage settings (see merak.pipeline.settings.CompileSettings.options)."""
    return trainer.compile.options()


def zero_options(trainer: TrainerSettings) -> ZeroOptions:
    """The optimizer's ZeRO options (stage 0 when zero_optimization is off)."""
    zero = trainer.zero
    return ZeroOptions(stage=zero.zero_stage if zero.zero_optimization else 0,
                       reduce_bucket_size=int(zero.zero_reduce_bucket_size),
                       allgather_bucket_size=int(zero.zero_allgather_bucket_size),
                       prescale_gradients=zero.prescale_gradients,
                       gradient_predivide_factor=zero.gradient_predivide_factor)


def precision_options(trainer: TrainerSettings) -> PrecisionOptions:
    """The optimizer's mixed-precision options (the precision section's fields)."""
    return PrecisionOptions(**dataclasses.asdict(trainer.precision))
