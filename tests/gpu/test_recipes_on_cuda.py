"""Every recipe on one CUDA device: its default model and its toy train in bf16, and the toys' losses on
CUDA equal the CPU's (fp32); compiled toys (trainer.torch_compile, also with CUDA graphs) track the
eager ones. Skipped where there is no CUDA device; their CPU proxy is
tests/unit/test_device_agnostic_capture.py (capture on the CPU, run on meta).

Run on a GPU machine with ``python -m pytest -q -m gpu tests/gpu``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

REPO = Path(__file__).resolve().parents[2]
# recipe -> its default (the ENVIRONMENT.md GPU runs') model option, with a batch that fits one GPU.
DEFAULTS = {
    "gpt": ["model=gpt2", "trainer.per_device_train_batch_size=8", "trainer.gradient_accumulation_steps=2"],
    "bert": ["model=bert-base-uncased", "trainer.per_device_train_batch_size=8",
             "trainer.gradient_accumulation_steps=2"],
    "t5": ["model=t5-base", "trainer.per_device_train_batch_size=8", "trainer.gradient_accumulation_steps=2"],
    "vit": ["model=vit-base", "trainer.per_device_train_batch_size=16", "trainer.gradient_accumulation_steps=2"],
    "swin": ["model=swin-tiny", "trainer.per_device_train_batch_size=16", "trainer.gradient_accumulation_steps=2"],
    "wide_resnet": ["model=wide-resnet50_2", "trainer.per_device_train_batch_size=16",
                    "trainer.gradient_accumulation_steps=2"],
}
TOY = ["model=toy", "trainer.per_device_train_batch_size=4", "trainer.gradient_accumulation_steps=2"]
COMMON = ["parallel=single", "trainer.max_steps=3", "trainer.disable_tqdm=true"]
# fp32 on both devices; CUDA convolutions may use TF32, so the tolerance is that of TF32, not fp32.
CPU_CUDA_RTOL = 5e-3


def _train(recipe: str, overrides, run_dir: Path, cache_dir: Path, *, device: str) -> dict:
    env = dict(os.environ, MERAK_CACHE_DIR=str(cache_dir), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run([sys.executable, str(REPO / "recipes" / recipe / "train.py"), *COMMON, *overrides,
                             f"hydra.run.dir={run_dir}"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=900, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"step"' in line]
    summary["losses"] = [s["loss"] for s in steps]
    return summary


@pytest.mark.parametrize("recipe", sorted(DEFAULTS))
@pytest.mark.parametrize("size", ["default", "toy"])
def test_recipe_trains_three_bf16_steps_on_cuda(recipe, size, tmp_path, cache_dir):
    overrides = DEFAULTS[recipe] if size == "default" else TOY
    summary = _train(recipe, [*overrides, "trainer.bf16=true"], tmp_path / "run", cache_dir, device="cuda")
    assert len(summary["losses"]) == 3 and all(math.isfinite(loss) for loss in summary["losses"])
    assert summary["precision"]["dtype"] == "bfloat16"
    assert summary["stages"][0]["peak_allocated_bytes"] > 0  # the allocator's peak: it ran on the GPU


@pytest.mark.parametrize("recipe", sorted(DEFAULTS))
def test_toy_losses_on_cuda_equal_the_cpu(recipe, tmp_path, cache_dir):
    cpu = _train(recipe, TOY, tmp_path / "cpu", cache_dir, device="cpu")
    cuda = _train(recipe, TOY, tmp_path / "cuda", cache_dir, device="cuda")
    assert "peak_allocated_bytes" not in cpu["stages"][0] and cuda["stages"][0]["peak_allocated_bytes"] > 0
    for step, (on_cpu, on_cuda) in enumerate(zip(cpu["losses"], cuda["losses"], strict=True)):
        assert on_cuda == pytest.approx(on_cpu, rel=CPU_CUDA_RTOL), f"step {step + 1}"


@pytest.mark.parametrize("recipe", sorted(DEFAULTS))
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["compiled", "cuda-graphs"])
def test_compiled_toy_tracks_eager_on_cuda(recipe, cuda_graphs, tmp_path, cache_dir):
    """trainer.torch_compile (and CUDA graph replay) trains the toy to the eager losses, every range compiled."""
    eager = _train(recipe, TOY, tmp_path / "eager", cache_dir, device="cuda")
    flags = ["trainer.torch_compile=true", *(["trainer.cuda_graphs=true"] if cuda_graphs else [])]
    compiled = _train(recipe, [*TOY, *flags], tmp_path / "compiled", cache_dir, device="cuda")
    report = compiled["compile"]
    assert report["enabled"] and report["eager_ranges"] == {} and report["compile_s"] > 0, report
    assert report["cuda_graphs"] == cuda_graphs
    for step, (want, got) in enumerate(zip(eager["losses"], compiled["losses"], strict=True)):
        assert got == pytest.approx(want, rel=CPU_CUDA_RTOL), f"step {step + 1}"
