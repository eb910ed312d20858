"""bench/gpu_check.py on the CPU (--smoke): the GPU check runs as is, tests/gpu is collected whole, and
gpu_single.py's four loops (plain and merak, eager and compiled) start from the same weights and batch
(equal first losses), so the ratios the check reports compare like with like."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.recipe

REPO = Path(__file__).resolve().parents[2]


def test_gpu_check_smoke_run_on_cpu(tmp_path, cache_dir):
    env = dict(os.environ, MERAK_CACHE_DIR=str(cache_dir), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--smoke", "--out", str(tmp_path), "--model", "gpt2",
         "--model", "vit-base", "--warmup", "1", "--steps", "1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["tests"]["exit_status"] == 0 and report["tests"]["collected"] == 31
    rows = report["bench"]["results"]
    assert [r["model"] for r in rows] == ["gpt2", "vit-base"] and not report["bench"]["not_measured"]
    loops = ("plain", "merak", "plain_compiled", "merak_compiled")
    for row in rows:
        assert not [key for key in row if key.endswith("_error")], row
        assert all(row[f"{who}_s"] > 0 for who in loops) and row["model_flops_per_step"] > 0
        for who in loops[1:]:  # inductor reorders fp32 sums: 1e-5
            assert row[f"{who}_first_loss"] == pytest.approx(row["plain_first_loss"], rel=1e-5), (who, row["model"])
        assert row["compiled_ratio"] > 0 and row["speedup_over_plain_eager"] > 0
    assert {g["goal"] for g in report["goals"]} >= {"gpt2: no crash", "vit-base: no crash"}
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "31 cases collected" in markdown and "| gpt2" in markdown and "| vit-base" in markdown
