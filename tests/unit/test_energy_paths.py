"""Longest paths and floats of the levelled step graph, the planner's numbers against independent
arithmetic (longest paths in plain Python, the LP's hull bound), and the profile run's overheads."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from merak.energy.dag import step_graph, topological_order
from merak.energy.paths import LevelledGraph
from merak.energy.planner import FrequencyPlanner
from merak.energy.profile import clocks_to_profile, measure_overheads
from merak.energy.profile_csv import (
    Option,
    Overheads,
    ProfileError,
    ProfileRow,
    overheads_path,
    read_overheads,
    write_overheads,
)
from merak.energy.simulated import SPECS
from merak.pipeline.schedules import schedule_info, schedule_names

SCHEDULES = schedule_names(aliases=False)


def _graph(name: str, S: int = 4, M: int = 8):
    return step_graph(name, S, M, num_chunks=2 if schedule_info(name).chunked else 1)


def _plain_finish(graph, durations) -> list[float]:
    """Every node's earliest finish: relax edges in a topological order, one node at a time."""
    preds = [[] for _ in graph.nodes]
    for before, after in graph.edges:
        preds[after].append(before)
    finish = [0.0] * len(graph.nodes)
    for node in topological_order(graph):
        finish[node] = max((finish[p] for p in preds[node]), default=0.0) + float(durations[node])
    return finish


def _critical_nodes(graph, durations) -> list[int]:
    """The nodes of the (unique, with random durations) longest path, walked back from its end."""
    finish = _plain_finish(graph, durations)
    preds = [[] for _ in graph.nodes]
    for before, after in graph.edges:
        preds[after].append(before)
    node, path = int(np.argmax(finish)), []
    while True:
        path.append(node)
        start = finish[node] - durations[node]
        before = [p for p in preds[node] if abs(finish[p] - start) < 1e-12]
        if not before:
            return path
        node = before[0]


def _most_critical_nodes(graph, durations) -> int:
    """The most nodes on any longest path (ties broken towards more nodes)."""
    preds = [[] for _ in graph.nodes]
    for before, after in graph.edges:
        preds[after].append(before)
    finish, count = [0.0] * len(graph.nodes), [0] * len(graph.nodes)
    for node in topological_order(graph):
        start = max((finish[p] for p in preds[node]), default=0.0)
        finish[node] = start + float(durations[node])
        count[node] = 1 + max((count[p] for p in preds[node] if finish[p] >= start - 1e-12), default=0)
    return max(c for f, c in zip(finish, count) if f >= max(finish) - 1e-12)


@pytest.mark.parametrize("name", SCHEDULES)
def test_finish_times_and_step_time_match_plain_longest_path(name):
    graph = _graph(name)
    paths = LevelledGraph(graph)
    rng = np.random.default_rng(11)
    for _ in range(3):
        durations = rng.uniform(0.5, 2.0, len(graph.nodes))
        expected = _plain_finish(graph, durations)
        assert paths.finish_times(durations) == pytest.approx(expected, abs=1e-12)
        assert paths.step_time(durations) == pytest.approx(max(expected), abs=1e-12)
    # every edge goes from an earlier level to a later one, and every node is in exactly one level
    level_of = {int(node): k for k, level in enumerate(paths.levels) for node in level}
    assert sorted(level_of) == list(range(len(graph.nodes)))
    assert all(level_of[a] < level_of[b] for a, b in graph.edges)


@pytest.mark.parametrize("name", SCHEDULES)
def test_floats_are_exactly_how_much_a_node_may_grow(name):
    graph = _graph(name)
    paths = LevelledGraph(graph)
    durations = np.random.default_rng(5).uniform(0.5, 2.0, len(graph.nodes))
    finish = paths.finish_times(durations)
    step = paths.step_time(durations)
    slack = paths.floats(durations, finish, step)
    assert slack.min() >= -1e-9
    for node in range(len(graph.nodes)):
        grown = durations.copy()
        grown[node] += slack[node]
        assert paths.step_time(grown) <= step + 1e-9
        grown[node] += 1e-6
        assert paths.step_time(grown) > step + 5e-7, node
    # the nodes of the critical path have no float, and only they are on it
    critical = _critical_nodes(graph, durations)
    assert sum(durations[critical]) == pytest.approx(step, abs=1e-12)
    assert np.abs(slack[critical]).max() < 1e-9
    # a later deadline adds exactly its distance from the step to every node's float
    later = paths.floats(durations, finish, step + 0.75)
    assert later - slack == pytest.approx(np.full(len(graph.nodes), 0.75), abs=1e-9)


