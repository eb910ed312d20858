"""Capture and sharding of every model family: the shards run in sequence reproduce the model.

For each model and split method the shards' outputs equal the model's own
outputs exactly (same ops, same order), parameters are shared, never copied,
and every value a later shard needs crosses each boundary in between.
"""

from __future__ import annotations

import signal

import pytest
import tiny_models
import torch
from torch import nn

from merak.distributed.launch import RunInterrupted
from merak.shard.build import shard_modules
from merak.shard.graph import GraphUnits
from merak.shard.plan import plan_pipeline
from merak.shard.settings import ShardingSettings
from merak.shard.split import ShardingError, split_units
from merak.trace.capture import TraceError, capture

SPLIT_POINTS = {
    "gpt2": ["transformer.h.*"], "bert": ["bert.encoder.layer.*"], "t5": ["encoder.block.*", "decoder.block.*"],
    "vit": ["vit.layers.*"], "swin": ["swin.encoder.layers.*"], "wide_resnet": ["layer*"],
    "timm_vit": ["blocks.*"], "timm_swin": ["layers.*"], "skip_net": ["layers.*"],
}
# Where torch.fx works plain (documented in the environment facts) and where export must take over.
EXPECTED_METHOD = {"gpt2": "export", "bert": "export", "t5": "export", "vit": "export", "swin": "export",
                   "wide_resnet": "fx", "timm_vit": "fx", "timm_swin": "fx", "skip_net": "fx"}


def _model(name):
    torch.manual_seed(0)
    model, batch, loss_fn = tiny_models.ALL[name]()
    return model.train(), batch, loss_fn


def _inputs(batch):
    return {k: v for k, v in batch.items() if k != "labels"}


def _run(shards, batch):
    payload = dict(batch)
    for shard in shards:
        payload = shard(payload)
    return payload


def _flat(output):
    if isinstance(output, torch.Tensor):
        return [output]
    return [v for v in output.values() if isinstance(v, torch.Tensor)]


@pytest.fixture(scope="module", params=sorted(tiny_models.ALL))
def captured(request):
    name = request.param
    model, batch, _ = _model(name)
    graph = capture(model, _inputs(batch))
    return name, model, batch, graph


def test_capture_method_and_parameters_shared(captured):
    name, model, batch, graph = captured
    assert graph.method == EXPECTED_METHOD[name]
    assert (graph.method == "export") == bool(graph.notes)  # a fallback is always explained
    model_params = {id(p) for p in model.parameters()}
    assert {id(p) for p in graph.module.parameters()} <= model_params


@pytest.mark.parametrize("method", ["farthest_min_deps", "nearest_min_deps", "layer_split"])
def test_shards_reproduce_the_model(captured, method):
    name, model, batch, graph = captured
    units = GraphUnits(graph)
    cuts = split_units(units, method=method, shard_count=8, split_points=SPLIT_POINTS[name],
                       module_names=[n for n, _ in model.named_modules()])
    assert cuts == sorted(set(cuts)) and all(0 < c < len(units) for c in cuts)
    assert len(cuts) >= 1, f"{name}/{method} made a single shard"
    shards = shard_modules(units, cuts)
    torch.manual_seed(1)
    expected = model(**_inputs(batch))
    torch.manual_seed(1)
    got = _run(shards, batch)
    for want, have in zip(_flat(expected), _flat(got), strict=True):
        torch.testing.assert_close(have, want, rtol=0, atol=0)
    # Every model parameter that the forward uses is in exactly the shards that read it, shared by identity.
    in_shards = {id(p) for shard in shards for p in shard.parameters()}
    assert in_shards <= {id(p) for p in model.parameters()}
    assert in_shards == {id(p) for p in graph.module.parameters()}


def test_boundaries_relay_values_needed_later(captured):
    name, model, batch, graph = captured
    units = GraphUnits(graph)
    counts = units.crossing_counts()
    for cut in range(1, len(units)):
        crossing = units.crossing_values(cut)
        assert len(crossing) == counts[cut]
        for value in crossing:  # made before the cut, read at or after it
            assert units.defined_in(value) < cut


def test_skip_connections_cross_every_boundary_between():
    model, batch, _ = _model("skip_net")
    graph = capture(model, _inputs(batch))
    units = GraphUnits(graph)
    cuts = split_units(units, method="layer_split", shard_count=0, split_points=["layers.*"],
                       module_names=[n for n, _ in model.named_modules()])
    shards = shard_modules(units, cuts)
    payload = dict(batch)
    sizes = []
    for shard in shards[:-1]:
        payload = shard(payload)
        sizes.append(len(payload))
    # Shard 0 ends before layers.0 and sends 'first'; layers.0's output is both the running hidden state
    # and saved[0]; from layers.1 on, 'first' and saved[0] ride along with the hidden state to the end.
    assert sizes == [1, 2, 3, 3, 3, 3], sizes


