"""Every trainer and launcher setting is typed and range-checked before launch, naming the field: a
command-line override before Hydra composes (one line each, merak.config.overrides), a wrong type or
unknown name also when Hydra composes (the typed schemas), and every value again in resolve_settings
(for configs built without the schemas, as MerakTrainer's)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from test_config import compose

from merak.config import ConfigError, LauncherSettings, TrainerSettings, resolve_settings
from merak.config.overrides import override_problems
from merak.core.fields import typed_section
from recipes.gpt.spec import SPEC

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("override,needle", [
    ("trainer.learning_rate=abc", "trainer.learning_rate='abc' must be a number"),
    ("trainer.learning_rate=-1", "trainer.learning_rate=-1 must be a finite number >= 0"),
    ("trainer.learning_rate=nan", "trainer.learning_rate=nan must be a finite number >= 0"),
    ("trainer.learning_rate=true", "trainer.learning_rate=True must be a number"),
    ("trainer.max_grad_norm=abc", "trainer.max_grad_norm='abc' must be a number"),
    ("trainer.max_grad_norm=inf", "trainer.max_grad_norm=inf must be a finite number"),
    ("trainer.max_steps=abc", "trainer.max_steps='abc' must be an integer"),
    ("trainer.max_steps=1.5", "trainer.max_steps=1.5 must be an integer"),
    ("trainer.max_steps=1e4", "trainer.max_steps=10000.0 must be an integer (write 10000)"),
    ("trainer.max_steps='3'", "trainer.max_steps='3' must be an integer"),
    ("trainer.max_steps=-2", "trainer.max_steps=-2 must be -1"),
    ("trainer.seed=abc", "trainer.seed='abc' must be an integer"),
    ("trainer.seed=-1", "trainer.seed=-1 must be within 0 .. 2**32-1"),
    ("trainer.seed=4294967296", "trainer.seed=4294967296 must be within 0 .. 2**32-1"),
    ("trainer.num_train_epochs=inf", "trainer.num_train_epochs=inf must be a finite number"),
    ("trainer.warmup_steps=-5", "trainer.warmup_steps=-5 must be an integer >= 0"),
    ("trainer.grad_reduce_dtype=float16", "trainer.grad_reduce_dtype='float16' must be float32 or bfloat16"),
    ("trainer.grad_bucket_mb=0", "trainer.grad_bucket_mb=0"),
    ("trainer.warmup_ratio=2", "trainer.warmup_ratio=2 must be within [0, 1]"),
    ("trainer.warmup_ratio=nan", "trainer.warmup_ratio=nan must be within [0, 1]"),
    ("trainer.logging_steps=0", "trainer.logging_steps=0 must be a positive integer"),
    ("trainer.adam_beta1=-0.1", "trainer.adam_beta1=-0.1 must be within [0, 1)"),
    ("trainer.adam_beta2=1.0", "trainer.adam_beta2=1.0 must be within [0, 1)"),
    ("trainer.adam_epsilon=0", "trainer.adam_epsilon=0 must be a finite number > 0"),
    ("trainer.weight_decay=-0.1", "trainer.weight_decay=-0.1 must be a finite number >= 0"),
    ("trainer.gradient_predivide_factor=inf", "trainer.gradient_predivide_factor=inf must be positive"),
    ("trainer.checkpoint_num_layers=0", "trainer.checkpoint_num_layers=0 must be a positive integer"),
    ("trainer.activation_checkpointing=maybe",
     "trainer.activation_checkpointing='maybe' must be true, false or selective"),
    ("trainer.activation_checkpointing=1", "trainer.activation_checkpointing=1 must be true or false or a string"),
    ("trainer.selective_recompute=everything",
     "trainer.selective_recompute='everything' must be matmuls or attention"),
    ("trainer.sequence_dim=-1", "trainer.sequence_dim=-1 must be a non-negative integer"),
    ("trainer.max_consecutive_skipped_steps=0", "trainer.max_consecutive_skipped_steps=0 must be a positive"),
    ("trainer.max_consecutive_skipped_steps=2.0", "trainer.max_consecutive_skipped_steps=2.0 must be an integer"),
    ("trainer.fp16=yes", "trainer.fp16='yes' must be true or false"),
    ("trainer.fp16=1", "trainer.fp16=1 must be true or false"),
    ("trainer.per_device_train_batch_size=abc", "trainer.per_device_train_batch_size='abc' must be an integer"),
    ("trainer.custom_split_points=3", "trainer.custom_split_points=3 must be a list of strings or null"),
    ("trainer.custom_split_points=[1,2]", "trainer.custom_split_points=[1, 2] must be a list of strings"),
    ("trainer.resume_from_checkpoint=3", "trainer.resume_from_checkpoint=3 must be a string or true or false"),
    ("trainer.peak_tflops=0", "trainer.peak_tflops=0 must be null or a positive number"),
    ("trainer.simulated_tflops=0", "trainer.simulated_tflops=0 must be a positive number"),
    ("trainer.num_warmup_steps=-1", "trainer.num_warmup_steps=-1 must be an integer >= 0"),
    ("trainer.num_prof_steps=0", "trainer.num_prof_steps=0 must be a positive integer"),
    ("trainer.loss_scale=inf", "trainer.loss_scale=inf must be a finite number"),
    ("launcher.timeout_s=0", "launcher.timeout_s=0 must be a positive number of seconds"),
    ("launcher.timeout_s=inf", "launcher.timeout_s=inf must be a positive number of seconds"),
    ("launcher.timeout_s=abc", "launcher.timeout_s='abc' must be a number"),
    ("launcher.threads_per_rank=0", "launcher.threads_per_rank=0 must be a positive integer"),
    ("launcher.threads_per_rank=abc", "launcher.threads_per_rank='abc' must be an integer"),
    ("launcher.keep_freed_memory=yes", "launcher.keep_freed_memory='yes' must be true or false"),
])
def test_each_bad_value_is_named(override, needle):
    problems = override_problems([override])
    assert len(problems) == 1, problems
    assert problems[0].startswith(needle), problems[0]
    # Without the command-line check (a plain dict config, as MerakTrainer's), resolve_settings names it
    # once, and no later check trips over the bad value.
    problems = problems_of_unschematized(override)
    assert len(problems) == 1, problems
    assert problems[0].startswith(needle), problems[0]


def problems_of_unschematized(*overrides: str) -> list[str]:
    """resolve_settings' problems for the gpt config with ``overrides`` applied to its plain values (no
    typed schema, so wrong types reach the checks)."""
    cfg = OmegaConf.create(OmegaConf.to_container(compose(), resolve=False))
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        OmegaConf.update(cfg, override.key_or_group, override.value(), merge=False)
    with pytest.raises(ConfigError) as info:
        resolve_settings(SPEC, cfg)
    return str(info.value).split("\n  - ")[1:]


def test_every_bad_value_is_listed_at_once():
    listed = [p.split("=")[0] for p in override_problems(
        ["-m", "trainer.learning_rate=abc", "trainer.max_steps=1.5", "launcher.timeout_s=0", "model.num_heads=3",
         "trainer.lerning_rate=1"])]
    assert listed[:3] == ["trainer.learning_rate", "trainer.max_steps", "launcher.timeout_s"] and len(listed) == 4
    # The closest names come first (a new setting with a similar name may join the list).
    assert listed[3].startswith("trainer.lerning_rate is not a known setting (did you mean trainer.learning_rate")
    problems = problems_of_unschematized("trainer.learning_rate=abc", "trainer.max_steps=1.5", "launcher.timeout_s=0",
                                         "model.num_heads=3")
    fields = [p.split("=")[0] for p in problems]
    assert fields[:3] == ["trainer.max_steps", "trainer.learning_rate", "launcher.timeout_s"]
    assert any("model.num_heads=3" in p for p in problems[3:])  # the other checks still ran


@pytest.mark.parametrize("override,needle", [("trainer.learning_rate=abc", "learning_rate"),
                                             ("trainer.lerning_rate=1", "lerning_rate"),
                                             ("launcher.threads_per_rank=abc", "threads_per_rank")])
def test_wrong_types_and_names_fail_when_hydra_composes(override, needle):
    with pytest.raises(ConfigCompositionException, match=needle):
        compose(override)


def test_values_in_range_pass_the_command_line_check():
    assert override_problems(["trainer.learning_rate=1", "trainer.max_steps=1_000", "launcher.timeout_s=30",
                              "trainer.report_to=[tensorboard]", "trainer.seed=${oc.env:SEED,1}", "model=toy",
                              "trainer.lr_scheduler_type=cosine", "trainer.learning_rate=1e-3,1e-4",
                              "~trainer.run_name", "hydra.run.dir=x", "--cfg", "job"]) == []


def test_wrong_types_do_not_crash_the_checks_that_compare_values():
    # Each of these is compared with numbers later (batch arithmetic, "nothing to train", schedules).
    problems = problems_of_unschematized("trainer.per_device_train_batch_size=abc",
                                         "trainer.gradient_accumulation_steps=x", "trainer.num_train_epochs=abc",
                                         "trainer.max_steps=abc", "trainer.tp_overlapping_level=abc",
                                         "trainer.pipeline_chunks=abc")
    assert len(problems) == 6, problems
    assert all("must be an integer" in p or "must be a number" in p for p in problems), problems


def test_numbers_in_every_spelling_pass():
    settings = resolve_settings(SPEC, compose("trainer.learning_rate=1", "trainer.max_grad_norm=0",
                                              "trainer.weight_decay=1e-2", "trainer.adam_epsilon=1E-6",
                                              "trainer.warmup_ratio=.5", "trainer.max_steps=1_000",
                                              "trainer.num_train_epochs=3", "trainer.seed=0",
                                              "trainer.zero_reduce_bucket_size=5e8", "launcher.timeout_s=30",
                                              "trainer.resume_from_checkpoint=true", "trainer.peak_tflops=null"))
    trainer = settings.trainer
    assert trainer.optimizer.learning_rate == 1.0 and type(trainer.optimizer.learning_rate) is float
    assert trainer.optimizer.max_grad_norm == 0.0 and type(trainer.optimizer.max_grad_norm) is float
    assert trainer.batch.num_train_epochs == 3.0 and type(trainer.batch.num_train_epochs) is float
    assert settings.launcher.timeout_s == 30.0 and type(settings.launcher.timeout_s) is float
    optimizer = trainer.optimizer
    assert optimizer.weight_decay == 0.01 and optimizer.adam_epsilon == 1e-6 and optimizer.warmup_ratio == 0.5
    assert trainer.batch.max_steps == 1000 and trainer.batch.seed == 0
    assert trainer.zero.zero_reduce_bucket_size == 5e8 and trainer.checkpoint.resume_from_checkpoint is True
    assert trainer.report.peak_tflops is None
    assert trainer.optimizer.max_consecutive_skipped_steps == 3


def _plain_float_fields(cls) -> list[str]:
    """Fields annotated ``float`` or ``float | None`` (not int | float, not lists)."""
    hints = typing.get_type_hints(cls)
    return [f.name for f in dataclasses.fields(cls) if hints[f.name] in (float, float | None)]


def test_float_fields_come_out_as_floats_from_the_yaml_files():
    # The yaml files write some of them as ints (launcher timeout_s: 600, num_train_epochs: 1).
    settings = resolve_settings(SPEC, compose())
    for section, cls in (("trainer", TrainerSettings), ("launcher", LauncherSettings)):
        for name in _plain_float_fields(cls):
            value = getattr(getattr(settings, section), name)
            assert value is None or type(value) is float, (section, name, value)


def test_composite_types():
    @dataclasses.dataclass(frozen=True)
    class Sample:
        ratio: float | list[float] | None = None
        ids: list[int] | None = None
        resume: str | bool | None = None
        size: int | float = 1

    problems: list[str] = []
    sample = typed_section({"ratio": [1, 0.5], "ids": [0, 6], "resume": False, "size": 4}, Sample, "s", problems)
    assert not problems
    assert sample.ratio == [1.0, 0.5] and all(type(r) is float for r in sample.ratio)
    assert sample.ids == [0, 6] and sample.resume is False and type(sample.size) is int
    assert type(typed_section({"ratio": 1}, Sample, "s", problems).ratio) is float
    bad = typed_section({"ratio": "x", "ids": [1.5], "resume": 2, "size": True, "extra": 1}, Sample, "s", problems)
    assert bad == Sample()  # wrong values keep their defaults
    assert problems == ["s.extra is not a known setting; known: ids, ratio, resume, size",
                        "s.ratio='x' must be a number or a list of numbers or null",
                        "s.ids=[1.5] must be a list of integers or null",
                        "s.resume=2 must be a string or true or false or null",
                        "s.size=True must be an integer or a number"]


@pytest.mark.timeout(120)
def test_bad_numbers_stop_train_py_before_any_worker(tmp_path):
    """The one run of a real train.py for merak.hydra_main's check of the command line, before Hydra composes
    (the values it names: test_each_bad_value_is_named, in this process)."""
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "recipes/gpt/train.py", "trainer.learning_rate=abc",
                             "trainer.max_steps=1.5", f"hydra.run.dir={run_dir}"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=110)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "trainer.learning_rate='abc' must be a number" in output
    assert "trainer.max_steps=1.5 must be an integer" in output
    assert result.returncode == 2  # the command-line check's error: one line per bad value
    assert len([line for line in output.splitlines() if " ERROR " in line]) == 2, output
    assert not (run_dir / "metrics.jsonl").exists() and "training gpt" not in output
    assert not run_dir.exists()  # stopped before Hydra composed (it makes the run directory)
