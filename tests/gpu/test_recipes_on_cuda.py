"""Every recipe on one CUDA device, each case checking numbers against a reference that does not run
through merak's engine:

* its default model and its toy train 3 bf16 steps, and the first step's loss equals the plain PyTorch
  loop's (``bench/recipe_loops.PlainLoop``: the recipe's ``build_model``, the same seed and samples, under
  ``torch.autocast(bfloat16)``) within bf16 tolerance; the later losses are finite;
* the toys' fp32 losses on CUDA equal the CPU's, all three steps;
* compiled toys (``trainer.torch_compile``, also with CUDA graphs) track the eager ones.

Skipped where there is no CUDA device; their CPU proxy is tests/unit/test_device_agnostic_capture.py
(capture on the CPU, run on meta). ``bench/gpu_check.py`` runs this module in parallel workers with
timeouts that fit its budget; by hand: ``python -m pytest -q -m gpu tests/gpu``.
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
# recipe -> its default model (the one gpu_single.py measures), with a batch that fits one GPU. Dropout
# and stochastic depth are off: the plain loop would draw other masks than merak's reseeded parts.
DEFAULTS = {
    "gpt": ["model=gpt2", "model.dropout=0.0", "trainer.per_device_train_batch_size=8",
            "trainer.gradient_accumulation_steps=2"],
    "bert": ["model=bert-base-uncased", "model.dropout=0.0", "trainer.per_device_train_batch_size=8",
             "trainer.gradient_accumulation_steps=2"],
    "t5": ["model=t5-base", "model.dropout=0.0", "trainer.per_device_train_batch_size=8",
           "trainer.gradient_accumulation_steps=2"],
    "vit": ["model=vit-base", "trainer.per_device_train_batch_size=16", "trainer.gradient_accumulation_steps=2"],
    "swin": ["model=swin-tiny", "model.drop_path=0.0", "trainer.per_device_train_batch_size=16",
             "trainer.gradient_accumulation_steps=2"],
    "wide_resnet": ["model=wide-resnet50_2", "trainer.per_device_train_batch_size=16",
                    "trainer.gradient_accumulation_steps=2"],
}
TOY = ["model=toy", "trainer.per_device_train_batch_size=4", "trainer.gradient_accumulation_steps=2"]
COMMON = ["parallel=single", "trainer.max_steps=3", "trainer.disable_tqdm=true"]
# fp32 on both devices; CUDA convolutions may use TF32, so the tolerance is that of TF32, not fp32.
CPU_CUDA_RTOL = 5e-3
# merak keeps bf16 weights (fp32 masters), the plain loop fp32 weights under autocast: the same
# forward up to bf16 rounding (8 bits of mantissa), which averages out over a loss's many terms.
BF16_RTOL = 2e-2
# One training subprocess: imports, capture and 3 steps (compiled: inductor too). bench/gpu_check.py
# gives each test case 300 s (pytest-timeout), which holds the two runs of the longest case.
TRAIN_TIMEOUT_S = int(os.environ.get("MERAK_GPU_TRAIN_TIMEOUT_S", "240"))


def _train(recipe: str, overrides, run_dir: Path, cache_dir: Path, *, device: str) -> dict:
    env = dict(os.environ, MERAK_CACHE_DIR=str(cache_dir), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run([sys.executable, str(REPO / "recipes" / recipe / "train.py"), *COMMON, *overrides,
                             f"hydra.run.dir={run_dir}"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=TRAIN_TIMEOUT_S, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"step"' in line]
    summary["losses"] = [s["loss"] for s in steps]
    return summary


def _plain_first_loss(recipe: str, overrides) -> float:
    """The first step's loss of the plain bf16 loop over the recipe's model (no merak engine)."""
    sys.path.insert(0, str(REPO / "bench"))
    from recipe_loops import PlainLoop

    loop = PlainLoop(recipe, list(overrides), device="cuda", dtype=torch.bfloat16)
    try:
        loop.run(1)
        return loop.losses[0]
    finally:
        del loop
        torch.cuda.empty_cache()


@pytest.mark.parametrize("recipe", sorted(DEFAULTS))
@pytest.mark.parametrize("size", ["default", "toy"])
def test_recipe_trains_three_bf16_steps_on_cuda(recipe, size, tmp_path, cache_dir):
    overrides = DEFAULTS[recipe] if size == "default" else TOY
    summary = _train(recipe, [*overrides, "trainer.bf16=true"], tmp_path / "run", cache_dir, device="cuda")
    losses = summary["losses"]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses), losses
    assert summary["precision"]["dtype"] == "bfloat16"
    assert summary["stages"][0]["peak_allocated_bytes"] > 0  # the allocator's peak: it ran on the GPU
    assert losses[0] == pytest.approx(_plain_first_loss(recipe, overrides), rel=BF16_RTOL)


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
    # CUDA graphs run without recomputation (refused before launch: it failed on an H200, docs/gpu.md).
    flags = ["trainer.torch_compile=true",
             *(["trainer.cuda_graphs=true", "trainer.activation_checkpointing=false"] if cuda_graphs else [])]
    compiled = _train(recipe, [*TOY, *flags], tmp_path / "compiled", cache_dir, device="cuda")
    report = compiled["compile"]
    assert report["enabled"] and report["eager_ranges"] == {} and report["compile_s"] > 0, report
    assert report["cuda_graphs"] == cuda_graphs
    for step, (want, got) in enumerate(zip(eager["losses"], compiled["losses"], strict=True)):
        assert got == pytest.approx(want, rel=CPU_CUDA_RTOL), f"step {step + 1}"
