"""Running the seed documents' command lines in a subprocess, and checking what a run wrote
(shared by test_seed_examples.py and test_seed_api_and_run_sh.py)."""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def seed_env(cache_dir, **extra: str) -> dict:
    """This environment, offline, one thread per process, a private data cache, and no launcher
    variables of an outer run."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               MERAK_CACHE_DIR=str(cache_dir), **extra)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH"):
        env.pop(name, None)
    return env


def run_command(command, *, cwd, env, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run ``command`` in its own session, so that a timeout stops a launcher's workers too."""
    process = subprocess.Popen([str(part) for part in command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def link_example(folder: Path, script: str) -> None:
    """``folder/<script>`` -> ``examples/<script>``: the seeds run ``run_gpt.py`` from the examples
    folder, with the data beside it."""
    (folder / script).symlink_to(REPO / "examples" / script)


def write_text_csv(path: Path, rows: int = 300) -> None:
    """A ``train_context.csv`` of ``rows`` short sentences in a ``text`` column."""
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text"])
        for i in range(rows):
            writer.writerow([f"Sentence {i} tells of the quick brown fox and the lazy dog, who met on day {i % 7}."])


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of a run's metrics.jsonl."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def check_training(run_dir: Path, *, layout: dict, steps: int = 2, global_batch_size: int | None = None) -> dict:
    """Assert that ``run_dir`` holds a finished run of ``steps`` steps with ``layout`` and finite
    losses; returns its summary."""
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    assert summary["layout"] == layout
    assert summary["steps"] == steps
    if global_batch_size is not None:
        assert summary["global_batch_size"] == global_batch_size
    assert math.isfinite(summary["first_loss"]) and math.isfinite(summary["final_loss"])
    records = [r for r in read_metrics(run_dir) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in records)
    return summary
