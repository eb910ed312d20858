"""Run settings: the Hydra config checked and turned into typed values, before any worker starts.

The ``trainer`` group is one object of sections, each a dataclass beside the subsystem that consumes
it (merak/*/settings.py), with its defaults, ranges and own checks; this module holds them together,
checks what spans sections and the layout, and reads the ``launcher`` and ``parallel`` groups.
Only this module and merak.runner read the config; the engine layers receive the sections.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from merak.checkpoint.settings import CheckpointSettings
from merak.core.fields import positive_int_problem, typed_section, unknown_field_problem
from merak.data.settings import BatchSettings
from merak.distributed.settings import LauncherSettings
from merak.distributed.topology import RankGrid
from merak.energy.settings import EnergySettings
from merak.optim.settings import ZERO3_WITH_COMPILE, OptimizerSettings, PrecisionSettings, ZeroSettings
from merak.pipeline.settings import SELECTIVE_WITH_COMPILE, CompileSettings, ScheduleSettings
from merak.report.settings import ReportSettings
from merak.shard.settings import ShardingSettings
from merak.tensor_parallel.settings import TensorParallelSettings


class ConfigError(ValueError):
    """The run config cannot work; the message names each field and what to change."""


@dataclass(frozen=True)
class TrainerSettings:
    """The ``trainer`` config group, one object per section; each section is a dataclass beside the code
    that consumes it, and that code receives the section itself (``settings.trainer.optimizer``).

    The group is flat where users write it (``trainer.learning_rate``, MerakArguments' and Hugging Face's
    names): :data:`SECTION_OF` maps each of those names to its section.
    """

    batch: BatchSettings = BatchSettings()
    optimizer: OptimizerSettings = OptimizerSettings()
    precision: PrecisionSettings = PrecisionSettings()
    zero: ZeroSettings = ZeroSettings()
    sharding: ShardingSettings = ShardingSettings()
    tensor_parallel: TensorParallelSettings = TensorParallelSettings()
    schedule: ScheduleSettings = ScheduleSettings()
    compile: CompileSettings = CompileSettings()
    checkpoint: CheckpointSettings = CheckpointSettings()
    energy: EnergySettings = EnergySettings()
    report: ReportSettings = ReportSettings()

    @classmethod
    def from_flat(cls, values: Mapping[str, Any], problems: list[str]) -> TrainerSettings:
        """The sections from the flat ``trainer`` group, each value type- and range-checked
        (merak.core.fields); unknown names and wrong values are appended to ``problems``."""
        for key in sorted(set(values) - set(SECTION_OF)):
            problems.append(unknown_field_problem("trainer", key, SECTION_OF))
        by_section: dict[str, dict] = {name: {} for name in TRAINER_SECTIONS}
        for key, value in values.items():
            if key in SECTION_OF:
                by_section[SECTION_OF[key]][key] = value
        return cls(**{name: typed_section(by_section[name], section, "trainer", problems)
                      for name, section in TRAINER_SECTIONS.items()})

    def replace(self, **changes) -> TrainerSettings:
        """A copy with settings changed by their flat names (``replace(max_steps=5)``)."""
        sections: dict[str, dict] = {}
        for name, value in changes.items():
            if name not in SECTION_OF:
                raise TypeError(f"trainer.{name} is not a setting")
            sections.setdefault(SECTION_OF[name], {})[name] = value
        return dataclasses.replace(self, **{section: dataclasses.replace(getattr(self, section), **values)
                                            for section, values in sections.items()})


def _sections() -> tuple[dict[str, type], dict[str, str], dict[str, dataclasses.Field]]:
    """The section classes by name, the section of each flat name, and each flat name's field."""
    hints = typing.get_type_hints(TrainerSettings)
    sections = {field.name: hints[field.name] for field in dataclasses.fields(TrainerSettings)}
    owner: dict[str, str] = {}
    settings: dict[str, dataclasses.Field] = {}
    for section, cls in sections.items():
        for field in dataclasses.fields(cls):
            if field.name in owner:  # the group is flat: a name means one setting
                raise TypeError(f"trainer.{field.name} is defined by two sections: {owner[field.name]} and {section}")
            owner[field.name], settings[field.name] = section, field
    return sections, owner, settings


# The sections by name, and the table of flat names: trainer.<name> lives in section SECTION_OF[name]
# and is declared by TRAINER_FIELDS[name] (its type, default, help and range).
TRAINER_SECTIONS, SECTION_OF, TRAINER_FIELDS = _sections()


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
        return self.trainer.batch.per_device_train_batch_size * self.num_microbatches * self.grid.dp


