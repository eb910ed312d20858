"""Default pipeline plans: cuts where the fewest bytes cross, recomputed masks, balanced estimated costs."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from torch import nn

from merak.shard.autopipe import simulate_1f1b
from merak.shard.build import shard_modules
from merak.shard.costs import MachineRates, calibrate, measure_units
from merak.shard.graph import GraphUnits
from merak.shard.plan import plan_pipeline
from merak.shard.settings import ShardingSettings
from merak.shard.split import ShardingError, min_bytes
from merak.trace.capture import capture
from merak.trace.simplify import simplify_captured

REPO = Path(__file__).resolve().parents[2]
RATES = MachineRates(flops_per_s=1e10, bytes_per_s=1e10, seconds_per_op=1e-6)


# --- min_bytes on made-up costs ------------------------------------------------------------------------------

def test_min_bytes_keeps_the_cheap_positions_when_they_balance():
    costs = [1.0] * 8
    cut_bytes = [0, 10, 1, 10, 1, 10, 1, 10]  # cheap cuts before units 2, 4 and 6
    assert min_bytes(costs, cut_bytes, num_stages=2) == [2, 4, 6]
    assert min_bytes(costs, cut_bytes, num_stages=4) == [2, 4, 6]


def test_min_bytes_takes_dearer_cuts_only_when_the_cheap_ones_cannot_balance():
    costs = [1.0] * 8
    cut_bytes = [0, 10, 1, 10, 1, 10, 1, 10]
    # Three stages: any cuts reach a bottleneck of 3 units; the cheap ones only 4 (33 % worse).
    assert min_bytes(costs, cut_bytes, num_stages=3) == list(range(1, 8))
    assert min_bytes(costs, cut_bytes, num_stages=3, tolerance=0.5) == [2, 4, 6]


def test_min_bytes_climbs_one_level_at_a_time():
    costs = [1.0] * 6
    cut_bytes = [0, 50, 5, 20, 5, 50]  # levels 5, 20, 50
    # Two stages want a cut before unit 3 (3 + 3); level 20 allows it, level 50 is never needed.
    assert min_bytes(costs, cut_bytes, num_stages=2) == [2, 3, 4]


def test_min_bytes_checks_counts():
    assert min_bytes([1.0, 2.0], [0, 7], num_stages=1) == []
    with pytest.raises(ShardingError, match="fewer than the 3 stages"):
        min_bytes([1.0, 2.0], [0, 7], num_stages=3)


# --- values made from constants are recomputed, not sent -----------------------------------------------------

class MaskedBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x, bias):
        scores = x @ x.transpose(-1, -2) + bias
        return x + self.linear(torch.softmax(scores, dim=-1) @ x)


class MaskedModel(nn.Module):
    """Every block reads a floating-point causal bias built from shapes alone, as attention masks are."""

    def __init__(self, width: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList(MaskedBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 2)

    def forward(self, x):
        length = x.shape[1]
        bias = torch.full((length, length), float("-inf")).triu(1)
        x = self.embed(x)
        for block in self.blocks:
            x = block(x, bias)
        return self.head(x)


def _units(model, inputs):
    captured = capture(model, inputs, method="dynamo")
    simplify_captured(captured.module)
    return GraphUnits(captured)


def test_a_bias_made_from_shapes_never_crosses_and_shards_compute_the_same():
    torch.manual_seed(0)
    model = MaskedModel().train()
    inputs = {"x": torch.randn(2, 5, 8)}
    units = _units(model, inputs)
    assert units.recomputable, "the bias computation should be recomputable"
    cuts = list(range(1, len(units)))  # every position: the bias would cross each of them
    for cut in cuts:
        assert not set(units.crossing_values(cut)) & units.recomputable
    payload = dict(inputs)
    for shard in shard_modules(units, cuts):
        payload = shard(payload)
    torch.testing.assert_close(payload, model(**inputs), rtol=0, atol=0)


def test_cut_bytes_count_the_hidden_state_only():
    model = MaskedModel(width=8).train()
    inputs = {"x": torch.randn(2, 5, 8)}
    units = _units(model, inputs)
    costs = measure_units(units, inputs)
    sizes = units.crossing_bytes(costs.value_bytes)
    hidden = 2 * 5 * 8 * 4
    block_starts = [k for k in range(1, len(units)) if units.units[k].scope[-1].endswith("blocks.1")
                    and units.units[k - 1].scope[-1].startswith("blocks.0")]
    assert block_starts and all(sizes[k] == hidden for k in block_starts)
    assert min(sizes[1:]) <= hidden


# --- measured costs ------------------------------------------------------------------------------------------

def test_unit_costs_see_matrix_work_memory_traffic_and_operations():
    model = MaskedModel(width=16).train()
    inputs = {"x": torch.randn(4, 6, 16)}
    units = _units(model, inputs)
    costs = measure_units(units, inputs)
    assert sum(costs.flops) > 0 and all(b >= 0 for b in costs.bytes_moved) and sum(costs.ops) > len(units) // 2
    assert costs.output_bytes == 4 * 6 * 2 * 4  # the head's logits
    seconds = costs.forward_seconds(RATES)
    assert all(s >= 0 for s in seconds) and sum(seconds) > 0


def test_calibration_gives_positive_rates():
    rates = calibrate("cpu")
    assert rates.flops_per_s > 1e8 and rates.bytes_per_s > 1e7 and 0 < rates.seconds_per_op < 1e-2


def test_the_predicted_step_is_the_1f1b_time_of_the_stage_estimates():
    model = MaskedModel(width=16, depth=6).train()
    plan = plan_pipeline(model, {"x": torch.randn(4, 6, 16)}, num_stages=3, num_microbatches=6,
                         sharding=ShardingSettings(trace_method="dynamo"), machine_rates=RATES)
    stages = [plan.stage_summary(s) for s in range(3)]
    assert plan.predicted_step_seconds() == pytest.approx(simulate_1f1b(
        [s["predicted_forward_s"] for s in stages], [s["predicted_backward_s"] for s in stages], 6))
    assert plan.to_json()["predicted_step_s"] == plan.predicted_step_seconds()


# --- every transformer recipe's default plan sends the hidden state, never a mask or an MLP activation --------

def _recipe_plan(recipe: str, pp: int, tmp_path) -> tuple[dict, object]:
    from hydra import compose, initialize_config_dir

    import merak

    with initialize_config_dir(config_dir=str(REPO / "recipes" / recipe / "conf"), version_base=None):
        cfg = compose(config_name="train", overrides=["model=toy", "dry_run=true", f"parallel.pp={pp}",
                                                      "parallel.tp=1", "parallel.dp=1",
                                                      f"trainer.output_dir={tmp_path}"])
    return merak.run(importlib.import_module(f"recipes.{recipe}.spec").SPEC, cfg), cfg.model


def _widths(recipe: str, model_cfg) -> set[int]:
    if recipe == "swin":
        return {model_cfg.embed_dim * 2 ** k for k in range(len(model_cfg.depths))}
    return {model_cfg.get("d_model") or model_cfg.hidden_size}


def _is_t5_position_bias(shape: list[int], model_cfg) -> bool:
    """T5's relative position bias: computed from a learned table in the first block of each stack and read by
    every later block, so it crosses (recomputing it would need that table on every stage)."""
    return len(shape) == 4 and shape[0] == 1 and shape[1] == model_cfg.num_heads and shape[2] == shape[3]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("recipe,pp", [("gpt", 2), ("gpt", 4), ("bert", 2), ("bert", 3), ("t5", 2), ("t5", 3),
                                       ("vit", 2), ("vit", 3), ("swin", 2)])
def test_default_plans_send_hidden_states_only(recipe, pp, tmp_path):
    report, model_cfg = _recipe_plan(recipe, pp, tmp_path)
    assert report["split_method"] == "min_bytes" and report["partition_method"] == "autopipe"
    assert report["predicted_step_s"] > 0
    widths = _widths(recipe, model_cfg)
    for stage in report["stages"][:-1]:
        assert stage["sends"], stage
        for name, description in stage["sends"].items():
            dtype, shape = description.split("[")
            shape = [int(d) for d in shape.rstrip("]").split(", ")]
            if dtype.startswith("int"):  # a model input passed on (T5's decoder_input_ids)
                assert len(shape) == 2, (name, description)
                continue
            assert dtype == "float32", (recipe, name, description)  # never a boolean mask
            if recipe == "t5" and _is_t5_position_bias(shape, model_cfg):
                continue
            assert len(shape) == 3 and shape[-1] in widths, (recipe, name, description)  # no MLP activation


# --- the stages beside a dominant one are evened out ----------------------------------------------------------

def test_stages_beside_a_dominant_stage_are_even():
    from merak.shard.autopipe import autopipe_boundaries, balance_other_stages

    forward = [1.0] * 6 + [100.0]  # six blocks and a huge head
    backward = [2 * f for f in forward]
    start = autopipe_boundaries(forward, backward, 4, 8)
    assert start[-2] == 6  # the head alone on the last stage, whatever the others hold
    assert balance_other_stages(forward, backward, start, 8) == [0, 2, 4, 6, 7]
    assert simulate_1f1b(*_stage_costs(forward, backward, [0, 2, 4, 6, 7]), 8) <= \
        simulate_1f1b(*_stage_costs(forward, backward, start), 8)


def _stage_costs(forward, backward, bounds):
    return ([sum(forward[a:b]) for a, b in zip(bounds, bounds[1:])],
            [sum(backward[a:b]) for a, b in zip(bounds, bounds[1:])])


def test_no_cut_leaves_a_stage_without_work():
    from merak.shard.autopipe import cheapen_boundaries

    # A free first unit (a view of the input ids, 8 bytes to send) and a head that dwarfs the blocks:
    # cutting after the view would be cheap to send and nearly as fast, but stage 0 would do nothing.
    costs = [0.0, 1.0, 1.0, 1.0, 100.0]
    cut_bytes = [0, 8, 64, 64, 64]
    assert 1 not in min_bytes(costs, cut_bytes, num_stages=2)
    forward = [c / 3 for c in costs]
    backward = [2 * f for f in forward]
    assert cheapen_boundaries(forward, backward, [8, 64, 64, 64, 0], [0, 4, 5], 8) == [0, 4, 5]
    assert cheapen_boundaries(forward, backward, [8, 64, 64, 64, 0], [0, 2, 5], 8)[1] > 1


class BatchNormNet(nn.Module):
    """A convolution with batch norm: running statistics are buffers a forward updates in place."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.norm = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.norm(self.conv(x)).relu().mean((2, 3)))


@pytest.mark.parametrize("make, inputs", [
    (lambda: MaskedModel(width=16), {"x": torch.randn(4, 6, 16)}),
    (BatchNormNet, {"x": torch.randn(2, 3, 8, 8)}),
], ids=["masked", "batch-norm"])
def test_unit_costs_on_fake_tensors_equal_a_real_run_and_leave_the_model_untouched(make, inputs):
    from merak.shard.costs import _record

    torch.manual_seed(0)
    model = make().train()
    units = _units(model, inputs)
    before = {name: t.clone() for name, t in units.captured.module.state_dict().items()}
    fake = measure_units(units, inputs)
    after = units.captured.module.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
    real = _record(units.captured.module, units, [inputs[n] for n in units.captured.input_names])
    assert (fake.flops, fake.bytes_moved, fake.ops, fake.made_bytes, fake.output_bytes, fake.weight_bytes) == \
        (real.flops, real.bytes_moved, real.ops, real.made_bytes, real.output_bytes, real.weight_bytes)
    assert list(fake.value_bytes.values()) == list(real.value_bytes.values())
    assert list(fake.descriptions.values()) == list(real.descriptions.values())
