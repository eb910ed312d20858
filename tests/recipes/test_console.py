"""What `make train` shows: one log format, each line once, no warnings, the run directory at the end."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from train_py import run_train_py

pytestmark = pytest.mark.recipe

# HH:MM:SS [main|rank N] LEVEL logger: message (merak.report.console)
LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d \[(main|rank \d+)\] (DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+: ")
REPO = Path(__file__).resolve().parents[2]
TOY = ["model=toy", "trainer.per_device_train_batch_size=2", "trainer.gradient_accumulation_steps=4"]


def _printed_lines(text: str) -> list[str]:
    """What a run printed, a line per entry; the progress bar (redrawn with \\r) left out."""
    lines = text.replace("\r", "\n").splitlines()
    return [line for line in lines if line.strip() and not line.startswith("train:")]


@pytest.mark.timeout(400)
def test_default_layout_prints_each_line_once_and_no_warning(tmp_path, cache_dir, monkeypatch):
    """The default layout (dp2 x tp2 x pp2, sequence parallel): what `make train` runs, with a toy model."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # run_train_py passes this environment on
    run_dir = tmp_path / "run"
    result = run_train_py([*TOY, "trainer.max_steps=1", f"hydra.run.dir={run_dir}"], cache_dir, timeout=360)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = _printed_lines(result.stdout + result.stderr)
    starts = [line for line in lines if LOG_LINE.match(line)]
    assert starts, "\n".join(lines)
    # One format: any line in another logging format (Hydra's default is "[date][name][LEVEL] - ...").
    assert not [line for line in lines if re.match(r"^\[\d{4}-", line)], "\n".join(lines)
    without_time = [line[len("HH:MM:SS "):] for line in starts]
    # A line said by the launching process and again by rank 0 differs only in "[main]" / "[rank 0]".
    messages = [re.sub(r"^\[(main|rank \d+)\] ", "", line) for line in without_time]
    assert len(messages) == len(set(messages)), "\n".join(lines)
    assert not [line for line in lines if "torch.fx failed" in line]
    directory = [line for line in lines if "run directory:" in line]
    assert directory == [directory[0]] and directory[0].endswith(str(Path(run_dir).resolve()))
    # The launching process (stdout, through Hydra's handler) says it last, after the workers are done.
    assert _printed_lines(result.stdout)[-1] == directory[0]
    warnings = [line for line in lines if "Warning" in line]
    assert not warnings, "\n".join(lines)


@pytest.mark.timeout(120)
def test_config_error_is_one_message_and_status_2(tmp_path, cache_dir, monkeypatch):
    """A config merak rejects before any worker starts: its problems, in one log record, and status 2."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # run_train_py passes this environment on
    result = run_train_py([*TOY, "model.num_heads=3", f"hydra.run.dir={tmp_path / 'run'}"], cache_dir)
    assert result.returncode == 2
    lines = _printed_lines(result.stdout + result.stderr)
    assert "Traceback" not in result.stdout + result.stderr
    assert [line for line in lines if LOG_LINE.match(line)] == [lines[0]]
    assert "ERROR merak.runner: invalid configuration:" in lines[0]
    assert all(line.startswith("  - ") for line in lines[1:]), "\n".join(lines)
