"""The step graph of every schedule and the frequency planner, against hand counts and brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from merak.energy.dag import step_graph, topological_order
from merak.energy.planner import FrequencyPlanner
from merak.energy.profile_csv import Option
from merak.energy.simulated import SPECS
from merak.pipeline import instructions as ins
from merak.pipeline.schedules import build_schedule, schedule_info, schedule_names

# Unit durations: forward-like instructions take 1, backward-like ones 2.
UNIT = {"forward": 1.0, "recompute": 1.0, "backward": 2.0, "backward_input": 2.0, "backward_weight": 2.0}


def _single_option_planner(graph, durations=UNIT, p2p_power=0.0):
    base = {n.name: n.name.split("@")[0] for n in graph.nodes}  # forward@1 lasts as long as forward
    options = {(n.stage, n.name): [Option(1410, durations[base[n.name]], 100.0 * durations[base[n.name]])]
               for n in graph.nodes}
    return FrequencyPlanner(graph, options, p2p_power)


def _longest_path(graph, durations):
    """Independent critical path: relax edges in a topological order."""
    finish = [0.0] * len(graph.nodes)
    preds = [[] for _ in graph.nodes]
    for before, after in graph.edges:
        preds[after].append(before)
    for node in topological_order(graph):
        finish[node] = max((finish[p] for p in preds[node]), default=0.0) + durations[node]
    return max(finish)


# -- the graph ----------------------------------------------------------------------------------


def test_1f1b_graph_nodes_order_and_edges():
    S, M = 3, 4
    graph = step_graph("1f1b", S, M)
    assert len(graph.nodes) == 2 * S * M == 24
    assert graph.num_stages == S

    assert graph.stage_names(0) == ["forward"] * 3 + ["backward", "forward", "backward", "backward", "backward"]
    for stage in range(S):
        expected = [ins.INSTRUCTION_NAMES[type(i)]
                    for i in build_schedule(name="1f1b", stage_id=stage, num_stages=S, num_microbatches=M)
                    if isinstance(i, ins.COMPUTE_TYPES)]
        assert graph.stage_names(stage) == expected
        assert [n.index for n in graph.nodes if n.stage == stage] == list(range(2 * M))

    by_key = {}
    for i, n in enumerate(graph.nodes):
        by_key[(n.stage, type(n.instruction), n.instruction.microbatch)] = i
    assert len(by_key) == 2 * S * M
    edges = set(graph.edges)
    for s in range(S - 1):
        for m in range(M):
            assert (by_key[(s, ins.Forward, m)], by_key[(s + 1, ins.Forward, m)]) in edges
            assert (by_key[(s + 1, ins.Backward, m)], by_key[(s, ins.Backward, m)]) in edges
    # a chain of 2M - 1 edges per stage, plus one forward and one backward edge per boundary and microbatch
    assert len(edges) == len(graph.edges) == S * (2 * M - 1) + 2 * (S - 1) * M == 37
    cross = [(a, b) for a, b in graph.edges if graph.nodes[a].stage != graph.nodes[b].stage]
    assert len(cross) == 2 * (S - 1) * M


@pytest.mark.parametrize("name", schedule_names(aliases=False))
def test_every_schedule_graph_is_acyclic(name):
    S, M = 4, 8
    chunks = 2 if schedule_info(name).chunked else 1
    graph = step_graph(name, S, M, num_chunks=chunks)
    compute_per_stage = [
        sum(isinstance(i, ins.COMPUTE_TYPES)
            for i in build_schedule(name=name, stage_id=s, num_stages=S, num_microbatches=M, num_chunks=chunks))
        for s in range(S)]
    assert [len(graph.stage_names(s)) for s in range(S)] == compute_per_stage
    assert len(graph.nodes) == sum(compute_per_stage) >= 2 * S * M * chunks
    order = topological_order(graph)
    assert sorted(order) == list(range(len(graph.nodes)))
    position = {node: k for k, node in enumerate(order)}
    assert all(position[a] < position[b] for a, b in graph.edges)

    # Plans and profiles name an interleaved stage's later chunks apart: they hold other layers.
    for node in graph.nodes:
        base = ins.INSTRUCTION_NAMES[type(node.instruction)]
        assert node.name == (f"{base}@{node.instruction.chunk}" if node.instruction.chunk else base)
    assert any("@1" in n.name for n in graph.nodes) == (chunks > 1)

    planner = _single_option_planner(graph)
    durations = [UNIT[n.name.split("@")[0]] for n in graph.nodes]
    step = planner.critical_path(durations)
    assert step == pytest.approx(_longest_path(graph, durations), abs=1e-12)
    busiest = max(sum(UNIT[n.name.split("@")[0]] for n in graph.nodes if n.stage == s) for s in range(S))
    assert step >= busiest
    if name in ("1f1b", "gpipe", "ds_default"):
        assert step == pytest.approx((M + S - 1) * (1 + 2))


def test_1f1b_critical_path_is_textbook():
    S, M = 4, 8
    graph = step_graph("1f1b", S, M)
    planner = _single_option_planner(graph)
    assert planner.critical_path([UNIT[n.name] for n in graph.nodes]) == pytest.approx(33.0, abs=1e-12)
    assert planner.fastest_time() == pytest.approx(33.0, abs=1e-12)
    # stage 0's last backward ends the step: slowing it lengthens the step by as much
    durations = [UNIT[n.name] for n in graph.nodes]
    last_b0 = max(i for i, n in enumerate(graph.nodes) if n.stage == 0)
    durations[last_b0] += 0.5
    assert planner.critical_path(durations) == pytest.approx(33.5, abs=1e-12)


# -- the planner against brute force ------------------------------------------------------------

# (frequency, time, energy): faster costs more energy, with diminishing savings as it slows.
TINY_OPTIONS = {
    (0, "forward"): [Option(1410, 1.00, 300.0), Option(1100, 1.25, 250.0), Option(800, 1.60, 230.0)],
    (0, "backward"): [Option(1410, 2.00, 620.0), Option(1100, 2.40, 520.0), Option(800, 3.10, 470.0)],
    (1, "forward"): [Option(1410, 1.20, 330.0), Option(1100, 1.45, 290.0), Option(800, 1.90, 262.0)],
    (1, "backward"): [Option(1410, 2.30, 700.0), Option(1100, 2.80, 585.0), Option(800, 3.50, 545.0)],
}
P2P = 50.0


def _brute_force(graph, options, p2p):
    """(time, energy) of every assignment of options to nodes."""
    planner = _single_option_planner(graph)  # only for critical_path
    per_node = [options[(n.stage, n.name)] for n in graph.nodes]
    results = []
    for picks in itertools.product(*(range(len(o)) for o in per_node)):
        times = [o[k].time for o, k in zip(per_node, picks)]
        step = planner.critical_path(times)
        energy = sum(o[k].energy for o, k in zip(per_node, picks)) + p2p * (graph.num_stages * step - sum(times))
        results.append((step, energy))
    return np.array(results)


@pytest.fixture(scope="module")
def tiny():
    graph = step_graph("1f1b", 2, 2)
    assert len(graph.nodes) == 8
    return graph, FrequencyPlanner(graph, TINY_OPTIONS, P2P), _brute_force(graph, TINY_OPTIONS, P2P)


def test_solve_matches_brute_force(tiny):
    graph, planner, table = tiny
    assert len(table) == 3 ** 8
    fastest, slowest = table[:, 0].min(), table[:, 0].max()
    assert planner.fastest_time() == pytest.approx(fastest, abs=1e-12)
    for deadline in np.linspace(fastest, slowest, 9):
        optimum = table[table[:, 0] <= deadline + 1e-9, 1].min()
        plan = planner.solve(float(deadline))
        assert plan.deadline == float(deadline)
        assert plan.iteration_time <= deadline + 1e-9
        assert plan.energy >= optimum - 1e-9
        assert plan.energy <= optimum * 1.01, (deadline, plan.energy, optimum)
        # the plan's own numbers are consistent with its clocks
        chosen = [next(o for o in TINY_OPTIONS[(n.stage, n.name)] if o.frequency == f)
                  for n, f in zip(graph.nodes, plan.frequencies)]
        times = [o.time for o in chosen]
        assert plan.iteration_time == pytest.approx(planner.critical_path(times), abs=1e-12)
        energy = sum(o.energy for o in chosen) + P2P * (2 * plan.iteration_time - sum(times))
        assert plan.energy == pytest.approx(energy, rel=1e-12)
    # the slowest deadline reaches the least energy of all
    assert planner.solve(float(slowest)).energy == pytest.approx(table[:, 1].min(), rel=0.01)


def test_fastest_plan(tiny):
    graph, planner, table = tiny
    top = [TINY_OPTIONS[(n.stage, n.name)][0] for n in graph.nodes]
    top_time = planner.critical_path([o.time for o in top])
    top_energy = sum(o.energy for o in top) + P2P * (2 * top_time - sum(o.time for o in top))
    plan = planner.fastest()
    assert plan.iteration_time == pytest.approx(top_time, abs=1e-9)
    assert plan.energy <= top_energy + 1e-9
    # off-critical instructions slow down: strictly cheaper than everything at 1410 MHz
    assert plan.energy < top_energy - 1.0
    assert plan.energy == pytest.approx(table[np.abs(table[:, 0] - top_time) <= 1e-9, 1].min(), rel=0.01)


def test_solve_never_slows_down_past_the_energy_minimum():
    graph = step_graph("1f1b", 2, 2)
    # slowing by half saves 20 J, by double 25 J: less than S * p2p = 200 W per second of step time
    options = {key: [Option(1410, v[0].time, v[0].energy), Option(1100, 1.5 * v[0].time, v[0].energy - 20.0),
                     Option(800, 2.0 * v[0].time, v[0].energy - 25.0)] for key, v in TINY_OPTIONS.items()}
    table = _brute_force(graph, options, 100.0)
    planner = FrequencyPlanner(graph, options, 100.0)
    deadline = float(table[:, 0].max())
    assert table[:, 1].min() == pytest.approx(4290.0)  # a feasible plan (T = 10.6 s) for this deadline
    assert planner.solve(deadline).energy <= table[:, 1].min() * 1.01  # it returns 5100 J (T = 20 s)


def test_solve_rejects_short_deadline_and_negative_power(tiny):
    graph, planner, _ = tiny
    with pytest.raises(ValueError, match="shorter than the fastest"):
        planner.solve(planner.fastest_time() * 0.99)
    with pytest.raises(ValueError, match="p2p_power"):
        FrequencyPlanner(graph, TINY_OPTIONS, -1.0)


# -- the frontier on a simulated A100 -----------------------------------------------------------


@pytest.fixture(scope="module")
def a100():
    spec = SPECS["A100"]
    S, M = 4, 8
    graph = step_graph("1f1b", S, M)
    clocks = [c for c in spec.clocks() if c >= 600]
    # unequal stages: the last stage is the heaviest
    at_max = {"forward": [0.010, 0.012, 0.011, 0.016], "backward": [0.020, 0.024, 0.022, 0.032]}
    options = {(s, name): [Option(c, spec.time(at_max[name][s], c), spec.energy(at_max[name][s], c)) for c in clocks]
               for s in range(S) for name in ("forward", "backward")}
    return graph, FrequencyPlanner(graph, options, spec.blocked_power), clocks


def test_frontier_is_pareto(a100):
    graph, planner, clocks = a100
    points = planner.frontier(num_points=12)
    assert len(points) >= 3
    times = [p.iteration_time for p in points]
    energies = [p.energy for p in points]
    assert all(b > a for a, b in itertools.pairwise(times))
    assert all(b < a for a, b in itertools.pairwise(energies))
    assert times[0] == pytest.approx(planner.fastest_time(), abs=1e-12)
    assert times[-1] <= planner.slowest_useful_time() + 1e-9
    for p in points:
        assert p.iteration_time <= p.deadline + 1e-9
        assert set(p.frequencies) <= set(clocks)

    fastest = planner.fastest()
    assert fastest.iteration_time == pytest.approx(planner.fastest_time(), abs=1e-9)
    assert fastest.energy == pytest.approx(points[0].energy, rel=1e-9)

    plan = points[0]
    stage_plans = plan.stage_plans(graph)
    assert len(stage_plans) == 4
    for stage, entries in enumerate(stage_plans):
        assert [name for name, _ in entries] == graph.stage_names(stage)
        assert all(isinstance(f, int) and f in clocks for _, f in entries)
    assert sum(len(e) for e in stage_plans) == len(graph.nodes) == 64
    # the heaviest stage (3) runs its instructions at the highest clock in the fastest plan
    assert all(f == 1410 for _, f in stage_plans[3])
    # lighter stages slow some of their instructions down
    assert any(f < 1410 for _, f in stage_plans[0])
