"""merak.autoplan.search and merak.autoplan.planner: the layouts searched, their ranking, and planning the toy GPT."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from merak.autoplan.cluster import load_cluster, preset, this_machine
from merak.autoplan.cost import CostModel
from merak.autoplan.layout import Layout
from merak.autoplan.planner import (
    PlanError,
    compose_recipe,
    plan_for_settings,
    requested_global_batch,
    single_process_settings,
)
from merak.autoplan.profile import GraphProfile
from merak.autoplan.search import MEMORY_HEADROOM, Candidate, SearchSpace, grids, layouts, search

HIDDEN = 1 << 20
TOY_HIDDEN_STATE = 32 * 32 * 4  # seq_length x hidden_size x fp32 bytes of one sample


def synthetic_model(layers: int = 8, nodes: int = 1) -> CostModel:
    """A cost model of an embedding, ``layers`` layers of three units and a head on ``nodes`` H100 servers."""
    units = 1 + 3 * layers + 1

    def per_unit(value: int) -> tuple[int, ...]:
        """``value`` for every layer unit, zero for the embedding and the head."""
        return (0, *[value] * (3 * layers), 0)

    crossing = [0] + [HIDDEN if (k - 1) % 3 == 0 else 3 * HIDDEN for k in range(1, units)]
    crossing[-1] = 2 * HIDDEN
    profile = GraphProfile(
        micro_batch_size=1, tp=1, sequence_parallel=False, dtype_bytes=4, flops=per_unit(10**11),
        bytes_moved=per_unit(0), ops=per_unit(0), params=per_unit(10**6), saved_bytes=per_unit(2 * HIDDEN),
        forward_all_reduce=per_unit(0), forward_gather=per_unit(0), backward_all_reduce=per_unit(0),
        backward_gather=per_unit(0), crossing_bytes=tuple(crossing), layer_starts=tuple(range(1, units - 1, 3)),
        output_bytes=0)
    return CostModel(lambda tp, sequence_parallel: profile, preset("h100-80").with_size(nodes=nodes))


# --- grids and layouts ---------------------------------------------------------------------------------------


def test_grids_multiply_to_the_world():
    found = grids(SearchSpace(world_size=8, global_batch_size=16), preset("h100-80"))
    assert len(found) == len(set(found))
    assert all(dp * tp * pp == 8 for dp, tp, pp in found)
    # 8 = 2^3: every way of splitting three factors of two over three axes.
    assert len(found) == 10


def test_grids_need_data_parallel_to_divide_the_batch():
    found = grids(SearchSpace(world_size=8, global_batch_size=4), preset("h100-80"))
    assert {dp for dp, _, _ in found} == {1, 2, 4}
    assert (8, 1, 1) not in found
    assert grids(SearchSpace(world_size=8, global_batch_size=3), preset("h100-80")) == [
        (1, tp, pp) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8) if tp * pp == 8]


def test_grids_keep_tensor_groups_within_a_node():
    small_nodes = preset("h100-80").with_size(nodes=4, devices_per_node=2)
    found = grids(SearchSpace(world_size=8, global_batch_size=16), small_nodes)
    assert {tp for _, tp, _ in found} == {1, 2}
    assert (1, 2, 4) in found and (2, 4, 1) not in found


def test_grids_ask_the_recipe_and_respect_max_pp():
    asked = []

    def problems(dp: int, tp: int, pp: int) -> list[str]:
        """Reject pipelines of 2 stages; record what was asked."""
        asked.append((dp, tp, pp))
        return ["two stages are not allowed"] if pp == 2 else []

    space = SearchSpace(world_size=8, global_batch_size=16, layout_problems=problems)
    found = grids(space, preset("h100-80"))
    assert found and all(pp != 2 for _, _, pp in found)
    assert any(pp == 2 for _, _, pp in asked)
    assert all(pp <= 2 for _, _, pp in grids(SearchSpace(world_size=8, global_batch_size=16), preset("h100-80"),
                                            max_pp=2))


def test_layouts_follow_the_rules_of_each_choice():
    space = SearchSpace(world_size=8, global_batch_size=16)
    found = list(layouts(space, preset("h100-80")))
    assert len(found) == len(set(found))
    for candidate in found:
        assert candidate.world_size == 8 and candidate.global_batch_size == 16
        if candidate.chunks > 1:
            assert candidate.schedule == "interleaved_1f1b"
            assert candidate.num_microbatches % candidate.pp == 0
        if candidate.pp == 1:
            assert (candidate.schedule, candidate.chunks) == ("1f1b", 1)
        if candidate.zero_stage:
            assert candidate.dp > 1
        if candidate.sequence_parallel:
            assert candidate.tp > 1
    # Each choice does occur where it may.
    assert any(c.chunks == 2 for c in found)
    assert any(c.schedule == "zb_h1" for c in found)
    assert {c.zero_stage for c in found} == {0, 1, 2, 3}
    assert any(c.sequence_parallel for c in found)
    assert {c.recompute for c in found} == {"off", "full", "selective"}
    # pp=4 with 2 microbatches: 1F1B and zero-bubble, no interleaving.
    odd = {c.schedule for c in found if c.pp == 4 and c.num_microbatches == 2}
    assert odd == {"1f1b", "zb_h1"}


def test_layouts_respect_a_narrowed_space():
    space = SearchSpace(world_size=4, global_batch_size=16, schedules=("1f1b",), recompute=("off",),
                        zero_stages=(0,), sequence_parallel=(False,), max_micro_batch_size=2)
    found = list(layouts(space, preset("h100-80")))
    assert found
    assert all(c.micro_batch_size <= 2 for c in found)
    assert {(c.schedule, c.recompute, c.zero_stage, c.sequence_parallel) for c in found} == {("1f1b", "off", 0, False)}


# --- search --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def memory_limited():
    """The synthetic model searched on 8 devices with room for about half the layouts: (ranked, usable bytes)."""
    model = synthetic_model()
    space = SearchSpace(world_size=8, global_batch_size=16)
    everything = search(model, space, capacity_bytes=1e18)
    memories = sorted(c.prediction.max_memory for c in everything)
    capacity = memories[len(memories) // 2] / MEMORY_HEADROOM
    return search(model, space, capacity), capacity * MEMORY_HEADROOM


def test_search_ranks_fitting_candidates_first(memory_limited):
    ranked, usable = memory_limited
    fits = [c.fits for c in ranked]
    assert True in fits and False in fits
    assert fits == sorted(fits, reverse=True)
    for candidate in ranked:
        assert candidate.fits == (candidate.prediction.max_memory <= usable)


def test_search_simulates_and_chooses_the_fastest_fitting(memory_limited):
    ranked, _ = memory_limited
    best = ranked[0]
    assert best.fits and best.why_not == "" and best.prediction.simulated
    simulated = [c for c in ranked if c.fits and c.prediction.simulated]
    assert len(simulated) > 1
    # The best is fastest within the margin that favours simpler layouts.
    assert all(best.predicted_step_s <= c.predicted_step_s * 1.05 for c in simulated)
    # Every (dp, tp, pp) not far behind the best has a simulated candidate (the others keep closed forms).
    close = {c.layout.grid for c in ranked if c.fits and c.predicted_step_s <= best.predicted_step_s * 1.5}
    assert close <= {c.layout.grid for c in simulated} <= {c.layout.grid for c in ranked if c.fits}


def test_search_says_why_each_runner_up_lost(memory_limited):
    ranked, _ = memory_limited
    for candidate in ranked[1:]:
        assert candidate.why_not
        if candidate.fits:
            assert re.match(r"[+-]\d+\.\d%: ", candidate.why_not)
        else:
            assert candidate.why_not.startswith("does not fit")
    unfit = [c.prediction.max_memory for c in ranked if not c.fits]
    assert unfit == sorted(unfit)


def test_search_without_room_ranks_nothing_as_fitting():
    ranked = search(synthetic_model(), SearchSpace(world_size=4, global_batch_size=8), capacity_bytes=1.0)
    assert ranked and not any(c.fits for c in ranked)
    assert all(c.why_not.startswith("does not fit") for c in ranked)


def test_search_limits_pipeline_depth():
    ranked = search(synthetic_model(), SearchSpace(world_size=8, global_batch_size=16, schedules=("1f1b",)),
                    capacity_bytes=1e18, max_pp=2)
    assert ranked and max(c.layout.pp for c in ranked) == 2


class _StarvedLooksFast(CostModel):
    """Predicts pipelines with fewer microbatches than stages at half their step (a cost model's error)."""

    def predict(self, layout, *, simulate_schedule=True):
        prediction = super().predict(layout, simulate_schedule=simulate_schedule)
        if layout.num_microbatches < layout.pp:
            prediction.step_s /= 2
        return prediction


def test_search_chooses_fewer_microbatches_than_stages_only_when_nothing_else_fits():
    synthetic = synthetic_model()
    model = _StarvedLooksFast(synthetic.profiles, synthetic.cluster)
    ranked = search(model, SearchSpace(world_size=4, global_batch_size=4), capacity_bytes=1e18)
    starved = [c for c in ranked if c.layout.num_microbatches < c.layout.pp]
    assert starved and min(c.prediction.step_s for c in starved) < ranked[0].prediction.step_s
    assert ranked[0].layout.num_microbatches >= ranked[0].layout.pp
    simulated = [c for c in ranked if c.prediction.simulated]  # ranked first, on the schedules' own timing
    assert [c in starved for c in simulated] == sorted(c in starved for c in simulated)
    assert "each stage idles for most of the step" in starved[0].why_not
    only_pipelines = SearchSpace(world_size=2, global_batch_size=1,
                                 layout_problems=lambda dp, tp, pp: [] if pp == 2 else ["pipelines only"])
    assert search(model, only_pipelines, capacity_bytes=1e18)[0].layout.num_microbatches == 1


# --- planning the toy GPT ------------------------------------------------------------------------------------

TOY_GRIDS = {(4, 1, 1), (2, 2, 1), (1, 4, 1), (2, 1, 2), (1, 2, 2), (1, 1, 4)}


@pytest.fixture(scope="module")
def toy(cache_dir):
    """The gpt recipe's toy model: (spec, single-process settings, composed config); profiles go to a private cache."""
    spec, cfg = compose_recipe("gpt", ["model=toy", "trainer.global_batch_size=16"])
    return spec, single_process_settings(spec, cfg), cfg


def plan_toy(toy, cluster, world_size: int = 4, global_batch_size: int = 16):
    """Plan the toy GPT on ``world_size`` devices of ``cluster`` from the device rates."""
    spec, settings, _ = toy
    return plan_for_settings(spec, settings, world_size=world_size, cluster=cluster,
                             global_batch_size=global_batch_size)


def tiny_memory(cluster, memory_gib: float):
    """``cluster`` with ``memory_gib`` per device."""
    return dataclasses.replace(cluster, accelerator=dataclasses.replace(cluster.accelerator, memory_gib=memory_gib))


@pytest.fixture(scope="module")
def report(toy):
    return plan_toy(toy, this_machine(4))


def test_requested_global_batch(toy):
    assert requested_global_batch(toy[2]) == 16


def test_toy_plan_chooses_a_fitting_layout(report):
    best = report.best
    assert best.fits and best.prediction.simulated and best.why_not == ""
    assert best.layout.world_size == 4 and best.layout.global_batch_size == 16
    assert all(c.layout.world_size == 4 and c.layout.global_batch_size == 16 for c in report.candidates)
    assert best.prediction.max_memory <= report.capacity_bytes * MEMORY_HEADROOM
    assert 0 < report.mfu(best) < 1
    assert report.profile_seconds >= 0 and report.search_seconds > 0


def test_toy_plan_covers_every_grid(report):
    per_grid = report.best_per_grid()
    assert set(per_grid) == TOY_GRIDS
    for grid, candidate in per_grid.items():
        assert candidate.layout.grid == grid and candidate.fits
        assert candidate.predicted_step_s >= report.best.predicted_step_s * 0.96  # the simplicity margin
    assert per_grid[report.best.layout.grid] is report.best


def test_toy_plan_json(report):
    payload = json.loads(json.dumps(report.to_json(top=5)))
    assert payload["best"]["key"] == report.best.layout.key()
    assert payload["best"]["fits"] is True
    assert len(payload["candidates"]) == 5
    assert payload["num_candidates"] == len(report.candidates)
    assert payload["world_size"] == 4 and payload["global_batch_size"] == 16
    assert payload["cluster"]["name"] == "this"
    assert payload["best"]["overrides"] == report.best.layout.overrides()


def test_toy_best_layout_overrides_compose(toy, report):
    from merak.config import resolve_settings

    spec, _, _ = toy
    chosen = report.best.layout
    _, cfg = compose_recipe("gpt", ["model=toy", *chosen.overrides()])
    assert (cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp) == chosen.grid
    assert cfg.trainer.per_device_train_batch_size == chosen.micro_batch_size
    assert cfg.trainer.gradient_accumulation_steps == chosen.num_microbatches
    assert cfg.trainer.train_schedule == chosen.schedule
    settings = resolve_settings(spec, cfg)
    assert settings.trainer.batch.per_device_train_batch_size == chosen.micro_batch_size


def test_toy_price_of_a_written_layout(report):
    mine = Layout(dp=1, tp=1, pp=4, micro_batch_size=2, num_microbatches=8)
    priced = report.price(mine)
    assert isinstance(priced, Candidate)
    assert priced.layout == mine and priced.prediction.simulated and priced.fits
    assert priced.predicted_step_s > report.best.predicted_step_s
    assert priced.why_not.startswith("+")
    with pytest.raises(PlanError, match="cannot run"):
        report.price(dataclasses.replace(mine, schedule="no_such_schedule"))


def test_toy_profiles_tensor_collectives_and_crossings(report):
    profiles = report.cost_model.profiles
    whole, split = profiles(1, False), profiles(2, False)
    collectives = ("forward_all_reduce", "backward_all_reduce", "forward_gather", "backward_gather")
    assert all(sum(getattr(whole, name)) == 0 for name in collectives)
    assert sum(split.forward_all_reduce) > 0 and sum(split.backward_all_reduce) > 0
    # Two all-reduces (attention and MLP outputs) of the hidden state per layer in forward.
    assert sum(split.forward_all_reduce) == 4 * 2 * TOY_HIDDEN_STATE
    assert len(whole.layer_starts) == 4
    assert whole.micro_batch_size == 1
    assert [whole.crossing_bytes[k] for k in whole.layer_starts] == [TOY_HIDDEN_STATE] * 4
    assert [whole.scaled(3).crossing_bytes[k] for k in whole.layer_starts] == [3 * TOY_HIDDEN_STATE] * 4


def test_plan_error_when_nothing_fits(toy):
    with pytest.raises(PlanError) as caught:
        plan_toy(toy, load_cluster({"preset": "h100-80", "accelerator": {"memory_gib": 0.001}}))
    message = str(caught.value)
    key = r"dp\d+ tp\d+ pp\d+ mb\d+ M\d+ \S+ rc(?:0|1|sel) z[0-3] sp[01]"
    smallest = re.search(rf"the smallest layout \(({key})\)", message)
    assert smallest, message
    devices = re.search(r"try at least (\d+) devices", message)
    assert devices, message
    assert int(devices.group(1)) > 4 and int(devices.group(1)) % 4 == 0
    assert "0.001 GiB available" in message


def smallest_memory(report) -> int:
    """The least memory any of ``report``'s layouts needs on its fullest device."""
    return min(c.prediction.max_memory for c in report.candidates)


def test_plan_error_suggests_the_world_that_fits(toy):
    big = preset("h100-80").with_size(nodes=2)
    at_8, at_16 = smallest_memory(plan_toy(toy, big, 8)), smallest_memory(plan_toy(toy, big, 16))
    assert at_16 < at_8
    cluster = tiny_memory(big, (at_8 + at_16) / 2 / MEMORY_HEADROOM / 2**30)
    assert plan_toy(toy, cluster, 16).best.fits
    with pytest.raises(PlanError, match="try at least 16 devices"):
        plan_toy(toy, cluster, 8)


def test_plan_error_for_more_devices_than_the_cluster_has(toy):
    with pytest.raises(PlanError, match=r"\b8\b"):
        plan_toy(toy, preset("h100-80"), 16)
