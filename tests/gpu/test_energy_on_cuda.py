"""Energy on every run, on a CUDA device: a plain run with the default ``trainer.energy_device=auto``
measures with NVML, at the steps' boundaries, and reports figures a real GPU can have.

Skipped where there is no CUDA device (CPU runs: tests/recipes/test_recipe_energy_figures.py, on a
simulated GPU). By hand: ``python -m pytest -q -m gpu tests/gpu/test_energy_on_cuda.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

REPO = Path(__file__).resolve().parents[2]
TRAIN_TIMEOUT_S = int(os.environ.get("MERAK_GPU_TRAIN_TIMEOUT_S", "240"))
# NVML's energy counter moves in steps of some milliseconds: steps of GPT-2 (about 0.1 s each on a
# current GPU) rather than the toy's, and four measured ones after the first, which warms up.
RUN = ["model=gpt2", "model.dropout=0.0", "parallel=single", "trainer.per_device_train_batch_size=8",
       "trainer.gradient_accumulation_steps=2", "trainer.max_steps=5", "trainer.disable_tqdm=true"]
# Any GPU between an idle small board and a whole superchip's module.
WATTS = (10.0, 2000.0)


def test_a_plain_cuda_run_measures_its_energy_with_nvml(tmp_path, cache_dir):
    pytest.importorskip("pynvml", reason="auto measures with NVML: needs nvidia-ml-py")
    run_dir = tmp_path / "run"
    env = dict(os.environ, MERAK_CACHE_DIR=str(cache_dir), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    result = subprocess.run([sys.executable, str(REPO / "recipes/gpt/train.py"), *RUN, f"hydra.run.dir={run_dir}"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=TRAIN_TIMEOUT_S, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    energy = summary["energy"]
    assert energy["measured"] is True, energy
    assert "simulated" not in energy["device"] and energy["devices"] == 1
    assert energy["joules_per_step"] > 0 and energy["joules_per_token"] > 0
    assert WATTS[0] <= energy["power_w_per_device"] <= WATTS[1], energy
    assert energy["flop_per_joule"] > 0
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # One step's reading may fall between two of the counter's updates: its mean is what is bounded.
    assert len(steps) == 5 and all(step["energy_j"] >= 0 for step in steps) and sum(s["energy_j"] for s in steps) > 0
