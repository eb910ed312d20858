"""TP plans: exact resolution, every problem reported with its numbers, the seed API, meta init."""

from __future__ import annotations

import pytest
import tiny_models
import torch

from merak.core import group_registry
from merak.core.slices import TensorSlice, parameter_slices
from merak.session.assemble import assemble
from merak.shard.settings import ShardingSettings
from merak.tensor_parallel import SequenceParallelPlan, TPPlan, TPPlanError, resolve_plan, set_tp_layer_lists
from merak.tensor_parallel.options import TensorParallelSplit, option_problems
from merak.tensor_parallel.settings import TensorParallelSettings
from recipes.gpt.parallel import TP_PLAN as GPT_PLAN


@pytest.fixture(autouse=True)
def _no_leftover_groups():
    yield
    group_registry.unregister_groups()


def _gpt2():
    return tiny_models.gpt2()[0]


def test_gpt_plan_lists_exactly_the_changed_modules():
    resolved = resolve_plan(_gpt2(), GPT_PLAN, tp=2)
    by_name = {c.name: c for c in resolved.changes}
    for layer in range(3):
        assert by_name[f"transformer.h.{layer}.attn.c_attn"].kind == "column"
        assert by_name[f"transformer.h.{layer}.attn.c_attn"].detail == "3 fused blocks"
        assert by_name[f"transformer.h.{layer}.mlp.c_proj"].kind == "row"
        assert by_name[f"transformer.h.{layer}.attn"].detail == "num_heads, split_size"
    assert len(resolved.changes) == 3 * 5  # four layers and one attribute set per block
    assert "transformer.wte" not in by_name  # vocabulary rules only with parallel_vocab


def test_every_problem_is_reported_with_its_numbers():
    plan = TPPlan(styles={"transformer.h.*.attn.c_attn": "column", "transformer.h.*.attn.*": "row",
                          "no.such.*": "column"},
                  attributes={"transformer.h.*.attn": ("num_heads", "missing_attr")})
    with pytest.raises(TPPlanError) as error:
        resolve_plan(_gpt2(), plan, tp=5, parallel_vocab=True, sequence_parallel=True)
    message = str(error.value)
    assert "rule 'no.such.*' (column) matches no module" in message
    assert "module 'transformer.h.0.attn.c_attn' is matched twice (column and row)" in message
    assert "transformer.h.0.attn.c_attn output features = 96 is not divisible by tp=5" in message
    assert "transformer.h.0.attn.num_heads = 4 is not divisible by tp=5" in message
    assert "transformer.h.0.attn.missing_attr is None" in message
    assert "parallel_vocab=true but this model's TP plan has no vocabulary rules" in message
    assert "sequence_parallel=true but this model's TP plan has no sequence-parallel region" in message


def test_vocabulary_not_divisible_suggests_a_padded_size():
    with pytest.raises(TPPlanError, match=r"transformer.wte vocabulary size = 97 is not divisible by tp=2 "
                                          r"\(pad the vocabulary, e.g. to 256"):
        resolve_plan(_gpt2(), GPT_PLAN, tp=2, parallel_vocab=True)


def test_fused_blocks_must_divide_per_block():
    plan = TPPlan(styles={"transformer.h.*.attn.c_attn": "column"}, fused={"transformer.h.*.attn.c_attn": 3})
    # 96 = 3 x 32 output features: each block of 32 splits over tp=4, not over tp=64.
    resolve_plan(_gpt2(), plan, tp=4)
    with pytest.raises(TPPlanError, match="per fused block"):
        resolve_plan(_gpt2(), plan, tp=64)
    with pytest.raises(TPPlanError, match="must also be a column rule"):
        resolve_plan(_gpt2(), TPPlan(fused={"transformer.h.*.attn.c_attn": 3}), tp=2)


def test_sequence_plan_globs_must_match():
    plan = TPPlan(styles=dict(GPT_PLAN.styles), fused=dict(GPT_PLAN.fused),
                  sequence=SequenceParallelPlan(enter=("transformer.dropout",), regions=("transformer.h.*.attn",),
                                                exit=("transformer.ln_f",), sharded=("transformer.h.*",)))
    with pytest.raises(TPPlanError, match="sequence-parallel enter 'transformer.dropout' matches no module"):
        resolve_plan(_gpt2(), plan, tp=2, sequence_parallel=True)