def test_autopipe_and_parameter_partitions_on_a_real_model():
    model, batch, _ = _model("gpt2")
    for method in ("uniform", "uniform_floor", "parameters", "autopipe"):
        plan = plan_pipeline(model, _inputs(batch), num_stages=3, num_microbatches=4,
                             sharding=ShardingSettings(partition_method=method))
        bounds = plan.boundaries
        assert bounds[0] == 0 and bounds[-1] == len(plan.shards)
        assert all(a < b for a, b in zip(bounds, bounds[1:])), (method, bounds)
        stats = [plan.stage_summary(s) for s in range(3)]
        assert all(s["forward_flops"] > 0 and s["num_parameters"] > 0 for s in stats), (method, stats)
    # The tied LM head's matmul dominates FLOPs: autopipe gives the last stage fewer shards than uniform.
    uniform = plan_pipeline(model, _inputs(batch), num_stages=3, num_microbatches=4,
                            sharding=ShardingSettings(split_method="farthest_min_deps", partition_method="uniform"))
    auto = plan_pipeline(model, _inputs(batch), num_stages=3, num_microbatches=4,
                         sharding=ShardingSettings(split_method="farthest_min_deps", partition_method="autopipe",
                                                   autopipe_costs="flops"))
    def last_size(p):
        return p.boundaries[-1] - p.boundaries[-2]
    assert last_size(auto) < last_size(uniform)
    # Profiled time instead of FLOPs: every shard timed, a valid partition.
    timed = plan_pipeline(model, _inputs(batch), num_stages=3, num_microbatches=4,
                          sharding=ShardingSettings(partition_method="autopipe", autopipe_costs="time"))
    assert all(r.forward_seconds > 0 for r in timed.reports)
    assert len(timed.boundaries) == 4 and timed.boundaries[-1] == len(timed.shards)


class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: fx cannot trace it, export neither
            return self.proj(x)
        return -self.proj(x)


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.tricky = Untraceable()
        self.post = nn.Linear(4, 2)

    def forward(self, x):
        return self.post(self.tricky(self.pre(x)))


def test_untraceable_module_is_named_and_leaf_modules_fix_it():
    model = Wrapper()
    inputs = {"x": torch.randn(2, 4)}
    with pytest.raises(TraceError) as info:
        capture(model, inputs)
    message = str(info.value)
    assert "in module 'tricky' (Untraceable)" in message
    assert "leaf_modules" in message
    graph = capture(model, inputs, leaf_modules=[Untraceable])
    assert graph.method == "fx"
    assert [n.target for n in graph.module.graph.nodes if n.op == "call_module"] == ["pre", "tricky", "post"]
    # By name works too, and the leaf stays one unit.
    graph = capture(model, inputs, leaf_modules=["tricky"])
    units = GraphUnits(graph)
    assert [u.scope[-1] for u in units.units] == ["pre", "tricky", "post"]


def test_input_names_select_the_traced_inputs():
    model, batch, _ = _model("bert")
    graph = capture(model, _inputs(batch), input_names=["input_ids"])
    assert graph.input_names == ["input_ids"]
    assert [n.op for n in graph.module.graph.nodes].count("placeholder") == 1
    with pytest.raises(TraceError, match="not arguments of BertForMaskedLM.forward"):
        capture(model, {"input_ids": batch["input_ids"], "pixels": batch["input_ids"]})


def test_layer_split_errors_name_the_problem():
    model, batch, _ = _model("skip_net")
    units = GraphUnits(capture(model, _inputs(batch)))
    names = [n for n, _ in model.named_modules()]
    with pytest.raises(ShardingError, match="matches no module"):
        split_units(units, method="layer_split", shard_count=4, split_points=["blocks.*"], module_names=names)
    with pytest.raises(ShardingError, match="needs split points"):
        split_units(units, method="layer_split", shard_count=4, split_points=[], module_names=names)


def test_dynamo_method_uses_export_even_where_fx_works():
    model, batch, _ = _model("wide_resnet")
    graph = capture(model, _inputs(batch), method="dynamo")
    assert graph.method == "export" and not graph.notes
    with pytest.raises(ValueError, match="trace_method='jit'"):
        capture(model, _inputs(batch), method="jit")


def test_no_tracing_runs_the_whole_model_as_one_stage():
    from merak.session.assemble import assemble

    _, batch, _ = _model("skip_net")
    built = assemble(build=tiny_models.SkipNet, seed=3, init_device="cpu",
                     sharding=ShardingSettings(trace_method=None), num_stages=1, num_microbatches=1, stage_id=0,
                     device=torch.device("cpu"), example_inputs=batch)
    assert built.plan is None and len(built.stages) == 1
    torch.testing.assert_close(built.stages[0](batch), built.model(batch["features"]))
    with pytest.raises(ValueError, match="needs build_stages"):
        assemble(build=tiny_models.SkipNet, seed=3, init_device="cpu", sharding=ShardingSettings(trace_method=None),
                 num_stages=2, num_microbatches=2, stage_id=0, device=torch.device("cpu"), example_inputs=batch)


class _InterruptedWhileTraced(nn.Module):
    def forward(self, x):
        raise RunInterrupted(signal.SIGINT)  # what the launcher's handler raises when Ctrl-C arrives


def test_an_interrupt_during_capture_is_an_interrupt_not_a_trace_error():
    """Capture reports what breaks a trace as a TraceError (a config error, exit 2); Ctrl-C or SIGTERM
    arriving mid-capture must stay an interrupt (exit 130/143)."""
    model = nn.Sequential(nn.Linear(4, 4), _InterruptedWhileTraced())
    with pytest.raises(RunInterrupted):
        capture(model, {"input": torch.randn(2, 4)})
