"""The llama recipe (made with `merak new-recipe llama --from gpt`) through its real train.py.

Its tensor-parallel plan is transformers' own (LlamaForCausalLM.tp_plan), translated by merak:
tp2 and tp2 x pp2 train to the single-process losses; layouts the model cannot take stop before
any worker starts, naming the setting to change.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from train_py import read_metrics, run_train_py

pytestmark = pytest.mark.recipe

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "recipes/llama/train.py"
TOY = ["model=toy", "trainer.per_device_train_batch_size=2", "trainer.gradient_accumulation_steps=4"]


def _train(args, cache_dir, timeout=240):
    return run_train_py([*TOY, *args], cache_dir, script=TRAIN, timeout=timeout)


def test_plan_is_transformers_own_translated():
    from transformers import LlamaForCausalLM

    from merak.hf.tp_translation import transformers_rules, translate_plan
    from recipes.llama.model import build_model
    from recipes.llama.spec import SPEC

    model_cfg = OmegaConf.load(REPO / "recipes/llama/conf/model/toy.yaml")
    with torch.device("meta"):
        model = build_model(model_cfg)
    assert isinstance(model, LlamaForCausalLM)
    rules = transformers_rules(model)
    assert rules["model.layers.*.self_attn.q_proj"] == "colwise" and rules["lm_head"] == "colwise_gather_output"
    plan = SPEC.tensor_parallel_plan(model_cfg)
    assert plan == translate_plan(model, rules)
    assert plan.sequence is None  # hence the recipe keeps trainer.sequence_parallel false


@pytest.mark.timeout(300)
def test_tensor_and_pipeline_parallel_match_one_process(tmp_path, cache_dir, monkeypatch):
    """Same global batch, dropout 0: tp2 and tp2 x pp2 print the single-process loss curve."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # run_train_py passes this environment on
    losses = {}
    for layout in ("single", "tp2", "tp2_pp2"):
        run_dir = tmp_path / layout
        result = _train([f"parallel={layout}", "trainer.max_steps=3", f"hydra.run.dir={run_dir}"], cache_dir)
        assert result.returncode == 0, result.stderr[-3000:]
        losses[layout] = [m["loss"] for m in read_metrics(run_dir)]
        if layout != "single":
            assert "tensor-parallel plan of LlamaForCausalLM: transformers' plan" in result.stdout + result.stderr
    assert len(losses["single"]) == 3
    assert losses["tp2"] == pytest.approx(losses["single"], rel=1e-6)
    assert losses["tp2_pp2"] == pytest.approx(losses["single"], rel=1e-6)


def _error(result) -> str:
    assert result.returncode == 2, (result.stdout + result.stderr)[-3000:]
    return result.stdout + result.stderr


@pytest.mark.timeout(200)
def test_layouts_the_model_cannot_take_name_the_fix(tmp_path, cache_dir):
    """Each bad combination stops before any worker starts and says what to set."""
    run_dir = f"hydra.run.dir={tmp_path / 'run'}"
    printed = _error(_train(["parallel.tp=4", "parallel.pp=1", run_dir], cache_dir))
    assert "model.num_kv_heads=2 is not divisible by parallel.tp=4: use parallel.tp=1 or 2" in printed
    printed = _error(_train(["parallel=single", "model.vocab_size=1000", run_dir], cache_dir))
    assert ("model.vocab_size=1000 is smaller than the vocabulary of data.tokenizer=gpt2 (50257 tokens): "
            "set model.vocab_size=50257") in printed
    printed = _error(_train(["parallel=tp2", "trainer.parallel_vocab=true", run_dir], cache_dir))
    assert "pad the vocabulary, e.g. to 50432, or turn parallel_vocab off" in printed
    assert "Traceback" not in printed


@pytest.mark.timeout(120)
def test_sequence_parallel_names_the_setting_to_change(tmp_path, cache_dir):
    """transformers' plan has no sequence-parallel region: the run stops and says to turn the setting off."""
    printed = _error(_train(["parallel=tp2", "trainer.sequence_parallel=true", f"hydra.run.dir={tmp_path}"],
                            cache_dir))
    assert "sequence_parallel=true but this model's TP plan has no sequence-parallel region" in printed
    assert "trainer.sequence_parallel=false" in printed