def _a100_options(S: int, seed: int):
    spec = SPECS["A100"]
    rng = np.random.default_rng(seed)
    forward = rng.uniform(0.01, 0.03, S)
    clocks = [c for c in spec.clocks() if c >= 600]
    return {(s, name): [Option(c, spec.time(t, c), spec.energy(t, c)) for c in clocks]
            for s in range(S) for name, t in (("forward", forward[s]), ("backward", 2 * forward[s]))}


@pytest.fixture(scope="module")
def a100():
    graph = step_graph("1f1b", 4, 8)
    options = _a100_options(4, seed=7)
    return graph, options, FrequencyPlanner(graph, options, SPECS["A100"].blocked_power)


def test_solved_plans_meet_the_deadline_and_the_lp_bound(a100):
    graph, options, planner = a100
    S, p2p = graph.num_stages, planner.p2p_power
    fastest, slowest = planner.fastest_time(), planner.slowest_useful_time()
    assert slowest > fastest * 1.5
    energies = []
    for deadline in np.linspace(fastest, slowest, 6):
        deadline = float(deadline)
        plan = planner.solve(deadline)
        assert plan.iteration_time <= deadline + 1e-9
        relaxed, relaxed_step = planner._relaxed(deadline)
        assert planner.critical_path(relaxed) <= relaxed_step + 1e-9 <= deadline + 2e-9
        # the LP's optimum: every duration's cost on its convex hull, and the step's blocked power
        bound = S * p2p * relaxed_step + sum(np.interp(t, c.times[c.hull], c.costs[c.hull])
                                             for t, c in zip(relaxed, planner.node_choices))
        assert bound * (1 - 1e-9) <= plan.energy <= bound * 1.01, deadline
        # the plan's energy from its clocks and the original options
        chosen = [next(o for o in options[(n.stage, n.name)] if o.frequency == f)
                  for n, f in zip(graph.nodes, plan.frequencies)]
        times = [o.time for o in chosen]
        assert plan.iteration_time == pytest.approx(max(_plain_finish(graph, times)), abs=1e-12)
        assert plan.energy == pytest.approx(sum(o.energy for o in chosen) + p2p * (S * plan.iteration_time
                                                                                  - sum(times)), rel=1e-12)
        assert planner.solve(deadline) == plan  # asking again gives the same plan
        energies.append(plan.energy)
    assert all(b <= a + 1e-9 for a, b in itertools.pairwise(energies))
    assert energies[-1] < 0.9 * energies[0]


def test_instruction_overhead_lengthens_paths_not_busy_time(a100):
    graph, options, planner = a100
    g, S, p2p = 1e-5, graph.num_stages, planner.p2p_power
    loaded = FrequencyPlanner(graph, options, p2p, instruction_overhead=g)
    top = np.array([options[(n.stage, n.name)][0].time for n in graph.nodes])
    assert loaded.fastest_time() == pytest.approx(max(_plain_finish(graph, top + g)), abs=1e-12)
    # 1f1b's stages repeat their times, so several paths tie: the overhead makes the one with most nodes critical
    nodes = _most_critical_nodes(graph, top)
    assert loaded.fastest_time() - planner.fastest_time() == pytest.approx(g * nodes, rel=1e-6)
    # a plan's energy counts the overhead as blocked time, not as compute
    rng = np.random.default_rng(3)
    for _ in range(3):
        picks = [int(rng.integers(len(c.times))) for c in loaded.node_choices]
        point = loaded.point(picks, 1.0)
        chosen = [next(o for o in options[(n.stage, n.name)] if o.frequency == c.frequencies[k])
                  for n, c, k in zip(graph.nodes, loaded.node_choices, picks)]
        raw = np.array([o.time for o in chosen])
        step = max(_plain_finish(graph, raw + g))
        assert point.iteration_time == pytest.approx(step, abs=1e-12)
        assert point.energy == pytest.approx(sum(o.energy for o in chosen) + p2p * (S * step - raw.sum()),
                                             rel=1e-12)
    with pytest.raises(ValueError, match="instruction_overhead"):
        FrequencyPlanner(graph, options, p2p, instruction_overhead=-1e-3)


