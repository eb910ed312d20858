"""Giant-model path: build on meta, plan without weights, materialize one stage exactly."""

from __future__ import annotations

import functools

import pytest
import tiny_models
import torch
from torch import nn

from merak.session.assemble import assemble, build_model
from merak.shard.settings import ShardingSettings
from merak.trace.meta import materialize, parameters_on_meta

SEED = 11


def _gpt2():
    return tiny_models.gpt2()[0]


def _plan_stage(num_stages: int, stage_id: int, materialize_stage: bool = True):
    example = {"input_ids": torch.zeros(2, 16, dtype=torch.long)}
    return assemble(build=_gpt2, seed=SEED, init_device="meta", num_stages=num_stages, num_microbatches=2,
                    stage_id=stage_id, device=torch.device("cpu"), example_inputs=example,
                    sharding=ShardingSettings(split_method="layer_split", custom_split_points=["transformer.h.*"]),
                    materialize_stage=materialize_stage)


def test_parameters_go_to_meta_and_buffers_stay_real():
    with parameters_on_meta():
        model = tiny_models.bert()[0]
    assert all(p.device.type == "meta" for p in model.parameters())
    position_ids = model.bert.embeddings.position_ids
    assert position_ids.device.type == "cpu"
    assert torch.equal(position_ids, torch.arange(position_ids.shape[-1]).expand_as(position_ids))
    # Large factory results never touch memory while building.
    with parameters_on_meta():
        big = nn.Linear(4096, 4096)
    assert big.weight.device.type == "meta"


def test_every_stage_materializes_the_single_process_values():
    whole = _plan_stage(1, 0)
    reference = {name: p.detach().clone() for name, p in whole.model.named_parameters()}
    assert all(p.device.type == "cpu" for p in whole.model.parameters())
    # HF's own init ran: layer norms are ones, the residual projections use the scaled std.
    assert torch.equal(reference["transformer.h.0.ln_1.weight"], torch.ones(32))
    std = reference["transformer.h.1.attn.c_proj.weight"].std().item()
    assert 0.5 * 0.02 / 6**0.5 < std < 1.5 * 0.02 / 6**0.5
    seen = set()
    for stage_id in range(3):
        built = _plan_stage(3, stage_id)
        stage_params = {id(p) for p in built.stages[stage_id].parameters()}
        for name, param in built.model.named_parameters():
            if id(param) in stage_params:
                assert param.device.type == "cpu", name
                torch.testing.assert_close(param, reference[name], rtol=0, atol=0)
                seen.add(name)
            else:
                assert param.device.type == "meta", f"{name} materialized on stage {stage_id}"
        # The stage's graphs read the real tensors (runs without meta errors).
        assert all(p.device.type == "cpu" for p in built.stages[stage_id].parameters())
        # The tied LM head is the embedding, before and after materializing.
        assert built.model.lm_head.weight is built.model.transformer.wte.weight
    assert seen == set(reference)


def test_materialized_stage_runs_like_the_model():
    whole = _plan_stage(1, 0)
    ids = torch.randint(0, 97, (2, 16))
    expected = whole.model(input_ids=ids).logits
    first, last = _plan_stage(2, 0), _plan_stage(2, 1)
    boundary = first.stages[0]({"input_ids": ids})
    got = last.stages[1](boundary)["logits"]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_planning_allocates_no_weights():
    built = _plan_stage(2, 0, materialize_stage=False)
    assert built.on_meta and all(p.device.type == "meta" for p in built.model.parameters())
    assert built.plan.stage_summary(1)["num_parameters"] > 0


def test_auto_builds_small_models_for_real():
    model, on_meta = build_model(_gpt2, seed=SEED, init_device="auto")
    assert not on_meta and all(p.device.type == "cpu" for p in model.parameters())
    torch.manual_seed(SEED)
    plain = _gpt2()
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))


def test_module_without_init_is_reported():
    with parameters_on_meta():
        model = nn.Sequential(nn.Linear(3, 3), NoReset())
    with pytest.raises(TypeError, match="NoReset has parameters but no reset_parameters"):
        materialize(model, list(model.parameters()), seed=0)
    custom = functools.partial(_init_ones)
    materialize(model, list(model.parameters()), seed=0, init=custom)
    assert torch.equal(model[1].scale, torch.full((3,), 2.0))


def _init_ones(model, module):
    if isinstance(module, NoReset):
        module.scale.fill_(2.0)
    elif isinstance(module, nn.Linear):
        module.reset_parameters()
