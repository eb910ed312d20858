"""Default TP plans: merak's family plans from the model class, transformers' plans translated,
and plan_for's choice between them and the user's plan."""

from __future__ import annotations

import subprocess
import sys

import pytest
import tiny_models
import torch

from merak.core import group_registry
from merak.core.plan_sources import PlanSource, register_plan_source, unregister_plan_source
from merak.core.slices import sequence_partial
from merak.hf.family_plans import bert_plan, gpt2_plan, t5_plan
from merak.hf.tp_translation import translate_plan
from merak.session.assemble import assemble
from merak.shard.settings import ShardingSettings
from merak.tensor_parallel import MissingTPPlanError, TPPlan, TPPlanError, default_plan, plan_for, resolve_plan
from merak.tensor_parallel.options import TensorParallelSplit
from recipes.bert.parallel import TP_PLAN as BERT_RECIPE_PLAN
from recipes.gpt.parallel import TP_PLAN as GPT_RECIPE_PLAN

SIZES = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 64, "intermediate_size": 64, "max_position_embeddings": 64}
ATTENTION = "model.layers.*.self_attn"
DECODER_STYLES = {f"{ATTENTION}.q_proj": "column", f"{ATTENTION}.k_proj": "column", f"{ATTENTION}.v_proj": "column",
                  f"{ATTENTION}.o_proj": "row", "model.layers.*.mlp.gate_proj": "column",
                  "model.layers.*.mlp.up_proj": "column", "model.layers.*.mlp.down_proj": "row"}


@pytest.fixture(autouse=True)
def _no_leftover_groups():
    yield
    group_registry.unregister_groups()


def _decoder(family: str, **overrides):
    import transformers

    config_class, model_class = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                                 "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                                 "mistral": ("MistralConfig", "MistralForCausalLM"),
                                 "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
                                 "mixtral": ("MixtralConfig", "MixtralForCausalLM")}[family]
    config = getattr(transformers, config_class)(**{**SIZES, **overrides})
    return getattr(transformers, model_class)(config)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_transformers_plan_translates_to_column_and_row_layers(family):
    model = _decoder(family)
    plan = default_plan(model)
    assert dict(plan.styles) == DECODER_STYLES
    assert dict(plan.heads) == {f"{ATTENTION}.{p}": 8 for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    assert dict(plan.vocab) == {"lm_head": "column", "model.embed_tokens": "vocab"}
    assert plan.blocks == ("model.layers.*",)
    assert not plan.attributes and not plan.partial and not plan.fused and plan.sequence is None
    resolved = resolve_plan(model, plan, tp=2, parallel_vocab=True)
    assert resolved.layers["model.layers.1.self_attn.k_proj"] == ("column", 1)
    assert resolved.layers["model.layers.0.mlp.down_proj"] == ("row", 1)
    assert resolved.layers["lm_head"] == ("column", 1) and resolved.layers["model.embed_tokens"] == ("vocab", 1)
    assert len(resolved.changes) == 2 * 7 + 2


def test_every_rank_needs_whole_heads():
    model = _decoder("llama", num_key_value_heads=1)  # k_proj: 8 features, but one head
    with pytest.raises(TPPlanError, match=r"model.layers.0.self_attn.k_proj attention heads \(8 features each\) "
                                          r"= 1 is not divisible by tp=2"):
        resolve_plan(model, default_plan(model), tp=2)


def test_per_head_norms_get_partial_gradients():
    model = _decoder("qwen3", head_dim=8)
    plan = default_plan(model)
    assert plan.partial == (f"{ATTENTION}.q_norm", f"{ATTENTION}.k_norm")
    changes = {c.name: c.kind for c in resolve_plan(model, plan, tp=2).changes}
    assert changes["model.layers.1.self_attn.k_norm"] == "partial gradients"


def test_partial_gradients_survive_meta_initialization():
    build = lambda: _decoder("qwen3", head_dim=8)  # noqa: E731
    with torch.device("meta"):
        plan = plan_for(build(), None, tp=2)
    built = assemble(build=build, seed=3, init_device="meta", num_stages=1, num_microbatches=1, stage_id=0,
                     device=torch.device("cpu"), example_inputs={"input_ids": torch.zeros(2, 8, dtype=torch.long)},
                     sharding=ShardingSettings(trace_method=None),
                     tensor_parallel=TensorParallelSplit(plan=plan, size=2, rank=1))
    attention = built.model.model.layers[0].self_attn
    assert attention.q_norm.weight.device.type == "cpu" and sequence_partial(attention.q_norm.weight)
    assert not sequence_partial(attention.q_proj.weight)
    assert attention.k_proj.weight.shape == (8, 32)  # one of the two key heads


def test_styles_merak_cannot_express_are_named_with_a_module():
    with pytest.raises(TPPlanError) as error:
        default_plan(_decoder("mixtral", num_local_experts=4))
    message = str(error.value)
    assert "'model.layers.*.mlp.experts' is 'moe_tp_experts' (e.g. model.layers.0.mlp.experts)" in message
    assert "MixtralForCausalLM" in message
    with pytest.raises(TPPlanError, match=r"'model.norm' is 'sequence_parallel' \(e.g. model.norm\)"):
        translate_plan(_decoder("llama"), {"model.norm": "sequence_parallel"})


def test_whole_output_styles_keep_layers_whole():
    model = _decoder("llama", tie_word_embeddings=True)
    plan = translate_plan(model, {f"{ATTENTION}.q_proj": "colwise_gather_output", f"{ATTENTION}.o_proj":
                                  "rowwise_split_input", "model.layers.*.mlp.up_proj": "packed_colwise",
                                  "model.layers.*.mlp.down_proj": "rowwise", ATTENTION: "local_params",
                                  "lm_head": "colwise_gather_output", "no.such.layer": "colwise"})
    assert dict(plan.styles) == {"model.layers.*.mlp.up_proj": "column", "model.layers.*.mlp.down_proj": "row"}
    assert dict(plan.fused) == {"model.layers.*.mlp.up_proj": 2}
    # The head's weight is the input embedding's: both split by vocabulary.
    assert dict(plan.vocab) == {"lm_head": "column", "model.embed_tokens": "vocab"}
    assert translate_plan(model, {"lm_head": "colwise_gather_output"}) is None  # splits no layer


def test_head_count_attributes_are_divided_on_the_attention_module():
    model = tiny_models.bert()[0]
    rules = {f"bert.encoder.layer.*.attention.self.{p}": "colwise" for p in ("query", "key", "value")}
    plan = translate_plan(model, {**rules, "bert.encoder.layer.*.attention.output.dense": "rowwise"})
    assert dict(plan.attributes) == {"bert.encoder.layer.*.attention.self": ("num_attention_heads", "all_head_size")}


@pytest.mark.parametrize("model_class, base, head", [("GPT2LMHeadModel", "transformer", "lm_head"),
                                                     ("GPT2Model", "", None),
                                                     ("GPT2ForSequenceClassification", "transformer", None)])
def test_gpt2_plan_from_the_model_class(model_class, base, head):
    import transformers

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=16)
    model = getattr(transformers, model_class)(config)
    plan = default_plan(model)
    assert plan == gpt2_plan(base, head)
    resolve_plan(model, plan, tp=2, parallel_vocab=head is not None, sequence_parallel=True)


