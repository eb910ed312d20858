"""Recipes evaluate held-out samples every trainer.eval_steps and report to TensorBoard
(trainer.report_to); bad values fail before any process starts."""

from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.recipe

REPO = Path(__file__).resolve().parents[2]
TOY = ["model=toy", "trainer.per_device_train_batch_size=2", "trainer.gradient_accumulation_steps=2"]


def _train(args, cache_dir, timeout=240) -> subprocess.CompletedProcess:
    env = dict(os.environ, MERAK_CACHE_DIR=str(cache_dir), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, str(REPO / "recipes/gpt/train.py"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def _scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = glob.glob(str(run_dir / "runs" / "**" / "events.out.tfevents.*"), recursive=True)
    assert len(files) == 1, files
    events = EventAccumulator(files[0])
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.timeout(300)
def test_held_out_evaluation_and_tensorboard(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    result = _train([*TOY, "parallel=pp2", "trainer.max_steps=4", "trainer.eval_steps=2", "trainer.eval_iters=1",
                     "trainer.report_to=[tensorboard]", f"hydra.run.dir={run_dir}"], cache_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "loss" in line]
    evaluations = [line for line in lines if "eval_loss" in line]
    assert [line["step"] for line in steps] == [1, 2, 3, 4]
    assert [line["step"] for line in evaluations] == [2, 4]
    # eval_iters=1: one evaluation step of the global batch (2 samples x 2 microbatches).
    assert all(line["eval_samples"] == 4 and line["eval_steps"] == 1 for line in evaluations)
    assert all(math.isfinite(line["eval_loss"]) for line in evaluations)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval"]["step"] == 4 and summary["eval"]["eval_loss"] == evaluations[-1]["eval_loss"]
    assert "eval_loss" in result.stderr
    scalars = _scalars(run_dir)
    assert [step for step, _ in scalars["train/loss"]] == [1, 2, 3, 4]
    assert [value for _, value in scalars["train/loss"]] == pytest.approx([line["loss"] for line in steps], rel=1e-6)
    assert [step for step, _ in scalars["eval/loss"]] == [2, 4]
    assert [value for _, value in scalars["eval/loss"]] == pytest.approx(
        [line["eval_loss"] for line in evaluations], rel=1e-6)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("override,message", [
    ("trainer.report_to=[tensorboard,mlflow]", "trainer.report_to names 'mlflow'; use none, all or any of"),
    ("trainer.eval_holdout=0.9", "trainer.eval_holdout=0.9 must be within (0, 0.5]"),
    ("trainer.eval_steps=0", "trainer.eval_steps=0 must be null (no evaluation) or a positive integer"),
])
def test_bad_evaluation_settings_fail_before_launch(tmp_path, cache_dir, override, message):
    result = _train([*TOY, override, f"hydra.run.dir={tmp_path}"], cache_dir, timeout=120)
    assert result.returncode != 0
    assert message in result.stderr + result.stdout
    assert not (tmp_path / "metrics.jsonl").exists()
