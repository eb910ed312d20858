"""The planner prices the stages a run will make: its pieces start at the units where the runtime's
split and partition (merak.shard.plan) start the stages, at every microbatch size and count."""

from __future__ import annotations

import json

import pytest
import torch

from merak.autoplan.cluster import load_cluster
from merak.autoplan.cost import CostModel, LayoutError, _cuts
from merak.autoplan.layout import Layout
from merak.autoplan.planner import ProfileCache, compose_recipe
from merak.autoplan.profile import GraphProfile
from merak.config import resolve_settings
from merak.session.training import assemble_worker
from merak.shard.plan import stage_unit_bounds
from merak.shard.settings import ShardingSettings

LAYOUTS = [  # (tp, pp, chunks, microbatch, microbatches): deep pipelines, tensor parallelism, interleaving
    (1, 2, 1, 1, 2), (1, 4, 1, 1, 16), (1, 4, 1, 8, 2), (1, 8, 1, 1, 16), (1, 8, 1, 16, 1),
    (2, 4, 1, 4, 4), (1, 2, 2, 2, 4), (4, 2, 1, 16, 1), (1, 8, 1, 2, 8),
]


def _layout(tp: int, pp: int, chunks: int, micro: int, microbatches: int) -> Layout:
    return Layout(dp=1, tp=tp, pp=pp, micro_batch_size=micro, num_microbatches=microbatches,
                  schedule="interleaved_1f1b" if chunks > 1 else "1f1b", chunks=chunks)


def _runtime_stage_units(recipe: str, model: str, layout: Layout) -> list[int]:
    """Where a worker of this layout cuts the stages (planned as workers plan, weights on meta)."""
    spec, cfg = compose_recipe(recipe, [f"model={model}", *layout.overrides()])
    settings = resolve_settings(spec, cfg)
    prepared = spec.prepare_data(settings.data_cfg, settings.model_cfg)
    assembled = assemble_worker(spec, settings, prepared, stage_id=0, device=torch.device("cpu"), planning=True)
    return assembled.plan.stage_units


@pytest.mark.parametrize("recipe,model", [("gpt", "toy"), ("gpt", "demo"), ("bert", "toy")])
def test_pieces_start_where_the_runtime_cuts_the_stages(cache_dir, recipe, model):
    spec, cfg = compose_recipe(recipe, [f"model={model}"])
    settings = resolve_settings(spec, cfg)
    cost = CostModel(ProfileCache(spec, settings, directory=cache_dir / "profiles"), load_cluster("this", processes=8),
                     sharding=spec.sharding(settings.trainer.sharding))
    compared = 0
    for tp, pp, chunks, micro, microbatches in LAYOUTS:
        layout = _layout(tp, pp, chunks, micro, microbatches)
        if spec.check_layout(settings.model_cfg, 1, tp, pp):
            continue
        planned = cost._piece_bounds(layout, cost._table(layout))
        assert planned == _runtime_stage_units(recipe, model, layout), layout.key()
        compared += 1
    assert compared >= 6


@pytest.mark.parametrize("recipe,forward,backward", [("gpt", 2, 2), ("bert", 2, 4)])
def test_the_profile_counts_each_tensor_parallel_collective(cache_dir, recipe, forward, backward):
    # Per layer of the toys (4): the attention's and the MLP's row-parallel outputs all-reduce in forward; the
    # column-parallel inputs' gradients in backward (GPT-2's fused query-key-value projection once, BERT's
    # separate query, key and value projections once each, and the MLP's).
    spec, cfg = compose_recipe(recipe, ["model=toy"])
    profile = ProfileCache(spec, resolve_settings(spec, cfg), directory=cache_dir / "profiles")(2, False)
    assert sum(profile.forward_all_reduce_calls) == 4 * forward
    assert sum(profile.backward_all_reduce_calls) == 4 * backward
    assert sum(profile.forward_gather_calls) == sum(profile.backward_gather_calls) == 0