def _section(cfg: DictConfig, name: str, cls, problems: list[str]):
    """Config group ``name`` as a ``cls``, each value type- and range-checked (merak.core.fields)."""
    values = OmegaConf.to_container(cfg.get(name) or {}, resolve=True)
    return typed_section(values, cls, name, problems)


def _default_output_dir() -> str:
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.output_dir
    except (ImportError, ValueError):
        return os.path.abspath("merak-output")


def resolve_settings(spec, cfg: DictConfig, *, world_size: int | None = None) -> RunSettings:
    """Check the whole config and return typed settings, or raise ConfigError listing every problem.

    Each section checks its own values; the checks here are the ones that span sections or need the
    layout.

    Args:
        spec: the recipe's RecipeSpec (for model-specific layout and data checks).
        cfg: the composed Hydra config.
        world_size: number of processes an outside launcher started, if any.
    """
    problems: list[str] = []
    trainer = TrainerSettings.from_flat(OmegaConf.to_container(cfg.get("trainer") or {}, resolve=True), problems)
    launcher = _section(cfg, "launcher", LauncherSettings, problems)
    parallel = OmegaConf.to_container(cfg.get("parallel") or {}, resolve=True)
    degrees = {axis: parallel.get(axis, 1) for axis in ("dp", "tp", "pp")}
    # A list, not a generator: every axis is checked, so every bad degree is reported.
    axes_ok = [positive_int_problem(f"parallel.{k}", v, problems) for k, v in degrees.items()]
    layout_ok = all(axes_ok)
    grid = RankGrid(**degrees) if layout_ok else None
    if grid and world_size is not None and world_size != grid.world_size:
        problems.append(
            f"parallel.dp*tp*pp = {grid.dp}*{grid.tp}*{grid.pp} = {grid.world_size} but the launcher "
            f"started {world_size} processes; make them equal (e.g. torchrun --nproc_per_node)")
    pp = grid.pp if grid else None
    problems.extend(trainer.batch.problems())
    problems.extend(trainer.optimizer.problems())
    problems.extend(launcher.problems())
    num_microbatches = _microbatches(trainer.batch, grid, problems)
    problems.extend(trainer.sharding.problems(pp=pp, has_split_points=bool(spec.split_points),
                                              builds_own_stages=spec.build_stages is not None))
    problems.extend(trainer.schedule.problems(pp=pp, num_microbatches=num_microbatches))
    # The recipe's model and data groups are checked against their schemas first: the TP plan may build
    # the model, and the recipe's own checks expect values of the right types.
    model_cfg = _recipe_group(cfg, "model", spec.model_schema, problems)
    data_cfg = _recipe_group(cfg, "data", spec.data_schema, problems)
    if model_cfg is not None:
        problems.extend(trainer.tensor_parallel.problems(plan=spec.tensor_parallel_plan(model_cfg),
                                                         tp=grid.tp if grid else 1))
    problems.extend(trainer.precision.problems())
    problems.extend(trainer.zero.problems(trainer.optimizer.optim))
    problems.extend(trainer.checkpoint.problems())
    problems.extend(trainer.report.problems())
    problems.extend(trainer.compile.problems(on_cuda=_trains_on_cuda(launcher)))
    problems.extend(_cross_section_problems(trainer, grid))
    if grid and _schedule_usable(trainer):
        problems.extend(trainer.energy.problems(schedule=trainer.schedule.train_schedule, pp=grid.pp,
                                                num_microbatches=num_microbatches, num_chunks=trainer.schedule.chunks,
                                                dp=grid.dp))
    # Model checks run even when the layout is invalid, so every problem is listed at once.
    if model_cfg is not None:
        problems.extend(spec.check_layout(model_cfg, *((grid.dp, grid.tp, grid.pp) if grid else (1, 1, 1))))
    if data_cfg is not None:
        problems.extend(spec.check_data(data_cfg))
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))
    return RunSettings(grid=grid, trainer=trainer, launcher=launcher, model_cfg=model_cfg, data_cfg=data_cfg,
                       output_dir=trainer.report.output_dir or _default_output_dir(), num_microbatches=num_microbatches)