def test_seed_lists_resolve_to_exact_modules():
    bert = tiny_models.bert()[0]
    plan = set_tp_layer_lists(col_para_list=["query", "key", "value", "intermediate.dense"],
                              row_para_list=["attention.output.dense", "layer.*.output.dense"],
                              tp_attr_list=["num_attention_heads", "all_head_size"])
    resolved = resolve_plan(bert, plan, tp=2)
    layers = resolved.layers
    assert layers["bert.encoder.layer.0.attention.self.query"] == ("column", 1)
    assert layers["bert.encoder.layer.2.output.dense"] == ("row", 1)
    assert layers["bert.encoder.layer.1.attention.output.dense"] == ("row", 1)
    assert "cls.predictions.transform.dense" not in layers  # a substring match would have caught it
    assert resolved.attributes["bert.encoder.layer.0.attention.self"] == ("num_attention_heads", "all_head_size")
    # The original's substring matching made 'output.dense' catch the attention output as well.
    ambiguous = set_tp_layer_lists(col_para_list=["query"], row_para_list=["output.dense"])
    assert ambiguous.styles == {"**.query": "column", "**.output.dense": "row"}
    with pytest.raises(ValueError, match="in both col_para_list and row_para_list"):
        set_tp_layer_lists(col_para_list=["query"], row_para_list=["query"])


def test_ratio_mapping_finds_layers_by_shape():
    plan = set_tp_layer_lists(input_output_mapping=[(1, 4, "col"), (4, 1, "row")])
    resolved = resolve_plan(_gpt2(), plan, tp=2)
    assert resolved.layers["transformer.h.0.mlp.c_fc"] == ("column", 1)
    assert resolved.layers["transformer.h.0.mlp.c_proj"] == ("row", 1)
    with pytest.raises(TPPlanError, match=r"input_output_mapping \(1, 7, 'col'\) matches no linear layer"):
        resolve_plan(_gpt2(), set_tp_layer_lists(input_output_mapping=[(1, 7, "col")]), tp=2)


def test_option_problems():
    assert option_problems(TensorParallelSplit(size=2)) == [
        "tp=2 needs a TP plan: this model has none (pass one, or describe it with merak.set_tp_layer_lists)"]
    level_3 = TensorParallelSplit(settings=TensorParallelSettings(tp_overlapping_level=3))
    assert "tp_overlapping_level=3" in option_problems(level_3)[0]
    level_1 = TensorParallelSettings(tp_overlapping_level=1)
    assert option_problems(TensorParallelSplit(plan=GPT_PLAN, size=2, settings=level_1)) == []


def test_slice_of_fused_blocks_keeps_each_ranks_heads():
    full = torch.arange(12.0)  # q = 0..3, k = 4..7, v = 8..11
    assert TensorSlice(dim=0, rank=1, size=2, parts=3).take(full).tolist() == [2, 3, 6, 7, 10, 11]


def _split_gpt2(init_device: str, tp: int, rank: int):
    example = {"input_ids": torch.zeros(2, 16, dtype=torch.long)}
    return assemble(build=_gpt2, seed=5, init_device=init_device, num_stages=1, num_microbatches=1, stage_id=0,
                    device=torch.device("cpu"), example_inputs=example,
                    sharding=ShardingSettings(split_method="layer_split", custom_split_points=["transformer.h.*"]),
                    tensor_parallel=TensorParallelSplit(plan=GPT_PLAN, size=tp, rank=rank,
                                                        settings=TensorParallelSettings(parallel_vocab=True)))


@pytest.mark.parametrize("init_device", ["cpu", "meta"])
def test_shards_start_from_slices_of_the_single_device_weights(init_device):
    plan = TPPlan(styles=dict(GPT_PLAN.styles), fused=dict(GPT_PLAN.fused), attributes=dict(GPT_PLAN.attributes),
                  vocab={"transformer.wte": "vocab", "lm_head": "column"})
    whole = dict(assemble(build=_padded_gpt2, seed=5, init_device=init_device, num_stages=1, num_microbatches=1,
                          stage_id=0, device=torch.device("cpu"),
                          example_inputs={"input_ids": torch.zeros(2, 16, dtype=torch.long)},
                          sharding=ShardingSettings()).model.named_parameters())
    for rank in range(2):
        group_registry.unregister_groups()
        built = assemble(build=_padded_gpt2, seed=5, init_device=init_device, num_stages=1, num_microbatches=1,
                         stage_id=0, device=torch.device("cpu"),
                         example_inputs={"input_ids": torch.zeros(2, 16, dtype=torch.long)},
                         sharding=ShardingSettings(),
                         tensor_parallel=TensorParallelSplit(plan=plan, size=2, rank=rank,
                                                             settings=TensorParallelSettings(parallel_vocab=True)))
        slices = parameter_slices(built.model)
        assert "transformer.h.1.attn.c_proj.weight" in slices and "lm_head.weight" in slices
        for name, param in built.model.named_parameters():
            expected = slices[name].take(whole[name]) if name in slices else whole[name]
            torch.testing.assert_close(param, expected, rtol=0, atol=0, msg=f"{init_device} rank {rank} {name}")
        assert built.model.lm_head.weight is built.model.transformer.wte.weight  # still tied, as one slice


def _padded_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    return GPT2LMHeadModel(config)