def _profile(units: int = 12) -> GraphProfile:
    """Twelve units: an embedding, ten equal layers (a layer boundary sends the least), a heavy head."""
    flops = (0, *(10_000_000,) * (units - 2), 40_000_000)
    crossing = (0, 4096, *(1024,) * (units - 2))
    zeros = (0,) * units
    return GraphProfile(micro_batch_size=1, tp=1, sequence_parallel=False, dtype_bytes=4, flops=flops,
                        bytes_moved=(4096,) * units, ops=(4,) * units, params=(1000,) * units,
                        saved_bytes=(64,) * units,
                        forward_all_reduce=zeros, forward_gather=zeros, backward_all_reduce=zeros,
                        backward_gather=zeros, crossing_bytes=crossing, layer_starts=tuple(range(1, units - 1)),
                        output_bytes=4096)


def test_a_model_with_too_few_cuts_is_a_layout_error():
    cost = CostModel(lambda tp, sequence_parallel: _profile(units=4), load_cluster("this", processes=8),
                     sharding=ShardingSettings())
    with pytest.raises(LayoutError):
        cost.predict(_layout(1, 8, 1, 1, 8))


def test_split_methods_that_read_the_graph_are_priced_by_balanced_cuts():
    profile = _profile()
    by_layers = CostModel(lambda tp, sequence_parallel: profile, load_cluster("this", processes=4),
                          sharding=ShardingSettings(split_method="layer_split"))
    layout = _layout(1, 4, 1, 1, 4)
    table = by_layers._table(layout)
    assert by_layers._piece_bounds(layout, table) == _cuts(profile, 4, table.cuts_at)
    with pytest.raises(ValueError, match="min_bytes"):
        stage_unit_bounds(ShardingSettings(split_method="layer_split"), unit_forward_s=[1.0] * 4, loss_s=(0, 0),
                          cut_bytes=[0, 1, 1, 1], unit_params=[1] * 4, unit_flops=[1] * 4, num_stages=2,
                          num_microbatches=2)


def test_the_weights_read_do_not_grow_with_the_microbatch():
    profile = GraphProfile(micro_batch_size=1, tp=1, sequence_parallel=False, dtype_bytes=4, flops=(10, 20),
                           bytes_moved=(1000, 300), ops=(1, 1), params=(0, 0), saved_bytes=(0, 0),
                           forward_all_reduce=(0, 0), forward_gather=(0, 0), backward_all_reduce=(0, 0),
                           backward_gather=(0, 0), crossing_bytes=(0, 8), layer_starts=(), output_bytes=8,
                           weight_bytes=(800, 0))
    scaled = profile.scaled(4)
    assert scaled.bytes_moved == (800 + 4 * 200, 4 * 300) and scaled.flops == (40, 80)
    assert GraphProfile.from_json(scaled.to_json()) == scaled


def test_what_does_not_grow_with_the_microbatch_stays_fixed():
    def at(micro: int) -> GraphProfile:  # a position embedding's 100 bytes, the same at every microbatch
        return GraphProfile(micro_batch_size=micro, tp=1, sequence_parallel=False, dtype_bytes=4,
                            flops=(0, 10 * micro), bytes_moved=(100 + 50 * micro, 300 * micro), ops=(1, 1),
                            params=(0, 0), saved_bytes=(0, 8 * micro), forward_all_reduce=(0, 0),
                            forward_gather=(0, 0), backward_all_reduce=(0, 0), backward_gather=(0, 0),
                            crossing_bytes=(0, 100 + 4 * micro), layer_starts=(), output_bytes=8 * micro)

    profile = at(1).with_fixed_parts(at(2))
    for micro in (3, 8):
        scaled = profile.scaled(micro)
        assert (scaled.bytes_moved, scaled.crossing_bytes, scaled.flops) == \
            (at(micro).bytes_moved, at(micro).crossing_bytes, at(micro).flops)
    assert GraphProfile.from_json(json.loads(json.dumps(profile.to_json()))) == profile
    assert at(1).with_fixed_parts(at(4)) == at(1)  # not twice the microbatch: nothing learned