def test_recipe_families_get_the_recipes_plans():
    assert default_plan(tiny_models.gpt2()[0]) == GPT_RECIPE_PLAN
    assert default_plan(tiny_models.bert()[0]) == BERT_RECIPE_PLAN
    assert default_plan(tiny_models.t5()[0]) == t5_plan()
    for name in ("vit", "swin", "wide_resnet", "timm_vit", "timm_swin"):
        model = tiny_models.ALL[name]()[0]
        resolve_plan(model, default_plan(model), tp=2)
    assert default_plan(tiny_models.skip_net()[0]) is None


def test_other_heads_of_a_family_drop_the_missing_head():
    import transformers

    bert = transformers.BertForSequenceClassification(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=100))
    assert default_plan(bert) == bert_plan("bert", None)
    encoder = transformers.T5EncoderModel(transformers.T5Config(vocab_size=104, d_model=32, d_kv=8, d_ff=64,
                                                                num_layers=2, num_heads=4))
    resolve_plan(encoder, default_plan(encoder), tp=2)


def test_plan_for_prefers_the_users_plan():
    model = _decoder("llama")
    mine = TPPlan(styles={f"{ATTENTION}.q_proj": "column"})
    assert plan_for(model, mine, tp=2) is mine
    assert plan_for(model, TPPlan(), tp=2) == default_plan(model)  # a plan without rules is no plan
    assert plan_for(model, None, tp=1) is None
    as_dict = plan_for(model, {"model.layers.*.mlp.down_proj": "rowwise"}, tp=2)
    assert dict(as_dict.styles) == {"model.layers.*.mlp.down_proj": "row"}


def test_plan_for_without_any_plan_names_the_class():
    with pytest.raises(MissingTPPlanError, match="model class SkipNet has no tensor-parallel plan.*set_tp_layer_lists"):
        plan_for(tiny_models.skip_net()[0], None, tp=2)
    assert plan_for(tiny_models.skip_net()[0], None, tp=1) is None


def test_a_meta_model_gets_the_same_plan():
    with torch.device("meta"):
        meta = _decoder("llama")
    assert default_plan(meta) == default_plan(_decoder("llama"))


def test_plan_for_builds_a_model_init_only_when_needed():
    calls = []

    def model_init():
        calls.append(1)
        return _decoder("llama")

    mine = TPPlan(styles={f"{ATTENTION}.q_proj": "column"})
    assert plan_for(model_init, mine, tp=2) is mine and plan_for(model_init, None, tp=1) is None
    assert not calls
    plan = plan_for(model_init, None, tp=2)
    assert calls == [1] and dict(plan.styles) == DECODER_STYLES


def test_a_registered_source_gives_plans_for_models_merak_does_not_know():
    model = tiny_models.skip_net()[0]
    mine = TPPlan(styles={"no.such.layer": "column"})
    source = PlanSource(name="test source", default_plan=lambda m: mine if m is model else None)
    register_plan_source(source)
    try:
        assert default_plan(model) is mine and plan_for(model, None, tp=2) is mine
        assert default_plan(tiny_models.gpt2()[0]) == GPT_RECIPE_PLAN  # the earlier sources come first
    finally:
        unregister_plan_source(source.name)
    assert default_plan(model) is None


def test_importing_merak_registers_the_hugging_face_plans_without_importing_transformers():
    script = ("import sys, merak\n"
              "from merak.core.plan_sources import plan_sources\n"
              "print([source.name for source in plan_sources()], 'transformers' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip().splitlines()[-1] == "['Hugging Face'] False"
