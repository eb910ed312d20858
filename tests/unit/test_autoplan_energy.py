"""merak.autoplan.energy: objectives, the devices' power model, layouts priced and ranked for energy, and the
clock plan a run applies."""

from __future__ import annotations

import pytest

from merak.autoplan.cluster import Cluster, load_cluster, preset, this_machine, with_simulated_gpus
from merak.autoplan.energy import LayoutEnergy, Objective, frontier_for_run, power_model
from merak.autoplan.planner import PlanError, plan_recipe
from merak.energy.frontier import read_frontier
from merak.energy.simulated import SPECS

SIMULATED = ["model=toy", "trainer.global_batch_size=8", "trainer.energy_device=simulated"]


# --- objectives -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, kind, slowdown, step_s", [
    ("time", "time", None, None), ("energy", "energy", None, None), ("ENERGY@1.1x", "energy", 1.1, None),
    ("energy@250ms", "energy", None, 0.25), ("energy@0.5s", "energy", None, 0.5)])
def test_objectives_parse(text, kind, slowdown, step_s):
    objective = Objective.parse(text)
    assert (objective.kind, objective.slowdown, objective.step_s) == (kind, slowdown, step_s)
    assert Objective.parse(str(objective)) == objective


def test_a_bound_is_a_slowdown_of_the_fastest_step_or_seconds():
    assert Objective.parse("energy@1.5x").deadline(0.2) == pytest.approx(0.3)
    assert Objective.parse("energy@250ms").deadline(0.2) == pytest.approx(0.25)
    assert Objective.parse("energy").deadline(0.2) is None


@pytest.mark.parametrize("text, problem", [("speed", "use one of"), ("energy@0.9x", "at least 1x"),
                                           ("energy@0ms", "positive"), ("energy@fast", "use one of")])
def test_bad_objectives_are_named(text, problem):
    with pytest.raises(ValueError, match=problem):
        Objective.parse(text)


# --- the devices' clock and power model ------------------------------------------------------------------------


def test_power_models_of_gpu_presets_and_simulated_gpus():
    assert power_model(preset("h100-80")) is SPECS["H100"]
    assert power_model(preset("h200")) is SPECS["H100"]
    assert power_model(preset("a100-40")) is SPECS["A100"]
    assert power_model(with_simulated_gpus(this_machine(2), "h100", 0.01)) is SPECS["H100"]


def test_cpu_processes_have_no_power_model():
    with pytest.raises(ValueError, match="trainer.energy_device=simulated"):
        power_model(this_machine(2))
    custom = preset("h100-80").to_json()
    custom["accelerator"]["name"] = "MI300X"
    with pytest.raises(ValueError, match="clock and power model of MI300X"):
        power_model(Cluster.from_json(custom))


def test_simulated_gpus_time_flops_only_and_survive_json():
    cluster = with_simulated_gpus(this_machine(4), "A100", 0.002)
    assert cluster.accelerator.name == "simulated A100"
    assert cluster.accelerator.flops_per_s("bf16") == pytest.approx(2e9)
    assert load_cluster(cluster.to_json()) == cluster
    assert "simulated_gpu" not in this_machine(4).to_json()


# --- layouts priced and ranked ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranked(cache_dir):
    return plan_recipe("gpt", SIMULATED, world_size=2, objective="energy")


def test_a_run_on_simulated_gpus_is_priced_as_them(ranked):
    assert ranked.cluster.simulated_gpu == "A100"
    assert str(ranked.objective) == "energy"


def test_layouts_rank_by_least_energy(ranked):
    priced = [c for c in ranked.candidates if c.energy is not None]
    assert len(priced) >= 3 and ranked.candidates[:len(priced)] == priced
    energies = [c.energy.energy_j for c in priced]
    assert energies == sorted(energies)
    assert {c.layout.grid for c in priced} >= {(2, 1, 1), (1, 1, 2)}  # every grid of the world is priced
    assert all("energy" in c.why_not or "as little energy" in c.why_not for c in priced[1:])


def test_one_stage_runs_every_instruction_at_its_least_energy_clock(ranked):
    """A single stage is never blocked inside the step, so its least-energy plan is every instruction at the
    clock minimizing the power model's energy, and the job's energy is exact arithmetic."""
    candidate = next(c for c in ranked.candidates if c.layout.pp == 1 and c.energy is not None)
    spec, price = SPECS["A100"], candidate.energy
    energy = LayoutEnergy(ranked, candidate, spec)
    best_clock = min(energy.clocks, key=lambda clock: spec.energy(1.0, clock))
    assert price.min_clock_mhz == price.max_clock_mhz == best_clock
    layout = candidate.layout
    graph, _ = energy.planner(layout.num_microbatches)
    seconds = [energy.costs.of(node.stage, node.instruction) for node in graph.nodes]
    outside = price.outside_graph_s
    assert outside == pytest.approx(candidate.predicted_step_s - sum(seconds))
    expected = layout.dp * (sum(spec.energy(s, best_clock) for s in seconds) + spec.blocked_power * outside)
    assert price.energy_j == pytest.approx(expected, rel=1e-9)
    assert price.step_s == pytest.approx(sum(spec.time(s, best_clock) for s in seconds) + outside, rel=1e-9)
    fastest = layout.dp * (sum(spec.energy(s, spec.max_clock) for s in seconds) + spec.blocked_power * outside)
    assert price.fastest_energy_j == pytest.approx(fastest, rel=1e-9)


def test_a_step_bound_is_met_or_the_layout_ranks_after(cache_dir):
    report = plan_recipe("gpt", SIMULATED, world_size=2, objective="energy@1.2x")
    bound = 1.2 * min(c.energy.fastest_step_s for c in report.candidates if c.energy is not None)
    first = report.candidates[0].energy
    assert first.meets_bound and first.step_s <= first.bound_s * (1 + 1e-6)
    meeting = [c for c in report.candidates if c.energy is not None and c.energy.meets_bound]
    assert all(c.energy.step_s <= bound * 1.05 for c in meeting)
    assert first.energy_j < first.fastest_energy_j  # slower clocks within the bound save energy


def test_an_impossible_bound_is_a_plan_error(cache_dir):
    with pytest.raises(PlanError, match="no layout is predicted to step within 0.1 ms"):
        plan_recipe("gpt", SIMULATED, world_size=2, objective="energy@0.1ms")


def test_an_energy_objective_on_cpu_workers_says_what_would_work(cache_dir):
    with pytest.raises(PlanError, match="trainer.energy_device=simulated"):
        plan_recipe("gpt", ["model=toy", "trainer.global_batch_size=8"], world_size=2, objective="energy")


def test_the_run_gets_a_frontier_whose_deadline_selects_the_priced_plan(ranked, tmp_path):
    candidate = ranked.candidates[0]
    path = tmp_path / "frontier.json"
    deadline = frontier_for_run(ranked, candidate, ranked.objective, str(path))
    frontier = read_frontier(str(path))
    layout = candidate.layout
    frontier.check(layout.schedule, layout.pp, layout.num_microbatches, layout.chunks)
    point = frontier.points[frontier.index_within(deadline)]
    assert point.energy == min(p.energy for p in frontier.points)
    # The priced plan of a step planned whole (no extension from short lengths) is the run's.
    assert point.iteration_time == pytest.approx(candidate.energy.frontier_time_s, rel=1e-9)
    clocks = {mhz for stage in point.plans for _, mhz in stage}
    assert clocks == {candidate.energy.max_clock_mhz}
