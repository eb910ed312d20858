"""The trainer config is one object of typed sections, each beside its subsystem and received by it, with
one source of defaults: the section. The flat names users write map onto the sections by one table."""

from __future__ import annotations

import ast
import dataclasses
import pickle
from pathlib import Path

import pytest
import yaml

from merak.config import SECTION_OF, TRAINER_FIELDS, TRAINER_SECTIONS, ConfigError, LauncherSettings, TrainerSettings

REPO = Path(__file__).resolve().parents[2]


def _defaults(fields) -> dict:
    return {field.name: field.default for field in fields if field.default is not dataclasses.MISSING}


def test_every_setting_belongs_to_exactly_one_section_and_the_table_says_which():
    names = [field.name for cls in TRAINER_SECTIONS.values() for field in dataclasses.fields(cls)]
    assert len(names) == len(set(names)) == len(SECTION_OF) == len(TRAINER_FIELDS)
    for name, section in SECTION_OF.items():
        assert name in {field.name for field in dataclasses.fields(TRAINER_SECTIONS[section])}
        assert TRAINER_FIELDS[name] in dataclasses.fields(TRAINER_SECTIONS[section])
    assert set(TRAINER_SECTIONS) == {field.name for field in dataclasses.fields(TrainerSettings)}
    assert not set(SECTION_OF) & set(TRAINER_SECTIONS)  # a flat name never shadows a section


def test_each_section_lives_beside_its_subsystem_and_the_settings_hold_it():
    trainer = TrainerSettings().replace(learning_rate=0.5, zero_optimization=True, profile=True)
    assert trainer.optimizer.learning_rate == 0.5 and type(trainer.optimizer).__name__ == "OptimizerSettings"
    assert trainer.zero.zero_optimization and trainer.zero.stage == 1 and trainer.energy.profile
    assert trainer.energy.enabled and trainer.batch == TrainerSettings().batch  # untouched sections stay
    for section, cls in TRAINER_SECTIONS.items():
        assert isinstance(getattr(trainer, section), cls)
        assert cls.__module__.startswith("merak.") and not cls.__module__.startswith("merak.config"), cls
        assert all(field.metadata.get("help") for field in dataclasses.fields(cls)), cls
    assert pickle.loads(pickle.dumps(trainer)) == trainer  # crosses to spawned workers
    with pytest.raises(TypeError, match="trainer.learning_rat is not a setting"):
        trainer.replace(learning_rat=1.0)


def test_the_flat_group_is_checked_once_with_every_problem_named():
    problems: list[str] = []
    trainer = TrainerSettings.from_flat({"learning_rate": 1, "zero_stage": "two", "learning_rat": 0.1}, problems)
    assert trainer.optimizer.learning_rate == 1.0 and type(trainer.optimizer.learning_rate) is float
    assert trainer.zero.zero_stage == 1  # a wrong value keeps its default, so later checks do not trip on it
    assert len(problems) == 2
    assert problems[0].startswith("trainer.learning_rat is not a known setting (did you mean trainer.learning_rate?)")
    assert problems[1] == "trainer.zero_stage='two' must be an integer"


def test_the_yaml_groups_set_no_defaults_of_their_own():
    for path in ("merak/conf/trainer/default.yaml", "merak/conf/launcher/local.yaml"):
        values = yaml.safe_load((REPO / path).read_text())
        assert set(values) == {"defaults"}, path


def test_the_hydra_schema_is_the_flat_group_with_the_sections_defaults():
    from merak.conf.schemas import TrainerSettingsSchema

    schema = {field.name: field for field in dataclasses.fields(TrainerSettingsSchema)}
    assert set(schema) == set(SECTION_OF)
    assert _defaults(schema.values()) == _defaults(TRAINER_FIELDS.values())


def test_no_options_twin_copies_a_section():
    """Consumers receive the sections themselves: no dataclass outside merak.config repeats three or more
    of one section's fields (the engine's, optimizer's, checkpoint's, planner's options used to)."""
    sections = {name: {field.name for field in dataclasses.fields(cls)} for name, cls in TRAINER_SECTIONS.items()}
    own = {cls.__module__.replace(".", "/") + ".py" for cls in TRAINER_SECTIONS.values()} | {"merak/hf/arguments.py"}
    # A plan records the methods it used (fx may have fallen back to torch.export): results, not settings.
    results = {"merak/shard/plan.py:PipelinePlan"}
    twins = []
    for path in sorted((REPO / "merak").rglob("*.py")):
        relative = str(path.relative_to(REPO))
        if relative in own or relative.startswith("merak/config/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            fields = {item.target.id for item in node.body
                      if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)}
            twins += [f"{relative}:{node.name} copies {section}" for section, names in sections.items()
                      if len(fields & names) >= 3 and f"{relative}:{node.name}" not in results]
    assert twins == []


def test_a_config_error_names_the_flat_setting():
    from merak.autoplan.planner import compose_recipe
    from merak.config import resolve_settings

    spec, cfg = compose_recipe("gpt", ["model=toy", "trainer.adam_beta1=0.5", "trainer.zero_optimization=true",
                                       "trainer.optim=adafactor"])
    cfg.trainer.adam_beta1 = 1.5  # past Hydra's own type check, as a YAML value of the right type would be
    with pytest.raises(ConfigError) as error:
        resolve_settings(spec, cfg)
    assert "trainer.adam_beta1=1.5 must be within [0, 1)" in str(error.value)
    assert "trainer.optim=adafactor is not elementwise" in str(error.value)


def test_merak_arguments_share_the_run_defaults():
    pytest.importorskip("transformers")
    from merak.hf.arguments import MerakArguments

    run_defaults = {**_defaults(TRAINER_FIELDS.values()), **_defaults(dataclasses.fields(LauncherSettings))}
    arguments = {field.name: field for field in dataclasses.fields(MerakArguments)}
    declared_here = set(MerakArguments.__annotations__)  # Hugging Face's own fields keep Hugging Face's defaults
    merak_own = {name for name in declared_here & set(run_defaults)
                 if arguments[name].default is not dataclasses.MISSING}
    # save follows save_strategy (Hugging Face's way) unless set; every other shared field has the run's default.
    differing = {name for name in merak_own if arguments[name].default != run_defaults[name]}
    assert differing <= {"save"}, differing
    assert {"activation_checkpointing", "train_schedule", "zero_stage", "timeout_s"} <= merak_own
