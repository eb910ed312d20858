"""Recipes evaluate held-out samples every trainer.eval_steps and report to TensorBoard
(trainer.report_to); bad values fail before any process starts."""

from __future__ import annotations

import glob
import json
import logging
import math
from pathlib import Path

import pytest
from train_py import read_metrics, run_in_process

from merak.config import ConfigError
from merak.report.curves import drawn_steps

pytestmark = pytest.mark.recipe

TOY = ["model=toy", "trainer.per_device_train_batch_size=2", "trainer.gradient_accumulation_steps=2"]


def _scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = glob.glob(str(run_dir / "runs" / "**" / "events.out.tfevents.*"), recursive=True)
    assert len(files) == 1, files
    events = EventAccumulator(files[0])
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.timeout(300)
def test_held_out_evaluation_and_tensorboard(tmp_path, cache_dir, capfd, caplog):
    """The gpt recipe in this process (its workers forked from it) at pp=2."""
    caplog.set_level(logging.INFO)
    run_dir = tmp_path / "run"
    run_in_process("gpt", [*TOY, "parallel=pp2", "trainer.max_steps=4", "trainer.eval_steps=2", "trainer.eval_iters=1",
                           "trainer.report_to=[tensorboard]"], run_dir)
    lines = read_metrics(run_dir)
    steps = [line for line in lines if "loss" in line]
    evaluations = [line for line in lines if "eval_loss" in line]
    assert [line["step"] for line in steps] == [1, 2, 3, 4]
    assert [line["step"] for line in evaluations] == [2, 4]
    # eval_iters=1: one evaluation step of the global batch (2 samples x 2 microbatches).
    assert all(line["eval_samples"] == 4 and line["eval_steps"] == 1 for line in evaluations)
    assert all(math.isfinite(line["eval_loss"]) for line in evaluations)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval"]["step"] == 4 and summary["eval"]["eval_loss"] == evaluations[-1]["eval_loss"]
    assert summary["final_learning_rate"] == steps[-1]["learning_rate"]
    # Rank 0 drew loss.png beside metrics.jsonl from the same lines.
    assert drawn_steps(run_dir / "loss.png") == {"train loss": [1, 2, 3, 4], "eval loss": [2, 4],
                                                 "learning rate": [1, 2, 3, 4]}
    assert "eval_loss" in "".join(capfd.readouterr()) + caplog.text  # the workers' output and the launcher's log
    scalars = _scalars(run_dir)
    assert [step for step, _ in scalars["train/loss"]] == [1, 2, 3, 4]
    assert [value for _, value in scalars["train/loss"]] == pytest.approx([line["loss"] for line in steps], rel=1e-6)
    assert [step for step, _ in scalars["eval/loss"]] == [2, 4]
    assert [value for _, value in scalars["eval/loss"]] == pytest.approx(
        [line["eval_loss"] for line in evaluations], rel=1e-6)


@pytest.mark.timeout(120)
def test_wall_clock_breakdown_with_evaluation_writes_its_summary(tmp_path, cache_dir):
    """The timeline drawn at the end is the last training step's, not the forward-only evaluation's that
    ran after it (whose instructions cannot price the training schedule's backwards). One process shows it."""
    summary = run_in_process("gpt", [*TOY, "parallel=single", "trainer.max_steps=2", "trainer.eval_steps=1",
                                     "trainer.eval_iters=1", "trainer.wall_clock_breakdown=true",
                                     "trainer.disable_tqdm=true"], tmp_path)
    assert summary["eval"]["step"] == 2
    assert summary["timeline"]["stages"][0]["busy"]["backward"] > 0, summary["timeline"]
    assert {"timeline.json", "timeline.png", "timeline_vs_simulated.png", "summary.json"} <= \
        {path.name for path in tmp_path.iterdir()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("override,message", [
    ("trainer.report_to=[tensorboard,mlflow]", "trainer.report_to names 'mlflow'; use none, all or any of"),
    ("trainer.eval_holdout=0.9", "trainer.eval_holdout=0.9 must be within (0, 0.5]"),
    ("trainer.eval_steps=0", "trainer.eval_steps=0 must be null (no evaluation) or a positive integer"),
])
def test_bad_evaluation_settings_fail_before_launch(tmp_path, cache_dir, override, message):
    """merak.run raises ConfigError in this process before any worker exists (train.py's exit status and
    one-line message for such an error: tests/recipes/test_console.py)."""
    with pytest.raises(ConfigError) as error:
        run_in_process("gpt", [*TOY, override], tmp_path)
    assert message in str(error.value)
    assert not (tmp_path / "metrics.jsonl").exists()
