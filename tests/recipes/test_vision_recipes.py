"""The vision recipes (vit, swin, wide_resnet): training runs, dry runs, data, loss, config errors.

Each recipe's toy trains once through its real train.py (the one CPU run of that script); everything else
runs in this process (merak.run, tests/recipes/train_py.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from train_py import compose_recipe, read_metrics, run_in_process, run_train_py

from merak.config import ConfigError

pytestmark = pytest.mark.recipe

REPO = Path(__file__).resolve().parents[2]
SMALL = ["trainer.per_device_train_batch_size=2", "trainer.gradient_accumulation_steps=2"]
STEPS = 2


def _compose(recipe: str, overrides):
    return compose_recipe(recipe, overrides)


def _spec(recipe: str):
    import importlib

    return importlib.import_module(f"recipes.{recipe}.spec").SPEC


# --- training runs: every toy model trains under tp=2 x pp=2 ----------------------------------------------

def _check_tp2_pp2_run(recipe: str, model: str, run_dir: Path) -> None:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["recipe"] == recipe and summary["model"] == model
    assert summary["layout"] == {"dp": 1, "tp": 2, "pp": 2}
    assert summary["steps"] == STEPS and summary["global_batch_size"] == 4
    assert [s["stage"] for s in summary["stages"]] == [0, 1]
    assert all(s["num_parameters"] > 0 for s in summary["stages"])
    losses = [m["loss"] for m in read_metrics(run_dir)]
    assert len(losses) == STEPS and all(math.isfinite(loss) for loss in losses)
    assert math.isfinite(summary["first_loss"]) and math.isfinite(summary["final_loss"])
    # Throughput counts images: one "token" per sample.
    assert summary["tokens_per_s"] == pytest.approx(summary["samples_per_s"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("recipe", ["vit", "swin", "wide_resnet"])
def test_train_py_toy_trains_with_two_stages_and_its_tp_plan(recipe, tmp_path, cache_dir):
    """The recipe's real train.py (its only CPU run in the suite): the toy model at tp=2 x pp=2."""
    run_dir = tmp_path / "run"
    result = run_train_py(["model=toy", "parallel=tp2_pp2", *SMALL, f"trainer.max_steps={STEPS}",
                           f"hydra.run.dir={run_dir}"], cache_dir, script=REPO / "recipes" / recipe / "train.py")
    assert result.returncode == 0, result.stderr[-3000:]
    _check_tp2_pp2_run(recipe, "toy", run_dir)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("recipe", ["vit", "swin"])
def test_timm_toy_trains_with_two_stages_and_its_tp_plan(recipe, tmp_path, cache_dir):
    """The timm models (their own TP plan, samples keyed "x"), in this process at tp=2 x pp=2."""
    run_in_process(recipe, ["model=timm-toy", "parallel=tp2_pp2", *SMALL, f"trainer.max_steps={STEPS}"], tmp_path)
    _check_tp2_pp2_run(recipe, "timm-toy", tmp_path)


@pytest.mark.timeout(180)
def test_wide_resnet_dry_run_three_stages(tmp_path, cache_dir):
    run_in_process("wide_resnet", ["dry_run=true", "parallel.pp=3"], tmp_path)
    report = json.loads((tmp_path / "partition.json").read_text())
    assert report["recipe"] == "wide_resnet" and report["layout"]["pp"] == 3
    assert [s["stage"] for s in report["stages"]] == [0, 1, 2]
    assert len(report["boundaries"]) == 4 and report["trace_method"] == "fx"
    assert not (tmp_path / "metrics.jsonl").exists()


# --- in process: layer_split finds every model's blocks (split_points match the module names) ----------

@pytest.mark.timeout(180)
@pytest.mark.parametrize("recipe,model,blocks", [
    ("vit", "toy", 4), ("vit", "timm-toy", 4), ("swin", "toy", 4), ("swin", "timm-toy", 4),
    ("wide_resnet", "toy", 4),
])
def test_layer_split_cuts_before_every_block(recipe, model, blocks, tmp_path, cache_dir):
    report = run_in_process(recipe, [f"model={model}", "dry_run=true", "parallel.pp=2",
                                     "trainer.split_method=layer_split"], tmp_path)
    assert report["split_method"] == "layer_split"
    assert report["num_shards"] == blocks + 1  # the stem, then one shard per block (the head joins the last)
    assert len(report["stages"]) == 2
    assert (tmp_path / "partition.json").exists()


