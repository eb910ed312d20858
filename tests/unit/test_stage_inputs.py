"""A stage receives its inputs as leaves that require grad: a stage boundary anywhere, even right before an
in-place write (ResNet's ``relu(inplace=True)`` after the residual add), runs and gives the model's gradients."""

from __future__ import annotations

import operator

import pytest
import tiny_models
import torch
from torch import fx, nn

from merak.shard.build import shard_modules
from merak.shard.graph import GraphUnits
from merak.trace.capture import capture
from merak.trace.mutation import copy_inputs_written_in_place, is_written_in_place, written_arguments


class InPlaceNet(nn.Module):
    """Every kind of in-place write fx records, each on a value a stage boundary may deliver."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 6)
        self.second = nn.Linear(6, 6)
        self.relu = nn.ReLU(inplace=True)
        self.head = nn.Linear(6, 3)

    def forward(self, features):
        hidden = self.first(features)
        hidden = hidden + features          # residual add, then an in-place module
        hidden = self.relu(hidden)
        hidden = self.second(hidden)
        hidden += 1.0                       # fx records a plain add
        hidden.mul_(0.5)                    # in-place method
        wide = hidden.view(-1, 2, 3)
        wide.add_(0.25)                     # written through a view
        hidden = nn.functional.relu(hidden, inplace=True)
        return self.head(hidden)


def _in_place_net():
    torch.manual_seed(0)
    return (InPlaceNet(), {"features": torch.randn(4, 6), "labels": torch.randint(0, 3, (4,))},
            tiny_models.class_loss)


MODELS = {**tiny_models.ALL, "in_place_net": _in_place_net}
# Models whose graphs write in place: every cut position is tried; elsewhere an even sample.
EVERY_CUT = {"wide_resnet", "in_place_net"}
SAMPLED_CUTS = 12


def _as_received(payload: dict) -> dict:
    """What the next stage's receive yields: fresh leaves, floating ones requiring grad."""
    return {k: v.detach().clone().requires_grad_(v.is_floating_point()) if isinstance(v, torch.Tensor) else v
            for k, v in payload.items()}


def _gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _cut_positions(name: str, count: int) -> list[int]:
    positions = list(range(1, count))
    if name in EVERY_CUT or len(positions) <= SAMPLED_CUTS:
        return positions
    step = len(positions) / SAMPLED_CUTS
    return sorted({positions[int(i * step)] for i in range(SAMPLED_CUTS)})


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_cut_runs_as_two_stages_with_the_models_gradients(name):
    torch.manual_seed(0)
    model, batch, loss_fn = MODELS[name]()
    model.train()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    units = GraphUnits(capture(model, inputs))

    torch.manual_seed(1)
    loss_fn(model(**inputs), batch).backward()
    expected = _gradients(model)

    for cut in _cut_positions(name, len(units)):
        first, second = shard_modules(units, [cut])
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        sent = first(dict(inputs))
        received = _as_received(sent)
        loss_fn(second(received), batch).backward()
        pairs = [(sent[k], received[k].grad) for k in sent
                 if isinstance(sent[k], torch.Tensor) and sent[k].requires_grad and received[k].grad is not None]
        if pairs:
            torch.autograd.backward([value for value, _ in pairs], [grad for _, grad in pairs])
        got = _gradients(model)
        assert got.keys() == expected.keys(), f"cut {cut}"
        for key, want in expected.items():
            torch.testing.assert_close(got[key], want, rtol=1e-5, atol=1e-6, msg=f"{name} cut {cut}: {key}")


def _traced(module: nn.Module) -> fx.GraphModule:
    return fx.symbolic_trace(module)


def test_written_arguments_know_every_kind_of_in_place_write():
    graph = _traced(InPlaceNet()).graph
    written = {node.name: [arg.name for arg in written_arguments(node)] for node in graph.nodes
               if written_arguments(node)}
    assert written == {"relu": ["add"], "mul_": ["add_1"], "add_": ["view"], "relu_1": ["add_1"]}, written
    aten_graph = fx.Graph()
    value = aten_graph.placeholder("value")
    aten_graph.call_function(torch.ops.aten.relu_.default, (value,))
    functional = aten_graph.call_function(torch.ops.aten.relu.default, (value,))
    assert [written_arguments(n) for n in aten_graph.nodes][1] == [value]
    assert written_arguments(functional) == []
    for target in (operator.setitem, operator.iadd):
        call = aten_graph.call_function(target, (functional, 0, 1.0) if target is operator.setitem else (functional, 1))
        assert written_arguments(call) == [functional]


def test_only_inputs_written_in_place_are_copied():
    class ReadsOne(nn.Module):
        def forward(self, kept, written):
            written.view(-1).add_(kept.sum())
            return kept * 2 + written

    module = _traced(ReadsOne())
    kept, written = [n for n in module.graph.nodes if n.op == "placeholder"]
    assert not is_written_in_place(kept) and is_written_in_place(written)
    assert copy_inputs_written_in_place(module, [kept, written]) == 1
    clones = [n for n in module.graph.nodes if n.op == "call_method" and n.target == "clone"]
    assert [c.args[0] for c in clones] == [written] and list(written.users) == clones
    leaf = torch.ones(3, requires_grad=True)
    other = torch.arange(3.0, requires_grad=True)
    module(other, leaf).sum().backward()  # no longer an in-place write on a leaf
    assert torch.equal(leaf.grad, torch.ones(3)) and torch.equal(other.grad, torch.full((3,), 5.0))
    assert torch.equal(leaf.detach(), torch.ones(3))  # the caller's tensor is not written
