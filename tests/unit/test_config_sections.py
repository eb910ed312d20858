"""The trainer config is composed of typed sections, each beside its subsystem, with one source of
defaults: the section. The YAML, MerakArguments and the engine's options take theirs from it."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest
import yaml

from merak.config import TRAINER_SECTIONS, LauncherSettings, TrainerSettings
from merak.engine import NO_RECOMPUTE, OptimizerOptions, RecomputeOptions
from merak.optim.distributed import ZeroOptions
from merak.optim.precision import PrecisionOptions

REPO = Path(__file__).resolve().parents[2]


def _defaults(cls) -> dict:
    return {field.name: field.default for field in dataclasses.fields(cls) if field.default is not dataclasses.MISSING}


def test_every_setting_belongs_to_exactly_one_section():
    names = [field.name for cls in TRAINER_SECTIONS.values() for field in dataclasses.fields(cls)]
    assert len(names) == len(set(names))
    assert sorted(names) == sorted(field.name for field in dataclasses.fields(TrainerSettings))


def test_each_section_lives_beside_its_subsystem_and_is_reachable_from_the_settings():
    trainer = TrainerSettings(learning_rate=0.5, zero_optimization=True, profile=True)
    assert trainer.optimizer.learning_rate == 0.5 and type(trainer.optimizer).__name__ == "OptimizerSettings"
    assert trainer.zero.zero_optimization and trainer.energy.profile and trainer.energy.enabled
    for section, cls in TRAINER_SECTIONS.items():
        assert isinstance(getattr(trainer, section), cls)
        assert cls.__module__.startswith("merak.") and cls.__module__ != "merak.config", cls
        assert all(field.metadata.get("help") for field in dataclasses.fields(cls)), cls
    assert pickle.loads(pickle.dumps(trainer)) == trainer  # crosses to spawned workers


def test_the_yaml_groups_set_no_defaults_of_their_own():
    for path in ("merak/conf/trainer/default.yaml", "merak/conf/launcher/local.yaml"):
        values = yaml.safe_load((REPO / path).read_text())
        assert set(values) == {"defaults"}, path


def test_engine_options_take_their_defaults_from_the_sections():
    trainer = TrainerSettings()
    optimizer = OptimizerOptions()
    for name in _defaults(OptimizerOptions):
        assert getattr(optimizer, name) == getattr(trainer, name), name
    assert dataclasses.asdict(PrecisionOptions()) == dataclasses.asdict(trainer.precision)
    zero = ZeroOptions()
    assert (zero.reduce_bucket_size, zero.allgather_bucket_size, zero.prescale_gradients,
            zero.gradient_predivide_factor) == (trainer.zero_reduce_bucket_size, trainer.zero_allgather_bucket_size,
                                                trainer.prescale_gradients, trainer.gradient_predivide_factor)
    assert RecomputeOptions().activation_checkpointing is trainer.activation_checkpointing is True
    assert NO_RECOMPUTE.activation_checkpointing is False  # the engine's own default: asked for, not assumed


def test_merak_arguments_share_the_run_defaults():
    pytest.importorskip("transformers")
    from merak.hf.arguments import MerakArguments

    run_defaults = {**_defaults(TrainerSettings), **_defaults(LauncherSettings)}
    arguments = {field.name: field for field in dataclasses.fields(MerakArguments)}
    declared_here = set(MerakArguments.__annotations__)  # Hugging Face's own fields keep Hugging Face's defaults
    merak_own = {name for name in declared_here & set(run_defaults)
                 if arguments[name].default is not dataclasses.MISSING}
    # save follows save_strategy (Hugging Face's way) unless set; every other shared field has the run's default.
    differing = {name for name in merak_own if arguments[name].default != run_defaults[name]}
    assert differing <= {"save"}, differing
    assert {"activation_checkpointing", "train_schedule", "zero_stage", "timeout_s"} <= merak_own