SLOWDOWN = {1410: 1.0, 1005: 1.3, 705: 1.7}


def _rows(times: dict[tuple[int, str], float]) -> list[ProfileRow]:
    """Two ranks' rows per stage and clock, averaging to ``times`` slowed down by ``SLOWDOWN``."""
    rows = []
    for (stage, name), seconds in times.items():
        for clock, slow in SLOWDOWN.items():
            for dp, delta in ((0, -0.001), (1, 0.001)):
                rows.append(ProfileRow(2 * stage + dp, dp, stage, 0, name, clock, seconds * slow + delta, 1.0))
    return rows


def test_measure_overheads_takes_the_median_over_the_clocks():
    rows = _rows({(0, "forward"): 0.01, (1, "forward"): 0.02, (1, "backward"): 0.04, (0, "backward"): 0.03})
    # one microbatch on two stages is a chain of four: F0, F1, B1, B0, a critical path of 0.10 s at 1410 MHz
    assert len(LevelledGraph(step_graph("1f1b", 2, 1)).levels) == 4
    # (clock, step, span); at 1410 MHz the longest step and the longest span come from different ranks
    spans = [(1410, 0.15, 0.12), (1410, 0.16, 0.118),  # 0.02 / 4 per instruction, 0.04 per step
             (1005, 0.20, 0.154),  # critical path 0.13: 0.024 / 4 per instruction, 0.046 per step
             (705, 0.40, 0.25)]  # a cold outlier, critical path 0.17: 0.08 / 4 and 0.15
    overheads = measure_overheads(rows, spans, "1f1b", 2, 1)
    assert overheads.instruction == pytest.approx(0.024 / 4, abs=1e-12)
    assert overheads.step == pytest.approx(0.046, abs=1e-12)
    two = measure_overheads(rows, spans[:3], "1f1b", 2, 1)  # an even count: the mean of the middle two
    assert (two.instruction, two.step) == (pytest.approx(0.011 / 2, abs=1e-12), pytest.approx(0.043, abs=1e-12))
    # faster than the profiled instructions, and a step shorter than its span: nothing negative
    assert measure_overheads(rows, [(1410, 0.09, 0.095), (705, 0.16, 0.165)], "1f1b", 2, 1) == Overheads(0.0, 0.0)


def test_overheads_file_round_trip_and_malformed(tmp_path):
    profile = str(tmp_path / "merak+m+p+dp1+pp2+tp1+mbs1.csv")
    assert overheads_path(profile) == str(tmp_path / "merak+m+p+dp1+pp2+tp1+mbs1.overheads.json")
    assert read_overheads(profile) is None
    write_overheads(profile, Overheads(0.00125, 0.0375))
    assert read_overheads(profile) == Overheads(0.00125, 0.0375)
    for text, why in (("{not json", "is not an overheads file"),
                      (json.dumps({"instruction_overhead_s": 0.1}), "is not an overheads file"),
                      (json.dumps({"instruction_overhead_s": -0.1, "step_overhead_s": 0.0}), "must be numbers >= 0"),
                      (json.dumps({"instruction_overhead_s": "nan", "step_overhead_s": 0.0}), "must be numbers >= 0")):
        (tmp_path / "merak+m+p+dp1+pp2+tp1+mbs1.overheads.json").write_text(text)
        with pytest.raises(ProfileError, match=why):
            read_overheads(profile)


def test_a_coarser_profile_keeps_clocks_at_least_the_step_apart():
    a100 = list(range(1410, 209, -15))
    assert clocks_to_profile(a100, None) == a100
    assert clocks_to_profile(a100, 150) == list(range(1410, 209, -150))  # 1410, 1260, ... 210
    uneven = [1980, 1965, 1900, 1890, 1800, 1700, 1695]
    assert clocks_to_profile(uneven, 80) == [1980, 1900, 1800, 1700]
    assert clocks_to_profile(uneven, 1000) == [1980]
