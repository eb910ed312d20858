"""Every trainer and launcher setting is typed and range-checked before launch, naming the field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from merak.config import resolve_settings
from recipes.gpt.spec import SPEC
from test_config import compose, problems_of

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("override,needle", [
    ("trainer.learning_rate=abc", "trainer.learning_rate='abc' must be a number"),
    ("trainer.learning_rate=-1", "trainer.learning_rate=-1 must be a finite number >= 0"),
    ("trainer.learning_rate=nan", "trainer.learning_rate=nan must be a finite number >= 0"),
    ("trainer.max_grad_norm=abc", "trainer.max_grad_norm='abc' must be a number"),
    ("trainer.max_grad_norm=inf", "trainer.max_grad_norm=inf must be a finite number"),
    ("trainer.max_steps=abc", "trainer.max_steps='abc' must be an integer"),
    ("trainer.max_steps=1.5", "trainer.max_steps=1.5 must be an integer"),
    ("trainer.max_steps=-2", "trainer.max_steps=-2 must be -1"),
    ("trainer.seed=abc", "trainer.seed='abc' must be an integer"),
    ("trainer.seed=-1", "trainer.seed=-1 must be within 0 .. 2**32-1"),
    ("trainer.warmup_steps=-5", "trainer.warmup_steps=-5 must be an integer >= 0"),
    ("trainer.warmup_ratio=2", "trainer.warmup_ratio=2 must be within [0, 1]"),
    ("trainer.logging_steps=0", "trainer.logging_steps=0 must be a positive integer"),
    ("trainer.adam_beta2=1.0", "trainer.adam_beta2=1.0 must be within [0, 1)"),
    ("trainer.weight_decay=-0.1", "trainer.weight_decay=-0.1 must be a finite number >= 0"),
    ("trainer.max_consecutive_skipped_steps=0", "trainer.max_consecutive_skipped_steps=0 must be a positive"),
    ("trainer.fp16=yes", "trainer.fp16='yes' must be true or false"),
    ("trainer.per_device_train_batch_size=abc", "trainer.per_device_train_batch_size='abc' must be an integer"),
    ("trainer.custom_split_points=3", "trainer.custom_split_points=3 must be a list of strings or null"),
    ("trainer.peak_tflops=0", "trainer.peak_tflops=0 must be null or a positive number"),
    ("launcher.timeout_s=0", "launcher.timeout_s=0 must be a positive number of seconds"),
    ("launcher.timeout_s=abc", "launcher.timeout_s='abc' must be a number"),
    ("launcher.threads_per_rank=0", "launcher.threads_per_rank=0 must be a positive integer"),
])
def test_each_bad_value_is_named(override, needle):
    problems = problems_of(override)
    assert len(problems) == 1, problems  # reported once, and no later check trips over the bad value
    assert problems[0].startswith(needle), problems[0]


def test_every_bad_value_is_listed_at_once():
    problems = problems_of("trainer.learning_rate=abc", "trainer.max_steps=1.5", "launcher.timeout_s=0")
    assert [p.split("=")[0] for p in problems] == ["trainer.max_steps", "trainer.learning_rate", "launcher.timeout_s"]


def test_numbers_in_every_spelling_pass():
    settings = resolve_settings(SPEC, compose("trainer.learning_rate=1", "trainer.max_grad_norm=0",
                                              "trainer.weight_decay=1e-2", "trainer.zero_reduce_bucket_size=5e8",
                                              "trainer.resume_from_checkpoint=true", "trainer.seed=0"))
    trainer = settings.trainer
    assert trainer.learning_rate == 1 and trainer.max_grad_norm == 0 and trainer.weight_decay == 0.01
    assert trainer.zero_reduce_bucket_size == 5e8 and trainer.resume_from_checkpoint is True
    assert trainer.max_consecutive_skipped_steps == 3


@pytest.mark.timeout(120)
def test_bad_numbers_stop_train_py_before_any_worker(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "recipes/gpt/train.py", "trainer.learning_rate=abc",
                             "trainer.max_steps=1.5", f"hydra.run.dir={run_dir}"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=110)
    assert result.returncode != 0
    assert "trainer.learning_rate='abc' must be a number" in result.stderr
    assert "trainer.max_steps=1.5 must be an integer" in result.stderr
    assert not (run_dir / "metrics.jsonl").exists() and "training gpt" not in result.stderr
