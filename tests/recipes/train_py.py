"""Running a recipe's train.py in a subprocess, as a user would (shared by the recipe tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GPT_TRAIN = REPO / "recipes/gpt/train.py"


def recipe_env(cache_dir) -> dict:
    """This environment, offline, with a private data cache and no launcher variables of an outer run."""
    env = dict(os.environ, MERAK_CACHE_DIR=str(cache_dir), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    for name in ("RANK", "WORLD_SIZE"):
        env.pop(name, None)
    return env


def run_train_py(args, cache_dir, *, script: Path = GPT_TRAIN, cwd: Path = REPO,
                 timeout: float = 240) -> subprocess.CompletedProcess:
    """``python <script> <args>``, its output captured."""
    return subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=recipe_env(cache_dir),
                          capture_output=True, text=True, timeout=timeout)


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of a run's metrics.jsonl."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
