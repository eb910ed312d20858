"""The graph rewrites of merak.trace.simplify and the random-operation scan, on tiny hand-written models."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx, nn

from merak.pipeline.recompute import has_random_operations
from merak.pipeline.stage import StageModule
from merak.trace.capture import capture
from merak.trace.simplify import CONSTANT_PREFIX, drop_inactive_dropout, fold_constants, use_fused_attention


class Positions(nn.Module):
    """A shape-only position table (folded), and a shape-only tensor written in place (not folded)."""

    def forward(self, x):
        positions = torch.arange(x.shape[1], device=x.device)
        buckets = torch.zeros(x.shape[1], dtype=torch.long, device=x.device)
        buckets += 1
        return x + positions + buckets


def _exported(model: nn.Module, x: torch.Tensor) -> fx.GraphModule:
    return capture(model, {"x": x}, method="dynamo").module


def _constants(module: fx.GraphModule) -> list[str]:
    return [str(n.target) for n in module.graph.nodes if n.op == "get_attr" and
            str(n.target).startswith(CONSTANT_PREFIX)]


def test_folding_keeps_shape_only_integers_and_leaves_values_written_in_place():
    x = torch.zeros(2, 5)
    module = _exported(Positions(), x)
    assert fold_constants(module) == 1
    assert len(_constants(module)) == 1
    assert torch.equal(getattr(module, _constants(module)[0]), torch.arange(5))
    assert CONSTANT_PREFIX + "0" not in module.state_dict()  # non-persistent
    for _ in range(3):  # the in-place write must not accumulate anywhere
        torch.testing.assert_close(module(x=x)[0], Positions()(x), rtol=0, atol=0)


def test_floating_point_constants_are_not_folded():
    class Scale(nn.Module):
        def forward(self, x):
            return x * torch.arange(x.shape[-1], device=x.device).float().exp()

    x = torch.zeros(3)
    module = _exported(Scale(), x)
    fold_constants(module)  # the integer arange may be folded, the float table computed from it is not
    assert all(not getattr(module, name).is_floating_point() for name in _constants(module))
    assert any(n.target is torch.ops.aten.exp.default for n in module.graph.nodes)
    torch.testing.assert_close(module(x=x)[0], Scale()(x), rtol=0, atol=0)


class Attention(nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, x):
        size = x.shape[-2]
        mask = torch.ones(size, size, dtype=torch.bool, device=x.device)
        if self.causal:
            mask = mask.tril()
        return F.scaled_dot_product_attention(x, x, x, attn_mask=mask)


def _attention_call(module: fx.GraphModule) -> fx.Node:
    return next(n for n in module.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default)


def test_constant_masks_become_fused_attention():
    x = torch.randn(2, 3, 6, 4)
    for causal in (False, True):
        module = _exported(Attention(causal), x)
        fold_constants(module)
        assert use_fused_attention(module) == 1
        call = _attention_call(module)
        assert len(call.args) == 3 and "attn_mask" not in call.kwargs
        assert call.kwargs.get("is_causal", False) is causal
        torch.testing.assert_close(module(x=x)[0], Attention(causal)(x), rtol=1e-6, atol=1e-6)


def test_other_masks_stay():
    class Banded(nn.Module):
        def forward(self, x):
            size = x.shape[-2]
            return F.scaled_dot_product_attention(
                x, x, x, attn_mask=torch.ones(size, size, dtype=torch.bool, device=x.device).triu(-1).tril(1))

    module = _exported(Banded(), torch.randn(1, 1, 5, 4))
    fold_constants(module)
    assert use_fused_attention(module) == 0


def _traced_stage(body: nn.Module) -> StageModule:
    return StageModule([fx.symbolic_trace(body)])


def test_random_operations_are_found_and_zero_dropout_is_not_one():
    class Functional(nn.Module):
        def __init__(self, p: float) -> None:
            super().__init__()
            self.p = p

        def forward(self, x):
            return F.dropout(x, self.p, training=True)

    class RandLike(nn.Module):
        def forward(self, x):
            return x + torch.rand_like(x)

    assert not has_random_operations(_traced_stage(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.0))))
    assert has_random_operations(_traced_stage(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1))))
    assert not has_random_operations(_traced_stage(Functional(0.0)))
    assert has_random_operations(_traced_stage(Functional(0.2)))
    assert has_random_operations(_traced_stage(RandLike()))
    assert has_random_operations(nn.Linear(2, 2))  # not made of captured parts: assumed to draw


def test_zero_dropout_nodes_are_removed():
    class Body(nn.Module):
        def forward(self, x):
            return F.dropout(x, 0.0, training=True) * 2

    module = fx.symbolic_trace(Body())
    assert drop_inactive_dropout(module) == 1
    assert not any("dropout" in str(n.target) for n in module.graph.nodes)
    assert torch.equal(module(torch.ones(3)), torch.full((3,), 2.0))


def test_gpt_stages_send_the_hidden_state_alone(toy_model_cfg):
    """Causal masks and position ids are folded into each stage: at block boundaries a GPT stage sends
    its hidden state, mbs x S x H floats, and nothing else; no plan sends a mask."""
    import functools

    from merak.session.assemble import assemble
    from merak.shard.plan import ShardingSettings
    from recipes.gpt import model, parallel

    micro_batch, cfg = 2, toy_model_cfg
    hidden = f"float32[{micro_batch}, {cfg.seq_length}, {cfg.hidden_size}]"
    for options, pp in ((ShardingSettings(split_method="layer_split",
                                          custom_split_points=list(parallel.SPLIT_POINTS)), 4),
                        (ShardingSettings(), 3)):
        built = assemble(build=functools.partial(model.build_model, cfg), seed=0, init_device="cpu",
                         sharding=options, num_stages=pp, num_microbatches=2, stage_id=0,
                         device=torch.device("cpu"), example_inputs=parallel.example_inputs(cfg, micro_batch),
                         materialize_stage=False)
        summaries = [built.plan.stage_summary(s) for s in range(pp - 1)]
        assert all("bool" not in sent and "int64" not in sent for s in summaries for sent in s["sends"].values())
        if options.split_method == "layer_split":
            for summary in summaries:
                assert list(summary["sends"].values()) == [hidden], summary["sends"]
                assert summary["send_bytes"] == 4 * micro_batch * cfg.seq_length * cfg.hidden_size
