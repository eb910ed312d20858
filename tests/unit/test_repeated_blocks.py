"""Exporting three blocks of a stack and repeating the last gives the graph a whole export gives."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch import fx, nn

from merak.trace.capture import _capture_export
from merak.trace.repeat import capture_with_repeats, repeated_stack


def _gpt(layers: int = 5):
    from recipes.gpt.model import build_model

    cfg = OmegaConf.create({"name": "t", "vocab_size": 300, "seq_length": 16, "hidden_size": 32,
                            "num_layers": layers, "num_heads": 4, "dropout": 0.0})
    torch.manual_seed(0)
    model = build_model(cfg).train()
    model.config.use_cache = False  # as merak.trace.capture exports (no KV cache in the output)
    return model, {"input_ids": torch.randint(0, 300, (2, 16))}


def _bert(layers: int = 5):
    from recipes.bert.model import build_model

    cfg = OmegaConf.create({"name": "t", "vocab_size": 300, "seq_length": 16, "hidden_size": 32,
                            "num_layers": layers, "num_heads": 4, "ffn_size": 64, "dropout": 0.0})
    torch.manual_seed(0)
    model = build_model(cfg).train()
    model.config.use_cache = False  # as merak.trace.capture exports (no KV cache in the output)
    return model, {"input_ids": torch.randint(0, 300, (2, 16))}


def _ops(module) -> list:
    return [(n.op, str(n.target) if n.op != "get_attr" else n.target) for n in module.graph.nodes]


@pytest.mark.parametrize("make", [_gpt, _bert], ids=["gpt2", "bert"])
def test_repeated_export_matches_a_whole_export(make):
    model, inputs = make()
    whole, whole_spec = _capture_export(model, inputs)
    repeated = capture_with_repeats(model, lambda m: _capture_export(m, inputs), min_blocks=4)
    assert repeated is not None, "the blocks should repeat"
    module, spec, note = repeated
    assert "repeated" in note and spec == whole_spec
    assert sorted(_ops(module)) == sorted(_ops(whole))
    whole_calls = [n.target for n in whole.graph.nodes if n.op == "call_function"]
    assert [n.target for n in module.graph.nodes if n.op == "call_function"] == whole_calls
    # The same numbers forward and backward, reading the model's own parameters.
    outputs = []
    for graph in (whole, module):
        model.zero_grad()
        out = fx.GraphModule(graph, graph.graph)(*inputs.values())  # plain calls, as shards are
        logits = out[0] if isinstance(out, (tuple, list)) else out
        logits.float().pow(2).mean().backward()
        outputs.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(outputs[0][0], outputs[1][0], rtol=0, atol=0)
    for a, b in zip(outputs[0][1], outputs[1][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_every_block_reads_its_own_parameters_and_module_names():
    model, inputs = _gpt(layers=6)
    module, _, _ = capture_with_repeats(model, lambda m: _capture_export(m, inputs), min_blocks=4)
    read = {str(n.target) for n in module.graph.nodes if n.op == "get_attr"}
    assert read >= {name for name, _ in model.named_parameters()} - {"lm_head.weight"}
    scopes = {value[0] for n in module.graph.nodes for value in (n.meta.get("nn_module_stack") or {}).values()}
    assert {f"transformer.h.{i}" for i in range(6)} <= scopes


class ScaledBlock(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.scale = 1.0 / (index + 1)  # a per-layer constant: block 2 is not block 1 shifted

    def forward(self, x):
        return x + self.linear(x) * self.scale


class Scaled(nn.Module):
    def __init__(self, depth: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ScaledBlock(i) for i in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_blocks_that_differ_are_exported_whole():
    model = Scaled()
    assert repeated_stack(model) is not None
    assert capture_with_repeats(model, lambda m: _capture_export(m, {"x": torch.randn(2, 4)})) is None


def test_short_stacks_are_left_alone():
    model, _ = _gpt(layers=4)
    assert repeated_stack(model) is None  # fewer than MIN_BLOCKS
