"""Runs that go wrong: non-finite training (in this process, its files checked), two runs in one
directory, and interrupts sent to a real train.py's launcher (no process left behind, one line printed)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_py import GPT_TRAIN, REPO, read_metrics, recipe_env, run_in_process

from merak.distributed.launch import WorkerFailed
from merak.session.run_directory import LOCK_NAME, RunDirectoryBusy

pytestmark = pytest.mark.recipe

TOY = ["model=toy", "trainer.per_device_train_batch_size=2", "trainer.gradient_accumulation_steps=4",
       "trainer.disable_tqdm=true"]


def _start(args, cache_dir, log: Path) -> subprocess.Popen:
    """A run in its own session (so its processes can be found, and signals reach only it)."""
    with open(log, "w") as handle:
        return subprocess.Popen([sys.executable, str(GPT_TRAIN), *args], cwd=REPO, env=recipe_env(cache_dir),
                                stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for_steps(run_dir: Path, process: subprocess.Popen, log: Path, steps: int = 1,
                    timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the run ended early:\n{log.read_text()[-3000:]}")
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.2)
    process.kill()
    pytest.fail("the run made no progress")


def _processes_in_session(session_id: int) -> list[int]:
    """Processes still alive in a session (zombies included: they are not reaped yet)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended while we looked
        if int(fields[3]) == session_id:  # after the name: state, ppid, pgrp, session
            found.append(int(entry))
    return found


def _checkpoint_tensors(run_dir: Path):
    for path in sorted(run_dir.glob("checkpoint-*/**/*.safetensors")):
        yield from ((path, name, tensor) for name, tensor in load_file(path).items())


@pytest.mark.timeout(400)
@pytest.mark.parametrize("precision", [
    ["parallel=pp2"],
    ["parallel=dp2", "trainer.fp16=true", "trainer.initial_scale_power=8"],
], ids=["fp32-pp2", "fp16-dp2"])
def test_nonfinite_training_stops_and_saves_nothing_nonfinite(tmp_path, cache_dir, precision):
    """In this process: the worker's error ends the run (train.py's exit status 1 for a failed worker:
    merak.runner.run_command)."""
    run_dir = tmp_path / "run"
    with pytest.raises(WorkerFailed) as failed:
        run_in_process("gpt", [*TOY, *precision, "trainer.learning_rate=1e4", "trainer.max_steps=40",
                               "trainer.save=true", "trainer.save_steps=1",
                               "trainer.max_consecutive_skipped_steps=2"], run_dir)
    output = str(failed.value)
    assert "not finite 2 steps in a row" in output and "trainer.max_consecutive_skipped_steps" in output
    metrics = read_metrics(run_dir)
    assert len(metrics) < 40, "the run must stop early"
    assert [m["skipped"] for m in metrics[-2:]] == [True, True]
    last_update = max(m["step"] for m in metrics if not m["skipped"])
    checkpoints = sorted(int(p.name.split("-")[1]) for p in run_dir.glob("checkpoint-*"))
    assert checkpoints and checkpoints[-1] <= metrics[-1]["step"]
    tensors = 0
    for path, name, tensor in _checkpoint_tensors(run_dir):
        if tensor.is_floating_point():
            tensors += 1
            assert torch.isfinite(tensor).all(), f"{path}: {name} is not finite"
    assert tensors > 0
    # What a restart would load: the skipped steps did not change the weights.
    last = load_file(run_dir / f"checkpoint-{checkpoints[-1]}" / "model" / "pp000-tp000.safetensors")
    at_update = load_file(run_dir / f"checkpoint-{last_update}" / "model" / "pp000-tp000.safetensors")
    assert all(torch.equal(last[name], at_update[name]) for name in last)


@pytest.mark.timeout(400)
def test_second_run_in_a_busy_directory_and_sigint_to_the_launcher(tmp_path, cache_dir, caplog):
    """The first run is a train.py process; the second, in this process, finds its directory busy."""
    caplog.set_level(logging.INFO)
    run_dir, log = tmp_path / "run", tmp_path / "first.log"
    first = _start([*TOY, "parallel=dp2", "trainer.max_steps=2000", f"hydra.run.dir={run_dir}"], cache_dir, log)
    try:
        _wait_for_steps(run_dir, first, log)
        with pytest.raises(RunDirectoryBusy) as busy:
            run_in_process("gpt", [*TOY, "parallel=single", "trainer.max_steps=2"], run_dir)
        assert "is in use by a run that is still going" in str(busy.value) and f"pid {first.pid}" in str(busy.value)
        assert "training gpt" not in caplog.text  # refused before any worker started
        # The same refusal as a command: the running run's record and log stay its own.
        record = (run_dir / ".hydra" / "config.yaml").read_text()
        refused = subprocess.run([sys.executable, str(GPT_TRAIN), *TOY, "parallel=single", "trainer.seed=2",
                                  f"hydra.run.dir={run_dir}"], cwd=REPO, env=recipe_env(cache_dir),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
        assert refused.returncode == 2 and "is in use by a run that is still going" in refused.stdout
        assert (run_dir / ".hydra" / "config.yaml").read_text() == record and "seed: 2" not in record
        assert "is in use" not in (run_dir / "train.log").read_text()
        steps = [m["step"] for m in read_metrics(run_dir)]  # every line whole JSON, all of the first run
        assert steps == list(range(1, len(steps) + 1))

        os.kill(first.pid, signal.SIGINT)
        assert first.wait(timeout=30) == 128 + signal.SIGINT
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    _assert_stopped_cleanly(first.pid, log, run_dir, "SIGINT")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("how", ["sigterm-to-launcher", "ctrl-c-to-process-group"])
def test_interrupt_stops_every_worker(tmp_path, cache_dir, how):
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    run = _start([*TOY, "parallel=pp2", "trainer.max_steps=2000", f"hydra.run.dir={run_dir}"], cache_dir, log)
    try:
        _wait_for_steps(run_dir, run, log, steps=2)
        if how == "sigterm-to-launcher":
            os.kill(run.pid, signal.SIGTERM)
            expected, name = 128 + signal.SIGTERM, "SIGTERM"
        else:  # what a terminal's Ctrl-C does: every process of the foreground group gets SIGINT
            os.killpg(run.pid, signal.SIGINT)
            expected, name = 128 + signal.SIGINT, "SIGINT"
        assert run.wait(timeout=30) == expected  # how promptly it stops is not asserted on a shared machine
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    _assert_stopped_cleanly(run.pid, log, run_dir, name)


def _assert_stopped_cleanly(session_id: int, log: Path, run_dir: Path, signal_name: str) -> None:
    deadline = time.monotonic() + 10
    while _processes_in_session(session_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_in_session(session_id) == [], "processes of the run are left"
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    assert [line for line in text.splitlines() if "interrupted" in line] == \
        [line for line in text.splitlines() if f"interrupted by {signal_name}: stopped 2 workers" in line]
    assert sum("interrupted" in line for line in text.splitlines()) == 1
    assert not (run_dir / LOCK_NAME).exists()