@pytest.mark.parametrize("recipe,model,names", [
    ("vit", "toy", ["vit.layers.0", "vit.layers.3"]),
    ("vit", "timm-toy", ["blocks.0", "blocks.3"]),
    ("swin", "toy", ["swin.encoder.layers.0.blocks.0", "swin.encoder.layers.2.blocks.1"]),
    ("swin", "timm-toy", ["layers.0.blocks.0", "layers.2.blocks.1"]),
    ("wide_resnet", "toy", ["layer1.0", "layer4.0"]),
])
def test_split_points_name_real_modules(recipe, model, names):
    from merak.core.names import module_pattern

    cfg = _compose(recipe, [f"model={model}"])
    built = _spec(recipe).build_model(cfg.model)
    modules = [name for name, _ in built.named_modules()]
    patterns = [module_pattern(p) for p in cfg.trainer.custom_split_points]
    matched = [name for name in modules if any(p.fullmatch(name) for p in patterns)]
    assert names[0] == matched[0] and names[-1] == matched[-1]
    if cfg.model.source == "hf":  # the recipe's own default points are the Hugging Face ones
        assert tuple(cfg.model.split_points) == _spec(recipe).split_points


# --- data and loss ------------------------------------------------------------------------------------

def _cfg(**values):
    from omegaconf import OmegaConf

    return OmegaConf.create(values)


SYNTHETIC = {"source": "synthetic", "num_samples": 64, "seed": 3, "noise": 1.0, "path": None}


@pytest.mark.parametrize("source,key", [("hf", "pixel_values"), ("timm", "x"), ("torchvision", "x")])
def test_synthetic_images_are_deterministic(source, key):
    from recipes.vision import data

    model_cfg = _cfg(source=source, image_size=16, num_classes=5)
    prepared = data.prepare(_cfg(**SYNTHETIC), model_cfg)
    first, second = data.load(prepared, model_cfg), data.load(prepared, model_cfg)
    assert len(first) == 64
    sample = first[7]
    assert set(sample) == {key, "labels"}
    assert sample[key].shape == (3, 16, 16) and sample[key].dtype == torch.float32
    assert sample["labels"].dtype == torch.int64 and 0 <= int(sample["labels"]) < 5
    assert torch.equal(sample[key], second[7][key]) and int(sample["labels"]) == int(second[7]["labels"])
    other = data.load(data.prepare(_cfg(**{**SYNTHETIC, "seed": 4}), model_cfg), model_cfg)
    assert not torch.equal(sample[key], other[7][key])
    assert set(data.example_inputs(model_cfg, 3)) == {key}
    assert data.example_inputs(model_cfg, 3)[key].shape == (3, 3, 16, 16)
    with pytest.raises(IndexError):
        first[64]


def test_synthetic_classes_are_separable():
    """The class means differ: the nearest class pattern predicts the label far above chance."""
    from recipes.vision import data

    model_cfg = _cfg(source="hf", image_size=16, num_classes=10)
    dataset = data.load(data.prepare(_cfg(**{**SYNTHETIC, "num_samples": 200}), model_cfg), model_cfg)
    patterns = torch.stack([dataset.pattern(c) for c in range(10)]).flatten(1)
    hits = 0
    for i in range(len(dataset)):
        sample = dataset[i]
        distances = (patterns - sample["pixel_values"].flatten()).pow(2).sum(1)
        hits += int(distances.argmin()) == int(sample["labels"])
    assert hits / len(dataset) > 0.9
    assert len({int(dataset[i]["labels"]) for i in range(len(dataset))}) == 10


