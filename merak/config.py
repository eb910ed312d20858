"""Run settings: the Hydra config checked and turned into typed values, before any worker starts.

Only this module and merak.runner read the config; the engine layers get plain
keyword arguments. The ``trainer`` section uses MerakArguments' field names.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from merak.config_fields import typed_section
from merak.distributed.topology import RankGrid
from merak.optim.schedule import LR_SCHEDULES
from merak.pipeline.schedules import schedule_names
from merak.trackers import tracker_problems


class ConfigError(ValueError):
    """The run config cannot work; the message names each field and what to change."""


@dataclass(frozen=True)
class TrainerSettings:
    """The ``trainer`` config group (MerakArguments / TrainingArguments names)."""

    output_dir: str | None = None
    seed: int = 42
    max_steps: int = -1
    num_train_epochs: float = 1.0
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    global_batch_size: int | None = None
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    lr_scheduler_type: str = "linear"
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    logging_steps: int = 1
    disable_tqdm: bool = False
    peak_tflops: float | None = None
    train_schedule: str = "1f1b"
    # Automatic pipeline splitting (merak.shard.plan.ShardingOptions).
    trace_method: str | None = "fx"
    split_method: str = "min_bytes"
    shard_count: int | None = None
    custom_split_points: list[str] | None = None
    partition_method: str = "autopipe"
    custom_partition: list[int] | None = None
    input_names: list[str] | None = None
    leaf_modules: list[str] | None = None
    init_device: str = "auto"
    autopipe_costs: str = "estimate"
    # Tensor parallelism (merak.tensor_parallel.options.TensorParallelOptions).
    parallel_vocab: bool = False
    sequence_parallel: bool = False
    sequence_dim: int = 1
    tp_overlapping_level: int = 0
    # Recomputation and schedule details (merak.engine.RecomputeOptions, merak.pipeline).
    activation_checkpointing: bool = True
    checkpoint_num_layers: int = 1
    activation_checkpoint_ratio: float | list[float] | None = None
    pipeline_chunks: int | None = None
    dealloc_pipeoutput: bool = False
    wall_clock_breakdown: bool = False
    measure_activation_memory: bool = False
    # Compiled stages (merak.pipeline.compiled); the first three are Hugging Face's names.
    torch_compile: bool = False
    torch_compile_backend: str | None = None
    torch_compile_mode: str | None = None
    cuda_graphs: bool = False
    # Data loading (merak.data.batching.MicrobatchLoader).
    dataloader_num_workers: int | None = None
    dataloader_pin_memory: bool = True
    # Optimizer, ZeRO and mixed precision (merak.optim.distributed, merak.optim.precision).
    optim: str = "adamw_torch"
    zero_optimization: bool = False
    zero_stage: int = 1
    zero_reduce_bucket_size: int | float = 500_000_000  # elements; DeepSpeed configs write 5e8
    zero_allgather_bucket_size: int | float = 500_000_000
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    zero_allow_untested_optimizer: bool = False
    fp16: bool = False
    bf16: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 32
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    # A step whose loss or gradient norm is not finite is skipped on every rank; after this many skipped
    # steps in a row the run stops with an error (fp16 overflows that a smaller loss scale may still cure
    # do not count). Must be >= 1.
    max_consecutive_skipped_steps: int = 3
    # Evaluation on held-out samples and experiment trackers (recipes; MerakTrainer uses its eval_data and
    # transformers' own callbacks instead).
    eval_steps: int | None = None
    eval_iters: int | None = None
    eval_holdout: float = 0.05
    report_to: str | list[str] = "none"
    run_name: str | None = None
    # Checkpoints (merak.checkpoint).
    save: bool = False
    save_steps: int = 500
    save_total_limit: int | None = -1
    resume_from_checkpoint: str | bool | None = None
    finetune: bool = False
    no_save_rng: bool = False
    no_save_optim: bool = False
    no_load_rng: bool = False
    no_load_optim: bool = False
    pretrained_weights: str | None = None
    # Energy (merak.energy, docs/energy.md); the first four are Merak-Zeus's names.
    profile: bool = False
    num_warmup_steps: int = 2
    num_prof_steps: int = 4
    pfo_server_url: str | None = None
    energy_device: str = "auto"
    simulated_gpu: str = "A100"
    simulated_tflops: float = 0.004
    frequency_plan: str | None = None


@dataclass(frozen=True)
class LauncherSettings:
    """The ``launcher`` config group: how workers start and talk."""

    start_method: str = "auto"
    backend: str = "auto"
    threads_per_rank: int = 1
    timeout_s: float = 600.0
    keep_freed_memory: bool = True


@dataclass(frozen=True)
class RunSettings:
    """Everything a run needs, validated."""

    grid: RankGrid
    trainer: TrainerSettings
    launcher: LauncherSettings
    model_cfg: Any
    data_cfg: Any
    output_dir: str
    num_microbatches: int

    @property
    def global_batch_size(self) -> int:
        return self.trainer.per_device_train_batch_size * self.num_microbatches * self.grid.dp


def _section(cfg: DictConfig, name: str, cls, problems: list[str]):
    """Config group ``name`` as a ``cls``, each value type- and range-checked (merak.config_fields)."""
    values = OmegaConf.to_container(cfg.get(name) or {}, resolve=True)
    return typed_section(values, cls, name, problems)


def _positive_int(value, field: str, problems: list[str]) -> bool:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        problems.append(f"{field}={value!r} must be a positive integer")
        return False
    return True


def _default_output_dir() -> str:
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.output_dir
    except (ImportError, ValueError):
        return os.path.abspath("merak-output")


def resolve_settings(spec, cfg: DictConfig, *, world_size: int | None = None) -> RunSettings:
    """Check the whole config and return typed settings, or raise ConfigError listing every problem.

    Args:
        spec: the recipe's RecipeSpec (for model-specific layout and data checks).
        cfg: the composed Hydra config.
        world_size: number of processes an outside launcher started, if any.
    """
    problems: list[str] = []
    trainer = _section(cfg, "trainer", TrainerSettings, problems)
    launcher = _section(cfg, "launcher", LauncherSettings, problems)
    parallel = OmegaConf.to_container(cfg.get("parallel") or {}, resolve=True)
    degrees = {axis: parallel.get(axis, 1) for axis in ("dp", "tp", "pp")}
    layout_ok = all(_positive_int(v, f"parallel.{k}", problems) for k, v in degrees.items())
    grid = RankGrid(**degrees) if layout_ok else None
    if grid and world_size is not None and world_size != grid.world_size:
        problems.append(
            f"parallel.dp*tp*pp = {grid.dp}*{grid.tp}*{grid.pp} = {grid.world_size} but the launcher "
            f"started {world_size} processes; make them equal (e.g. torchrun --nproc_per_node)")
    if trainer.train_schedule not in schedule_names():
        problems.append(f"trainer.train_schedule={trainer.train_schedule!r} is unknown; choose one of "
                        f"{', '.join(schedule_names())}")
    if trainer.lr_scheduler_type not in LR_SCHEDULES:
        problems.append(f"trainer.lr_scheduler_type={trainer.lr_scheduler_type!r} is unknown; choose one of "
                        f"{', '.join(LR_SCHEDULES)}")
    micro_ok = _positive_int(trainer.per_device_train_batch_size, "trainer.per_device_train_batch_size", problems)
    _positive_int(trainer.gradient_accumulation_steps, "trainer.gradient_accumulation_steps", problems)
    if trainer.max_steps == 0 or (trainer.max_steps < 0 and trainer.num_train_epochs <= 0):
        problems.append("nothing to train: set trainer.max_steps > 0 or trainer.num_train_epochs > 0")
    if launcher.start_method not in ("auto", "fork", "spawn", "forkserver"):
        problems.append(f"launcher.start_method={launcher.start_method!r}; use auto, fork, spawn or forkserver")
    if launcher.backend not in ("auto", "gloo", "nccl"):
        problems.append(f"launcher.backend={launcher.backend!r}; use auto, gloo or nccl")
    _positive_int(launcher.threads_per_rank, "launcher.threads_per_rank", problems)
    workers = trainer.dataloader_num_workers
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 0):
        problems.append(f"trainer.dataloader_num_workers={workers!r} must be null (automatic) or an integer >= 0")
    num_microbatches = trainer.gradient_accumulation_steps
    batch_ok = trainer.global_batch_size is None or _positive_int(
        trainer.global_batch_size, "trainer.global_batch_size", problems)
    if grid and micro_ok and batch_ok and trainer.global_batch_size is not None:
        per_step = trainer.per_device_train_batch_size * grid.dp
        if trainer.global_batch_size % per_step:
            problems.append(
                f"trainer.global_batch_size={trainer.global_batch_size} is not divisible by "
                f"per_device_train_batch_size*dp = {trainer.per_device_train_batch_size}*{grid.dp}; "
                "change one of them")
        else:
            num_microbatches = trainer.global_batch_size // per_step
    problems.extend(_sharding_problems(spec, trainer, grid))
    problems.extend(_schedule_problems(trainer, grid, num_microbatches))
    problems.extend(_tensor_parallel_problems(spec.tensor_parallel_plan(cfg.model), trainer, grid))
    problems.extend(_optimizer_problems(trainer, grid))
    problems.extend(_checkpoint_problems(trainer))
    problems.extend(tracker_problems(trainer.report_to))
    problems.extend(_compile_problems(trainer, launcher))
    if grid and trainer.train_schedule in schedule_names():
        from merak.energy.settings import energy_problems

        problems.extend(energy_problems(trainer, grid, num_microbatches, pipeline_chunks(trainer)))
    # Model checks run even when the layout is invalid, so every problem is listed at once.
    problems.extend(spec.check_layout(cfg.model, *((grid.dp, grid.tp, grid.pp) if grid else (1, 1, 1))))
    problems.extend(spec.check_data(cfg.data))
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))
    return RunSettings(grid=grid, trainer=trainer, launcher=launcher, model_cfg=cfg.model, data_cfg=cfg.data,
                       output_dir=trainer.output_dir or _default_output_dir(), num_microbatches=num_microbatches)


def _sharding_problems(spec, trainer: TrainerSettings, grid: RankGrid | None) -> list[str]:
    """Checks of the pipeline-splitting settings that need no model."""
    from merak.assemble import INIT_DEVICES
    from merak.shard.partition import custom_boundary_problem
    from merak.shard.plan import AUTOPIPE_COSTS, PARTITION_METHODS
    from merak.shard.split import SPLIT_METHODS
    from merak.trace.capture import TRACE_METHODS

    problems = []
    if trainer.trace_method is None:
        if grid and grid.pp > 1 and spec.build_stages is None:
            problems.append(f"trainer.trace_method=null with parallel.pp={grid.pp}: without tracing the "
                            f"recipe must supply stages (RecipeSpec.build_stages); use trace_method=fx")
    elif trainer.trace_method not in TRACE_METHODS:
        problems.append(f"trainer.trace_method={trainer.trace_method!r}; choose fx, dynamo or null")
    if trainer.split_method not in SPLIT_METHODS:
        problems.append(f"trainer.split_method={trainer.split_method!r}; choose one of {', '.join(SPLIT_METHODS)}")
    elif trainer.split_method == "layer_split" and not (trainer.custom_split_points or spec.split_points):
        problems.append("trainer.split_method=layer_split needs trainer.custom_split_points (module names or "
                        "globs such as 'transformer.h.*'); this recipe has no default split points")
    if trainer.shard_count is not None:
        _positive_int(trainer.shard_count, "trainer.shard_count", problems)
    if trainer.partition_method not in PARTITION_METHODS:
        problems.append(f"trainer.partition_method={trainer.partition_method!r}; choose one of "
                        f"{', '.join(PARTITION_METHODS)}")
    elif trainer.partition_method == "custom":
        if not trainer.custom_partition:
            problems.append("trainer.partition_method=custom needs trainer.custom_partition: pp+1 shard "
                            "boundaries such as [0, 6, 12]")
        elif grid:
            problem = custom_boundary_problem(trainer.custom_partition, grid.pp)
            if problem:
                problems.append(f"trainer.{problem}")
    if trainer.autopipe_costs not in AUTOPIPE_COSTS:
        problems.append(f"trainer.autopipe_costs={trainer.autopipe_costs!r}; choose one of "
                        f"{', '.join(AUTOPIPE_COSTS)}")
    if trainer.init_device not in INIT_DEVICES:
        problems.append(f"trainer.init_device={trainer.init_device!r}; choose one of {', '.join(INIT_DEVICES)}")
    return problems


def pipeline_chunks(trainer: TrainerSettings) -> int:
    """Model chunks per pipeline rank: the setting, else 2 for interleaved schedules and 1 otherwise."""
    from merak.pipeline.schedules import DEFAULT_CHUNKS, schedule_info

    if trainer.pipeline_chunks is not None:
        return trainer.pipeline_chunks
    return DEFAULT_CHUNKS if schedule_info(trainer.train_schedule).chunked else 1


def _schedule_problems(trainer: TrainerSettings, grid: RankGrid | None, num_microbatches: int) -> list[str]:
    """Checks of the schedule and recomputation settings (the schedule is built and simulated)."""
    from merak.pipeline.recompute import stage_checkpoint_ratios
    from merak.pipeline.schedules import build_schedule, schedule_info
    from merak.pipeline.simulate import ScheduleError, simulate

    if trainer.train_schedule not in schedule_names():
        return []  # reported with the other basic checks
    problems = []
    info = schedule_info(trainer.train_schedule)
    name = f"trainer.train_schedule={trainer.train_schedule}"
    chunks = trainer.pipeline_chunks
    if chunks is not None and (not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1):
        return [f"trainer.pipeline_chunks={chunks!r} must be a positive integer"]
    if chunks is not None and chunks > 1 and not info.chunked:
        problems.append(f"trainer.pipeline_chunks={chunks} needs an interleaved schedule "
                        f"(train_schedule=interleaved_1f1b)")
    if info.needs_checkpoint_ratio and not (trainer.activation_checkpointing
                                            and trainer.activation_checkpoint_ratio is not None):
        problems.append(f"{name} moves recomputation off the critical path: it needs "
                        f"trainer.activation_checkpointing=true and trainer.activation_checkpoint_ratio (the "
                        f"first stage's ratio, e.g. 0.5)")
    if trainer.tp_overlapping_level == 2 and trainer.activation_checkpointing and grid and grid.tp > 1:
        problems.append("trainer.tp_overlapping_level=2 runs stage halves on two threads and cannot recompute "
                        "them: set trainer.activation_checkpointing=false")
    if grid is None or num_microbatches < 1:
        return problems
    pieces = grid.pp * pipeline_chunks(trainer)
    if trainer.activation_checkpoint_ratio is not None:
        try:
            stage_checkpoint_ratios(trainer.activation_checkpoint_ratio, pieces)
        except (TypeError, ValueError) as error:
            problems.append(f"trainer.{error}")
    try:
        lists = [build_schedule(name=trainer.train_schedule, stage_id=s, num_stages=grid.pp,
                                num_microbatches=num_microbatches, num_chunks=pipeline_chunks(trainer))
                 for s in range(grid.pp)]
        simulate(lists)
    except (ValueError, ScheduleError) as error:
        problems.append(f"{name} with pp={grid.pp} and {num_microbatches} microbatches "
                        f"(gradient_accumulation_steps): {error}")
    if pipeline_chunks(trainer) > 1 and trainer.trace_method is None:
        problems.append("interleaved schedules cut the model into pp x pipeline_chunks pieces: they need a "
                        "captured graph (trace_method=fx or dynamo)")
    return problems


def compile_options(trainer: TrainerSettings):
    """The compiled-stage settings. As in Hugging Face's TrainingArguments, naming a backend or a mode
    turns compilation on."""
    from merak.pipeline.compiled import CompileOptions

    enabled = bool(trainer.torch_compile or trainer.torch_compile_backend or trainer.torch_compile_mode)
    return CompileOptions(enabled=enabled, backend=trainer.torch_compile_backend or "inductor",
                          mode=trainer.torch_compile_mode, cuda_graphs=trainer.cuda_graphs)


def _compile_problems(trainer: TrainerSettings, launcher: LauncherSettings) -> list[str]:
    import torch

    try:
        options = compile_options(trainer)
    except ValueError as error:
        return [f"trainer.{error}"]
    problems = []
    if options.enabled:
        from torch._dynamo import list_backends

        if options.backend not in list_backends(exclude_tags=()):
            problems.append(f"trainer.torch_compile_backend={options.backend!r} is not a torch.compile backend; "
                            f"choose one of {', '.join(list_backends())}")
    if options.uses_cuda_graphs and (not torch.cuda.is_available() or launcher.backend == "gloo"):
        problems.append("trainer.cuda_graphs=true (or a torch_compile_mode with CUDA graphs) needs CUDA devices; "
                        "this run trains on the CPU")
    return problems


def _tensor_parallel_problems(plan, trainer: TrainerSettings, grid: RankGrid | None) -> list[str]:
    """Checks of the tensor-parallel settings that need no model (the plan is checked on the model
    before launch, see merak.runner.plan_before_launch)."""
    from merak.tensor_parallel.options import TensorParallelOptions, option_problems

    tp = grid.tp if grid else 1
    options = TensorParallelOptions(plan=plan, size=tp, overlap_level=trainer.tp_overlapping_level)
    problems = option_problems(options, prefix="trainer.")
    # sequence_dim's range is checked with its type (merak.config_fields), whatever tp is.
    if tp > 1 and trainer.trace_method is None and grid and grid.pp > 1:
        problems.append("tensor parallelism with pp > 1 needs a captured graph: use trace_method=fx or dynamo")
    return problems


def zero_options(trainer: TrainerSettings):
    """The ZeRO settings (stage 0 when zero_optimization is off)."""
    from merak.optim.distributed import ZeroOptions

    return ZeroOptions(stage=trainer.zero_stage if trainer.zero_optimization else 0,
                       reduce_bucket_size=int(trainer.zero_reduce_bucket_size),
                       allgather_bucket_size=int(trainer.zero_allgather_bucket_size),
                       prescale_gradients=trainer.prescale_gradients,
                       gradient_predivide_factor=trainer.gradient_predivide_factor)


def precision_options(trainer: TrainerSettings):
    """The mixed-precision settings (same field names)."""
    from merak.optim.precision import PrecisionOptions

    names = [f.name for f in dataclasses.fields(PrecisionOptions)]
    return PrecisionOptions(**{name: getattr(trainer, name) for name in names})


def _optimizer_problems(trainer: TrainerSettings, grid: RankGrid | None) -> list[str]:
    from merak.optim.distributed import ZERO_STAGES
    from merak.optim.precision import precision_problems
    from merak.optim.schedule import OPTIMIZERS, ZERO_TESTED_OPTIMIZERS

    problems = precision_problems(precision_options(trainer), prefix="trainer.")
    if trainer.optim not in OPTIMIZERS:
        problems.append(f"trainer.optim={trainer.optim!r}; choose one of {', '.join(OPTIMIZERS)}")
    if trainer.zero_optimization:  # zero_stage is unused (and unchecked) with ZeRO off
        if trainer.zero_stage not in ZERO_STAGES[1:]:
            problems.append(f"trainer.zero_stage={trainer.zero_stage!r}: stages 1 (optimizer state) and 2 "
                            f"(gradients too) are supported")
        if trainer.zero_stage == 2 and trainer.tp_overlapping_level == 2 and grid and grid.tp > 1:
            problems.append("trainer.zero_stage=2 reduces gradients as autograd produces them, and "
                            "tp_overlapping_level=2 produces them on two threads in no fixed order: use "
                            "zero_stage=1 or tp_overlapping_level 0 or 1")
        if trainer.optim in OPTIMIZERS and trainer.optim not in ZERO_TESTED_OPTIMIZERS \
                and not trainer.zero_allow_untested_optimizer:
            problems.append(f"trainer.optim={trainer.optim} is not elementwise, so ZeRO's flat pieces change its "
                            f"updates; use {' or '.join(ZERO_TESTED_OPTIMIZERS)}, or set "
                            f"trainer.zero_allow_untested_optimizer=true to accept that")
    for field in ("zero_reduce_bucket_size", "zero_allgather_bucket_size"):
        value = getattr(trainer, field)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                or value < 1 or value != int(value):
            problems.append(f"trainer.{field}={value!r} must be a positive whole number of elements")
    # gradient_predivide_factor's range is checked with its type (merak.config_fields).
    if trainer.prescale_gradients and trainer.gradient_predivide_factor != 1.0:
        problems.append("trainer.gradient_predivide_factor applies only without prescaling: set "
                        "trainer.prescale_gradients=false or gradient_predivide_factor=1.0")
    return problems


def _checkpoint_problems(trainer: TrainerSettings) -> list[str]:
    problems = []
    if trainer.save:
        _positive_int(trainer.save_steps, "trainer.save_steps", problems)
    limit = trainer.save_total_limit
    if limit is not None and limit != -1 and not (isinstance(limit, int) and limit >= 1):
        problems.append(f"trainer.save_total_limit={limit!r}: use -1 or null (keep all) or a positive number")
    resume = trainer.resume_from_checkpoint
    if trainer.finetune and resume in (None, False, ""):
        problems.append("trainer.finetune=true loads weights from a checkpoint: set "
                        "trainer.resume_from_checkpoint to its directory")
    if trainer.pretrained_weights and resume not in (None, False, ""):
        problems.append("trainer.pretrained_weights and trainer.resume_from_checkpoint both set: a run starts "
                        "from one of them")
    return problems


def total_steps(settings: RunSettings, steps_per_epoch: int) -> int:
    """Optimizer steps of the run: max_steps, else epochs x steps per epoch."""
    if settings.trainer.max_steps > 0:
        return settings.trainer.max_steps
    return max(1, int(settings.trainer.num_train_epochs * steps_per_epoch))


def warmup_steps(settings: RunSettings, steps: int) -> int:
    """warmup_steps if set, else warmup_ratio x steps (as the HF Trainer)."""
    if settings.trainer.warmup_steps > 0:
        return settings.trainer.warmup_steps
    return math.ceil(settings.trainer.warmup_ratio * steps)
