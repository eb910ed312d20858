"""bench/gpu_single.py on the CPU (--smoke --compile): the GPU benchmark's script runs as is, and its four
loops (plain and merak, eager and compiled) start from the same weights and batch (equal first losses), so
the ratios it reports compare like with like."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.recipe

REPO = Path(__file__).resolve().parents[2]


def test_gpu_benchmark_smoke_run_on_cpu(tmp_path, cache_dir):
    out = tmp_path / "gpu_single.json"
    env = dict(os.environ, MERAK_CACHE_DIR=str(cache_dir), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_single.py"), "--smoke", "--model", "gpt2", "--model", "vit-base",
         "--warmup", "1", "--steps", "1", "--workers", "0", "--compile", "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert [r["model"] for r in rows] == ["gpt2", "vit-base"]
    loops = ("plain", "merak", "plain_compiled", "merak_compiled")
    for row in rows:
        assert not [key for key in row if key.endswith("_error")], row
        assert all(row[f"{who}_s"] > 0 for who in loops) and row["model_flops_per_step"] > 0
        for who in loops[1:]:  # inductor reorders fp32 sums: 1e-5
            assert row[f"{who}_first_loss"] == pytest.approx(row["plain_first_loss"], rel=1e-5), (who, row["model"])
        assert row["compiled_ratio"] > 0 and row["speedup_over_plain_eager"] > 0
