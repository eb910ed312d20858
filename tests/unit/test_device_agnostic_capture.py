"""Captured stages hold no device constant: captured on the CPU, they run wherever they are moved.

The proxy for "every recipe runs on CUDA" without a GPU: capture each recipe's model on the CPU (or on
the meta device, as giant models are), move every stage to the ``meta`` device and run the pipeline
forward and backward there with meta inputs. A graph that kept ``device=cpu`` anywhere fails with a
device mismatch; the node scan names what it would have been.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from torch import fx

import merak  # noqa: F401  (before transformers/torchvision/timm)
from merak.core.group_registry import simulated_groups
from merak.session.assemble import assemble
from merak.shard.settings import ShardingSettings
from merak.tensor_parallel.options import TensorParallelSplit
from merak.trace.devices import ANCHOR, device_constants, follow_stage_device

REPO = Path(__file__).resolve().parents[2]
RECIPES = ("gpt", "bert", "t5", "vit", "swin", "wide_resnet")
# The default model of each recipe (the sizes the GPU runs use), built on meta like a giant model.
DEFAULT_MODELS = {"gpt": "gpt2", "bert": "bert-base-uncased", "t5": "t5-base", "vit": "vit-base",
                  "swin": "swin-tiny", "wide_resnet": "wide-resnet50_2"}


def _recipe(name: str, option: str):
    from omegaconf import OmegaConf

    spec = importlib.import_module(f"recipes.{name}.spec").SPEC
    return spec, OmegaConf.load(REPO / f"recipes/{name}/conf/model/{option}.yaml")


def _assemble(name: str, option: str, *, init_device: str = "cpu", trace_method: str = "fx",
              tp: int = 1, num_stages: int = 2):
    spec, model_cfg = _recipe(name, option)
    tensor_parallel = TensorParallelSplit(plan=spec.tensor_parallel_plan(model_cfg), size=tp, rank=0) \
        if tp > 1 else TensorParallelSplit()
    example = dict(spec.example_inputs(model_cfg, 2))
    options = ShardingSettings(trace_method=trace_method, split_method="layer_split",
                               custom_split_points=list(spec.split_points), leaf_modules=list(spec.leaf_modules))
    built = assemble(build=lambda: spec.build_model(model_cfg), seed=0, init_device=init_device, sharding=options,
                     num_stages=num_stages, num_microbatches=2, stage_id=0, device=torch.device("cpu"),
                     example_inputs=example, materialize_stage=False, tensor_parallel=tensor_parallel)
    return spec, model_cfg, built, example


def _graph_modules(stages):
    return [m for stage in stages for m in stage.modules() if isinstance(m, fx.GraphModule)]


def _literal_devices(stages) -> list[str]:
    return [f"{node.format_node()}" for gm in _graph_modules(stages) for node in device_constants(gm.graph)]


def _first_tensor(output) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    for value in (output.values() if isinstance(output, dict) else output):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value
    raise AssertionError(f"no floating-point tensor in the model output {type(output).__name__}")


def _run_on_meta(stages, example) -> torch.Tensor:
    """Move every stage to meta and run the pipeline forward and backward; returns the last output."""
    for stage in stages:
        stage.to("meta")
    payload = {k: v.to("meta") for k, v in example.items()}
    with simulated_groups():
        for stage in stages:
            payload = stage(payload)
        result = _first_tensor(payload)
        result.float().sum().backward()
    return result


@pytest.mark.parametrize("recipe", RECIPES)
def test_toy_stages_captured_on_cpu_run_on_meta(recipe):
    _, _, built, example = _assemble(recipe, "toy")
    assert _literal_devices(built.stages) == []
    assert built.on_meta is False
    result = _run_on_meta(built.stages, example)
    assert result.device.type == "meta"
    params = [p for stage in built.stages for p in stage.parameters()]
    assert params and all(p.device.type == "meta" for p in params)
    assert any(p.grad is not None for p in params)


@pytest.mark.parametrize("recipe", RECIPES)
def test_default_models_built_on_meta_hold_no_device(recipe):
    """The default sizes (gpt2, bert-base, t5-base, vit-base, swin-tiny, wide-resnet50_2), captured on meta as
    giant models are, and the export path's arange/zeros/to nodes among them."""
    _, _, built, _ = _assemble(recipe, DEFAULT_MODELS[recipe], init_device="meta")
    assert built.on_meta is True
    assert _literal_devices(built.stages) == []


def test_export_capture_with_tensor_parallelism_runs_on_meta():
    _, _, built, example = _assemble("gpt", "toy", trace_method="dynamo", tp=2)
    assert built.plan.trace_method == "export"
    assert _literal_devices(built.stages) == []
    _run_on_meta(built.stages, example)


def test_export_graphs_carried_device_constants_that_are_now_read_from_the_anchor():
    """The rewrite is real: a raw torch.export capture of GPT-2 holds device=cpu nodes; after it, none, and the
    anchor buffer is never saved in a state dict."""
    from merak.trace.capture import capture

    spec, model_cfg = _recipe("gpt", "toy")
    model = spec.build_model(model_cfg)
    captured = capture(model, dict(spec.example_inputs(model_cfg, 2)), method="dynamo")
    module = captured.module
    before = device_constants(module.graph)
    assert before, "torch.export no longer writes devices into the graph: this rewrite may be unnecessary"
    assert follow_stage_device(module) >= len(before)
    assert device_constants(module.graph) == []
    assert ANCHOR in dict(module.named_buffers()) and ANCHOR not in module.state_dict()
    assert not any(n.target == torch.ops.aten._assert_tensor_metadata.default for n in module.graph.nodes)
    with torch.no_grad():
        expected = model(**spec.example_inputs(model_cfg, 2)).logits
        got = module(**spec.example_inputs(model_cfg, 2))[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_half_precision_cast_leaves_the_anchor_alone():
    _, _, built, _ = _assemble("gpt", "toy")
    stage = built.stages[0].to(torch.bfloat16)
    anchors = [b for name, b in stage.named_buffers() if name.endswith(ANCHOR)]
    assert anchors and all(a.dtype == torch.uint8 and a.numel() == 0 for a in anchors)


@pytest.mark.parametrize("recipe", RECIPES)
def test_simplified_stages_reproduce_the_eager_model_on_every_call(recipe):
    """Folded masks, dropped no-op dropout, fused attention and flat attribute paths change no number, and a
    folded value is never written by the graph (T5's ``relative_buckets += ...`` once accumulated into it)."""
    spec, _, built, example = _assemble(recipe, "toy")
    model = built.model.eval()  # toys have no dropout; eval also keeps batch-norm statistics still
    for stage in built.stages:
        stage.eval()
    names = spec.input_names or list(example)
    with torch.no_grad():
        expected = _first_tensor(model(**{k: example[k] for k in names}))
        for _ in range(3):
            payload = {k: example[k] for k in names}
            for stage in built.stages:
                payload = stage(payload)
            torch.testing.assert_close(_first_tensor(payload), expected, rtol=1e-5, atol=1e-6)
