"""Loss curves (merak.report.curves): what a run's loss.png holds, and a run without matplotlib."""

from __future__ import annotations

import json
import logging

import pytest

from merak.report import curves
from merak.report.metrics import MetricsWriter


@pytest.mark.parametrize("steps", [[], [3], [1, 2, 3, 4], [5, 10, 15, 16, 17, 40], [2, 4, 5, 7, 9, 11]])
def test_step_ranges_round_trip(steps):
    assert curves.expand_ranges(curves.step_ranges(steps)) == steps


def test_step_ranges_are_short_for_long_runs():
    assert curves.step_ranges(range(10, 100_001, 10)) == [[10, 100_000, 10]]


def _write_metrics(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_run_picture_holds_the_steps_of_metrics_jsonl(tmp_path):
    """Skipped steps' null losses are left out; an evaluation line adds an eval point; a line cut short
    by a crash ends the reading."""
    _write_metrics(tmp_path / "metrics.jsonl", [
        {"step": 1, "loss": 4.0, "learning_rate": 1e-3}, {"step": 2, "loss": None, "learning_rate": 1e-3},
        {"step": 3, "loss": 3.0, "learning_rate": 5e-4}, {"step": 3, "eval_loss": 3.5, "eval_samples": 4}])
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 4, "lo')
    description = curves.write_run_curves(tmp_path)
    assert description == curves.read_description(tmp_path / "loss.png")
    assert curves.drawn_steps(tmp_path / "loss.png") == {"train loss": [1, 3], "eval loss": [3],
                                                         "learning rate": [1, 2, 3]}


def test_no_picture_without_a_step_or_without_matplotlib(tmp_path, monkeypatch, caplog):
    assert curves.write_run_curves(tmp_path) is None  # no metrics.jsonl
    _write_metrics(tmp_path / "metrics.jsonl", [{"step": 1, "eval_loss": 2.0}])
    assert curves.write_run_curves(tmp_path) is None  # no training step
    _write_metrics(tmp_path / "metrics.jsonl", [{"step": 1, "loss": 2.0, "learning_rate": 0.1}])

    def missing():
        raise ImportError("drawing loss curves needs matplotlib")

    monkeypatch.setattr(curves, "_matplotlib", missing)
    with caplog.at_level(logging.WARNING, logger="merak.report.curves"):
        assert curves.write_run_curves(tmp_path) is None
    assert "needs matplotlib" in caplog.text
    assert not (tmp_path / "loss.png").exists()


def test_metrics_writer_draws_when_closed_and_after_a_late_evaluation(tmp_path):
    """The reporting rank's writer draws loss.png once closed (at the end of training, finished or
    not), and again for an evaluation logged after training."""
    writer = MetricsWriter(output_dir=str(tmp_path), total_steps=2, samples_per_step=4, tokens_per_sample=1,
                           enabled=True, progress_bar=False)
    for step in (1, 2):
        writer.log_step(step=step, loss=1.0 / step, lr=0.1, grad_norm=1.0, step_time_s=0.1)
    assert not (tmp_path / "loss.png").exists()
    writer.close()
    writer.close()  # a second close (an outer cleanup) does nothing
    assert curves.drawn_steps(tmp_path / "loss.png") == {"train loss": [1, 2], "learning rate": [1, 2]}
    writer.log_event({"step": 2, "eval_loss": 0.7})
    assert curves.drawn_steps(tmp_path / "loss.png")["eval loss"] == [2]