def test_folder_images(tmp_path):
    from PIL import Image

    from recipes.vision import data

    for label, color in enumerate([(255, 0, 0), (0, 0, 255)]):
        (tmp_path / f"class{label}").mkdir()
        for i in range(3):
            Image.new("RGB", (40, 30), color).save(tmp_path / f"class{label}" / f"{i}.png")
    model_cfg = _cfg(source="timm", image_size=24, num_classes=2)
    data_cfg = _cfg(source="folder", path=str(tmp_path))
    assert data.check_data(data_cfg) == []
    dataset = data.load(data.prepare(data_cfg, model_cfg), model_cfg)
    assert len(dataset) == 6
    sample = dataset[4]
    assert sample["x"].shape == (3, 24, 24) and int(sample["labels"]) == 1
    with pytest.raises(ValueError, match="has 2 classes but model.num_classes=1"):
        data.prepare(data_cfg, _cfg(source="timm", image_size=24, num_classes=1))


def test_check_data_reports_problems(tmp_path):
    from recipes.vision import data

    assert data.check_data(_cfg(**SYNTHETIC)) == []
    assert "needs data.path" in data.check_data(_cfg(source="folder", path=None))[0]
    assert data.check_data(_cfg(source="folder", path="/nonexistent/images")) == [
        "data folder not found: /nonexistent/images (data.path)"]
    assert "no class subfolders" in data.check_data(_cfg(source="folder", path=str(tmp_path)))[0]
    assert "unknown data.source='imagenet'" in data.check_data(_cfg(source="imagenet"))[0]


def test_loss_takes_tensors_and_model_outputs():
    from transformers.modeling_outputs import ImageClassifierOutput

    from recipes.vision.loss import cross_entropy_loss

    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0]])
    batch = {"labels": torch.tensor([0, 1])}
    expected = torch.nn.functional.cross_entropy(logits, batch["labels"])
    assert cross_entropy_loss(logits, batch) == pytest.approx(float(expected))
    assert cross_entropy_loss(ImageClassifierOutput(logits=logits), batch) == pytest.approx(float(expected))
    assert cross_entropy_loss({"logits": logits}, batch) == pytest.approx(float(expected))


# --- layout checks ------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe,overrides,expected", [
    ("vit", ["model.num_heads=3"], "model.hidden_size=64 is not divisible by model.num_heads=3"),
    ("vit", ["model.patch_size=5"], "model.image_size=32 is not divisible by model.patch_size=5"),
    ("vit", ["model.source=keras"], "model.source='keras' is unknown"),
    ("swin", ["model.depths=[1,1,2,1]", "model.num_heads=[2,4,8,16]"],
     "stage 3: the 2x2 token grid"),
    ("swin", ["model.num_heads=[2,4]"], "differ in length"),
    ("wide_resnet", ["model.layers=[1,1]"], "model.layers=[1, 1] must be 4 positive block counts"),
    ("wide_resnet", ["model.image_size=16"], "model.image_size=16 is below 32"),
])
def test_check_layout(recipe, overrides, expected):
    cfg = _compose(recipe, overrides)
    problems = _spec(recipe).check_layout(cfg.model, 1, 1, 2)
    assert any(expected in problem for problem in problems), problems


def test_shipped_models_fit_their_layouts():
    for recipe in ("vit", "swin", "wide_resnet"):
        for path in sorted((REPO / "recipes" / recipe / "conf" / "model").glob("*.yaml")):
            cfg = _compose(recipe, [f"model={path.stem}"])
            assert _spec(recipe).check_layout(cfg.model, 1, 1, 4) == [], (recipe, path.stem)


@pytest.mark.timeout(60)
def test_missing_image_folder_fails_before_workers_start(tmp_path, cache_dir):
    """merak.run raises ConfigError before any worker exists (train.py's exit status and one-line message
    for such an error: tests/recipes/test_console.py)."""
    with pytest.raises(ConfigError) as error:
        run_in_process("vit", ["data=folder", "data.path=/nonexistent/images"], tmp_path)
    assert "data folder not found: /nonexistent/images (data.path)" in str(error.value)
    assert not (tmp_path / "metrics.jsonl").exists()
