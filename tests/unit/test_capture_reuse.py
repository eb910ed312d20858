"""A run captures its model once: a second build of the same model is rebuilt from the first graph
(merak.trace.reuse), around its own parameters, and computes exactly what a fresh capture computes.
Anything that could make the graphs differ is captured anew."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

from merak.distributed.launch import spawn_workers
from merak.trace import capture as capture_module
from merak.trace.capture import capture
from merak.trace.reuse import captures_reused, counted_once, fingerprint

REPO = Path(__file__).resolve().parents[2]
REUSES_CAPTURES = False  # each test opens its own run (tests/conftest.py)


@pytest.fixture
def traced(monkeypatch) -> list[str]:
    """The class names of the models actually traced (not rebuilt) from now on."""
    names: list[str] = []
    anew = capture_module._capture_anew

    def counting(model, *args, **kwargs):
        names.append(type(model).__name__)
        return anew(model, *args, **kwargs)

    counting.traced = names  # for a forked worker, which reads its own copy
    monkeypatch.setattr(capture_module, "_capture_anew", counting)
    return names


def _recipe_model(name: str, option: str = "toy"):
    from omegaconf import OmegaConf

    spec = importlib.import_module(f"recipes.{name}.spec").SPEC
    model_cfg = OmegaConf.load(REPO / f"recipes/{name}/conf/model/{option}.yaml")

    def build() -> nn.Module:
        torch.manual_seed(0)
        return spec.build_model(model_cfg).train()

    examples = dict(spec.example_inputs(model_cfg, 2))
    names = list(spec.input_names or examples)
    return build, {n: examples[n] for n in names}, tuple(spec.leaf_modules)


def _outputs_and_grads(captured, model: nn.Module, examples) -> tuple[list, dict]:
    torch.manual_seed(1)  # the same dropout masks for both graphs
    # forward, not __call__: an export capture keeps export's argument checks on __call__ (stages never call it)
    out = captured.module.forward(*[examples[name] for name in captured.input_names])
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    sum(t.float().sum() for t in leaves).backward()
    return [t.detach() for t in leaves], {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("recipe", ["gpt", "t5", "swin", "wide_resnet"])
def test_a_second_build_is_rebuilt_around_its_own_parameters_and_computes_the_same(recipe, traced):
    build, examples, leaf_modules = _recipe_model(recipe)
    with captures_reused():
        first_model = build()
        first = capture(first_model, examples, leaf_modules=leaf_modules)
        second_model = build()
        second = capture(second_model, examples, leaf_modules=leaf_modules)
    assert traced == [type(first_model).__name__]
    assert second.module.code == first.module.code
    assert (second.method, second.input_names, second.leaf_scopes, second.notes) == \
        (first.method, first.input_names, first.leaf_scopes, first.notes)
    own = {id(p) for p in second_model.parameters()}
    assert {id(p) for p in second.module.parameters()} <= own
    assert not own & {id(p) for p in first.module.parameters()}
    outputs, grads = _outputs_and_grads(second, second_model, examples)
    want_outputs, want_grads = _outputs_and_grads(first, first_model, examples)
    assert len(outputs) == len(want_outputs) and grads.keys() == want_grads.keys() and grads
    for got, want in zip(outputs, want_outputs):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for name in grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=0, atol=0, msg=name)


class Scaled(nn.Module):
    def __init__(self, scale: float = 2.0, tie: bool = False, bias: bool = True) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4, bias=bias)
        self.second = nn.Linear(4, 4, bias=bias)
        if tie:
            self.second.weight = self.first.weight
        self.scale = scale

    def forward(self, x):
        return self.second(self.first(x) * self.scale)


EXAMPLE = {"x": torch.ones(2, 4)}


def _capture_twice(first: nn.Module, second: nn.Module, second_example=EXAMPLE, **second_options):
    with captures_reused():
        capture(first, EXAMPLE)
        return capture(second, second_example, **second_options)


@pytest.mark.parametrize("second, example, options", [
    (Scaled(scale=3.0), EXAMPLE, {}),  # a plain attribute the forward reads
    (Scaled(tie=True), EXAMPLE, {}),  # tied weights
    (Scaled(bias=False), EXAMPLE, {}),  # other parameters
    (Scaled().eval(), EXAMPLE, {}),  # inference mode of a module
    (Scaled(), {"x": torch.ones(3, 4)}, {}),  # another input shape
    (Scaled(), {"x": torch.ones(2, 4, dtype=torch.float64)}, {}),
    (Scaled(), EXAMPLE, {"leaf_modules": ("Linear",)}),  # other capture options
], ids=["attribute", "tied", "parameters", "eval", "shape", "dtype", "options"])
def test_anything_that_can_change_the_graph_is_captured_anew(second, example, options, traced):
    _capture_twice(Scaled(), second, example, **options)
    assert traced == ["Scaled", "Scaled"]


def test_hooks_and_attributes_it_cannot_describe_are_captured_anew(traced):
    def scaling(factor):
        return lambda module, args, out: out * factor

    hooked, other = Scaled(), Scaled()
    hooked.first.register_forward_hook(scaling(2.0))
    other.first.register_forward_hook(scaling(3.0))  # the same hook function, holding another value
    _capture_twice(Scaled(), hooked)
    _capture_twice(hooked, other)
    opaque = Scaled()
    opaque.table = torch.ones(100_000)  # a large tensor that is neither parameter nor buffer
    assert fingerprint(opaque, EXAMPLE, ()) is None
    _capture_twice(opaque, opaque)
    assert traced == ["Scaled"] * 6


def test_nothing_is_remembered_outside_a_run(traced):
    capture(Scaled(), EXAMPLE)
    capture(Scaled(), EXAMPLE)
    with captures_reused():
        capture(Scaled(), EXAMPLE)
    with captures_reused():
        capture(Scaled(), EXAMPLE)
    assert traced == ["Scaled"] * 4


def _capture_in_worker(out_dir: str) -> None:
    captured = capture(Scaled(), EXAMPLE)
    torch.save({"traced": list(capture_module._capture_anew.traced), "code": captured.module.code},
               Path(out_dir) / "worker.pt")


def test_a_forked_worker_rebuilds_what_its_launcher_captured(tmp_path, traced):
    with captures_reused():
        launcher = capture(Scaled(), EXAMPLE)
        spawn_workers(_capture_in_worker, world_size=1, args=(str(tmp_path),), start_method="fork")
    worker = torch.load(tmp_path / "worker.pt", weights_only=False)
    assert worker["traced"] == ["Scaled"]  # the launcher's capture only, inherited by the fork
    assert worker["code"] == launcher.module.code


def test_numbers_of_the_model_are_counted_once_per_run():
    counts = []

    def count(model):
        return lambda: counts.append(type(model).__name__) or len(counts)

    with captures_reused():
        first, second, other = Scaled(), Scaled(), Scaled(scale=3.0)
        values = [counted_once("flops", m, EXAMPLE, count(m)) for m in (first, second, other)]
    assert values == [1, 1, 2]
    assert counted_once("flops", first, EXAMPLE, count(first)) == 3  # outside a run: counted every time


def test_a_rebuilt_capture_is_planned_on_the_first_captures_unit_costs(monkeypatch):
    from merak.shard import plan as plan_module

    measured = []
    measure = plan_module.measure_units
    monkeypatch.setattr(plan_module, "measure_units", lambda *a: measured.append(1) or measure(*a))

    def planned():
        torch.manual_seed(0)
        model = nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(8, 8), nn.ReLU())])
        return plan_module.plan_pipeline(model, {"input": torch.ones(2, 8)}, num_stages=2, num_microbatches=2)

    with captures_reused():
        first, second = planned(), planned()
    assert len(measured) == 1
    assert second.boundaries == first.boundaries and second.shard_starts == first.shard_starts
    assert [vars(r) for r in second.reports] == [vars(r) for r in first.reports]
