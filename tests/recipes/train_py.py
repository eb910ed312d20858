"""Running a recipe's train.py in a subprocess, as a user would (shared by the recipe tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omegaconf import DictConfig

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


def compose_recipe(recipe: str, overrides=()) -> DictConfig:
    """``recipes/<recipe>/conf/train.yaml`` composed with ``overrides``, as its train.py would (in this process)."""
    import hydra

    with hydra.initialize_config_dir(config_dir=str(REPO / "recipes" / recipe / "conf"), version_base=None):
        return hydra.compose("train", overrides=list(overrides))


def run_in_process(recipe: str, overrides, output_dir) -> dict:
    """``merak.run`` of a recipe in this process (its workers forked from it), the summary returned.

    What a train.py adds around it (the command-line check, exit statuses, one-line errors) is
    tested once, through a real train.py; this skips the seconds of imports a new interpreter pays.
    """
    import merak
    from merak.recipe import load_spec

    spec = load_spec(REPO / "recipes" / recipe / "train.py")
    return merak.run(spec, compose_recipe(recipe, [*overrides, f"trainer.output_dir={output_dir}"]))