def _recipe_group(cfg: DictConfig, name: str, schema: type | None, problems: list[str]) -> DictConfig | None:
    """The recipe's ``model`` or ``data`` group checked against its schema (RecipeSpec.model_schema,
    data_schema), with the schema's defaults for the keys it leaves out; None when a value is wrong.
    Without a schema, the group as it is."""
    group = cfg.get(name)
    if schema is None:
        return group
    found: list[str] = []
    _section(cfg, name, schema, found)
    problems.extend(found)
    if found:
        return None
    defaults = {field.name: field.default_factory() if field.default is dataclasses.MISSING else field.default
                for field in dataclasses.fields(schema)}
    return OmegaConf.merge(OmegaConf.create(defaults), group if group is not None else {})


def _microbatches(batch: BatchSettings, grid: RankGrid | None, problems: list[str]) -> int:
    """Microbatches per step: global_batch_size / (per_device_train_batch_size x dp) when the global
    batch is set (and divides), else gradient_accumulation_steps."""
    size = batch.per_device_train_batch_size
    if batch.global_batch_size is None or grid is None or batch.problems():
        return batch.gradient_accumulation_steps
    per_step = size * grid.dp
    if batch.global_batch_size % per_step:
        problems.append(f"trainer.global_batch_size={batch.global_batch_size} is not divisible by "
                        f"per_device_train_batch_size*dp = {size}*{grid.dp}; change one of them")
        return batch.gradient_accumulation_steps
    return batch.global_batch_size // per_step


def _trains_on_cuda(launcher: LauncherSettings) -> bool:
    import torch

    return torch.cuda.is_available() and launcher.backend != "gloo"


def _cross_section_problems(trainer: TrainerSettings, grid: RankGrid | None) -> list[str]:
    """Settings of two sections that cannot work together."""
    problems = []
    tp = grid.tp if grid else 1
    overlapping_halves = trainer.tensor_parallel.tp_overlapping_level == 2 and tp > 1
    if overlapping_halves and trainer.schedule.activation_checkpointing:
        problems.append("trainer.tp_overlapping_level=2 runs stage halves on two threads and cannot recompute "
                        "them: set trainer.activation_checkpointing=false")
    if trainer.zero.stage >= 2 and overlapping_halves:
        problems.append(f"trainer.zero_stage={trainer.zero.stage} reduces gradients as autograd produces them, and "
                        "tp_overlapping_level=2 produces them on two threads in no fixed order: use "
                        "zero_stage=1 or tp_overlapping_level 0 or 1")
    if trainer.zero.stage == 3 and trainer.compile.enabled:
        problems.append(ZERO3_WITH_COMPILE)
    # Contradicting compile settings are the compile section's to report.
    compile_ok = not trainer.compile.contradictions()
    if trainer.schedule.activation_checkpointing and compile_ok and trainer.compile.uses_cuda_graphs:
        problems.append("trainer.cuda_graphs=true (or a torch_compile_mode with CUDA graphs) with recomputation "
                        "failed on a GPU: the recomputed parts' saved tensors were not on the device the first run "
                        "saved them on (docs/gpu.md); set trainer.activation_checkpointing=false")
    if trainer.schedule.selective_mode is not None and trainer.compile.enabled:
        problems.append(SELECTIVE_WITH_COMPILE)
    traced = trainer.sharding.trace_method is not None
    if grid and not traced and _chunks_or_one(trainer) > 1:
        problems.append("interleaved schedules cut the model into pp x pipeline_chunks pieces: they need a "
                        "captured graph (trace_method=fx or dynamo)")
    if tp > 1 and not traced and grid and grid.pp > 1:
        problems.append("tensor parallelism with pp > 1 needs a captured graph: use trace_method=fx or dynamo")
    return problems


def _schedule_usable(trainer: TrainerSettings) -> bool:
    """Whether the schedule name is known and pipeline_chunks valid (else the schedule section reports it)."""
    from merak.pipeline.schedules import schedule_names

    chunks = trainer.schedule.pipeline_chunks
    return trainer.schedule.train_schedule in schedule_names() and (chunks is None or chunks >= 1)


def _chunks_or_one(trainer: TrainerSettings) -> int:
    """Model chunks per rank, 1 when the schedule cannot be used (reported elsewhere)."""
    return trainer.schedule.chunks if _schedule_usable(trainer) else 1


def total_steps(settings: RunSettings, steps_per_epoch: int) -> int:
    """Optimizer steps of the run: max_steps, else epochs x steps per epoch."""
    if settings.trainer.batch.max_steps > 0:
        return settings.trainer.batch.max_steps
    return max(1, int(settings.trainer.batch.num_train_epochs * steps_per_epoch))
