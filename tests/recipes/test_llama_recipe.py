"""The llama recipe (made with `merak new-recipe llama --from gpt`): one run through its real train.py, the rest
in this process.

Its tensor-parallel plan is transformers' own (LlamaForCausalLM.tp_plan), translated by merak:
tp2 and tp2 x pp2 train to the single-process losses; layouts the model cannot take stop before
any worker starts, naming the setting to change.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from train_py import read_metrics, run_in_process, run_train_py

from merak.config import ConfigError

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
    """Same global batch, dropout 0: tp2 x pp2, through the real train.py (the one CPU run of that script),
    prints the single-process loss curve (run in this process). tp2 and tp2 x pp2 against a plain PyTorch
    loop: tests/dist/test_hf_tensor_parallel.py (llama, llama-pp2-vocab)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # run_train_py passes this environment on
    run_in_process("llama", [*TOY, "parallel=single", "trainer.max_steps=2"], tmp_path / "single")
    result = _train(["parallel=tp2_pp2", "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'tp2_pp2'}"], cache_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tensor-parallel plan of LlamaForCausalLM: transformers' plan" in result.stdout + result.stderr
    losses = {layout: [m["loss"] for m in read_metrics(tmp_path / layout)] for layout in ("single", "tp2_pp2")}
    assert len(losses["single"]) == 2
    assert losses["tp2_pp2"] == pytest.approx(losses["single"], rel=1e-6)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overrides,expected", [
    (["parallel.tp=4", "parallel.pp=1"],
     ["model.num_kv_heads=2 is not divisible by parallel.tp=4: use parallel.tp=1 or 2"]),
    (["parallel=single", "model.vocab_size=1000"],
     ["model.vocab_size=1000 is smaller than the vocabulary of data.tokenizer=gpt2 (50257 tokens): "
      "set model.vocab_size=50257"]),
    (["parallel=tp2", "trainer.parallel_vocab=true"],
     ["pad the vocabulary, e.g. to 50432, or turn parallel_vocab off"]),
    # transformers' plan has no sequence-parallel region: the run stops and says to turn the setting off.
    (["parallel=tp2", "trainer.sequence_parallel=true"],
     ["sequence_parallel=true but this model's TP plan has no sequence-parallel region",
      "trainer.sequence_parallel=false"]),
])
def test_layouts_the_model_cannot_take_name_the_fix(overrides, expected, tmp_path, cache_dir):
    """Each bad combination stops before any worker starts (merak.run raises ConfigError in this process) and
    says what to set (train.py's exit status 2 and one-line message: tests/recipes/test_console.py)."""
    with pytest.raises(ConfigError) as error:
        run_in_process("llama", [*TOY, *overrides], tmp_path)
    assert all(fragment in str(error.value) for fragment in expected), str(error.value)
    assert not (tmp_path / "metrics.jsonl").exists()
