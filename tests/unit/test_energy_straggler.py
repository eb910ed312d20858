"""The frontier file, straggler-aware plan switching (the decisions and the pipeline hook on a simulated
GPU), a capped simulated GPU, and ``merak-energy plan``'s frontier.json with the host's overheads."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_energy_hooks import FakeTime

from merak.energy import cli
from merak.energy.dag import step_graph
from merak.energy.frontier import Frontier, FrontierError, FrontierPoint, read_frontier, write_frontier
from merak.energy.hooks import InstructionMeter, PlanMismatchError, SimulatedCompute
from merak.energy.planner import FrequencyPlanner
from merak.energy.plans import read_plan
from merak.energy.profile_csv import Option, Overheads, ProfileRow, read_profile, write_overheads, write_profile
from merak.energy.simulated import SPECS, SimulatedGPU
from merak.energy.straggler import PlanSwitch, PlanSwitcher, StragglerAwarePlans
from merak.energy.zeus_server import frontier_plan
from merak.pipeline import instructions as ins
from merak.pipeline.hooks import HookList, InstructionEvent

A100 = SPECS["A100"]
P2P = 80.0


def _options(S: int) -> dict[tuple[int, str], list[Option]]:
    forward = [0.010, 0.014, 0.012][:S]
    clocks = [c for c in A100.clocks() if c >= 600]
    return {(s, name): [Option(c, A100.time(t, c), A100.energy(t, c)) for c in clocks]
            for s in range(S) for name, t in (("forward", forward[s]), ("backward", 2 * forward[s]))}


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    graph = step_graph("1f1b", 2, 4)
    points = FrequencyPlanner(graph, _options(2), P2P).frontier(num_points=8)
    path = str(tmp_path_factory.mktemp("frontier") / "frontier.json")
    write_frontier(path, graph, points, schedule="1f1b", num_chunks=1, p2p_power=P2P, num_microbatches=4)
    return graph, points, path


def test_frontier_round_trip_choice_and_check(planned):
    graph, points, path = planned
    frontier = read_frontier(path)
    assert len(points) >= 3
    assert (frontier.schedule, frontier.num_stages, frontier.num_microbatches, frontier.num_chunks,
            frontier.p2p_power) == ("1f1b", 2, 4, 1, P2P)
    assert [p.iteration_time for p in frontier.points] == [p.iteration_time for p in points]
    assert [p.energy for p in frontier.points] == [p.energy for p in points]
    assert [p.plans for p in frontier.points] == [p.stage_plans(graph) for p in points]
    times = [p.iteration_time for p in points]
    for t in [*times, *(np.array(times[:-1]) + np.diff(times) / 2), times[-1] * 2]:
        best = min((p.energy, i) for i, p in enumerate(points) if p.iteration_time <= t)[1]
        assert frontier.index_within(float(t)) == best
    assert frontier.index_within(times[0] * 0.99) == 0
    assert frontier.energy_at(1, times[1] + 0.25) == pytest.approx(points[1].energy + 2 * P2P * 0.25, rel=1e-12)
    assert frontier.energy_at(1, times[1] - 0.25) == points[1].energy
    frontier.check("1f1b", 2, 4, 1)
    with pytest.raises(FrontierError, match=r"stage 0 lists 8 instructions but the schedule runs 16 .*planned for "
                                            r"1f1b, 2 stages, 4 microbatches"):
        frontier.check("1f1b", 2, 8, 1)


def test_a_server_serves_a_frontier_point_as_a_plan_file(planned, tmp_path):
    graph, points, path = planned
    served = frontier_plan(path, str(tmp_path / "dump"))
    assert read_plan(served) == points[0].stage_plans(graph)
    served = frontier_plan(path, str(tmp_path / "dump"), deadline=points[2].iteration_time)
    assert read_plan(served) == points[2].stage_plans(graph)


def test_read_frontier_names_what_is_wrong(planned, tmp_path):
    _, _, path = planned
    with pytest.raises(FrontierError, match="does not exist"):
        read_frontier(str(tmp_path / "missing.json"))
    with open(path, encoding="utf-8") as handle:
        good = json.load(handle)
    swapped = [good["points"][1], good["points"][0], *good["points"][2:]]
    cases = [("{", "is not readable JSON"), ({**good, "format": 2}, "not a merak frontier of format 1"),
             ({**good, "points": swapped}, "ordered fastest first"), ({**good, "points": []}, "has no points"),
             ({**good, "points": [good["points"][0], dict(good["points"][1], energy=good["points"][0]["energy"])]},
              "each slower one using less energy"),
             ({**good, "points": [5]}, "point 0 is 5, not an object"),
             ({**good, "p2p_power": -1}, "^frontier file .* p2p_power is -1, not a number >= 0$")]
    first = good["points"][0]
    for entry in (["forward", "1410"], ["forward", 1410.0], ["forward"], [3, 1410]):
        point = dict(first, plans=[[entry, *first["plans"][0][1:]], first["plans"][1]])
        cases.append(({**good, "points": [point]}, r"point 0's plans stage 0 is not a list of \[instruction, MHz\]"))
    for content, why in cases:
        bad = tmp_path / "bad.json"
        bad.write_text(content if isinstance(content, str) else json.dumps(content))
        with pytest.raises(FrontierError, match=why):
            read_frontier(str(bad))


def _frontier(times, energies, clocks=None, S=1) -> Frontier:
    clocks = clocks or [1410] * len(times)
    return Frontier("1f1b", S, 1, 1, P2P, [FrontierPoint(t, e, [[("forward", c), ("backward", c)]] * S)
                                           for t, e, c in zip(times, energies, clocks)])


def test_plan_switcher_follows_the_straggler_with_hysteresis():
    switcher = PlanSwitcher(_frontier([1.0, 1.1, 1.2, 1.3], [10.0, 9.0, 8.5, 8.2]), 2, 0, 0.02, 0.01)
    assert switcher.update([1.0, 1.25]) == [(0, 0, 2)]  # least energy within 1.25 * 0.99 = 1.2375: 1.2
    assert switcher.current == [2, 0] and switcher.target == 1.25
    # the straggler's own time is 0.25 s over the base's prediction: it must fit 0.25 s less
    assert switcher.limits == pytest.approx([1.2375, 0.9875])
    assert switcher.own_times([1.2, 1.25]) == pytest.approx([1.0, 1.25])
    assert switcher.update([1.2, 1.25]) == []  # the same target
    assert switcher.update([1.2, 1.27]) == []  # within 2 %
    assert switcher.current == [2, 0] and switcher.target == 1.25
    assert switcher.update([1.2, 1.0]) == [(0, 2, 0)]  # the straggler recovered
    assert switcher.current == [0, 0] and switcher.target == pytest.approx(1.0)
    # a pipeline 0.05 s slower than the base's prediction has 0.05 s less to spend
    frontier = _frontier([1.0, 1.1, 1.2, 1.3], [10.0, 9.0, 8.5, 8.2])
    assert PlanSwitcher(frontier, 2, 0, 0.02, 0.01).update([1.0, 1.35]) == [(0, 0, 3)]
    assert PlanSwitcher(frontier, 2, 0, 0.02, 0.01).update([1.05, 1.35]) == [(0, 0, 2)]
    equal = PlanSwitcher(frontier, 3, 0, 0.02, 0.01)
    assert [equal.update([t] * 3) for t in (1.0, 1.3, 1.05, 2.0)] == [[]] * 4 and equal.current == [0] * 3
    rng = np.random.default_rng(2)
    based, seen = PlanSwitcher(frontier, 3, 1, 0.02, 0.01), set()
    for _ in range(200):
        based.update(list(rng.uniform(0.8, 1.6, 3)))
        seen |= set(based.current)
    assert seen == {1, 2, 3}  # up and back, never below the base point


def _step(hooks: HookList, gpu: SimulatedGPU) -> list[int]:
    """One step of a forward and a backward of 1000 FLOPs each per forward; the clocks they ran at."""
    clocks = []
    hooks.on_step_begin()
    for instruction in (ins.Forward(0), ins.Backward(0)):
        event = InstructionEvent.of(instruction, stage=0, step=0, chunk_forward_flops=1_000)
        hooks.on_instruction_begin(event)
        clocks.append(gpu.clock)
        hooks.on_instruction_end(event)
    hooks.on_step_end()
    return clocks


def test_straggler_aware_plans_switch_a_window_after_the_straggler_shows(monkeypatch):
    time = FakeTime()
    gpu = SimulatedGPU("A100", clock_source=time.clock, sleep=time.sleep)
    meter = InstructionMeter(gpu, clock=time.clock)
    frontier = _frontier([3.0, 3.5, 3.9, 4.5], [900.0, 850.0, 800.0, 780.0], [1410, 1200, 1005, 810])
    hook = StragglerAwarePlans(gpu, frontier, meter, stage=0, pipeline=0, pipelines=2, base=0, window=2,
                               hysteresis=0.02, margin=0.01)
    hooks = HookList([hook, SimulatedCompute(gpu, 1_000.0), meter])
    other, calls = [4.0], []

    def gather(value):
        calls.append((len(meter.steps), value))
        return [value, (1, other[0])]

    monkeypatch.setattr("merak.energy.straggler.groups.gather_from_all", gather)
    clocks = [_step(hooks, gpu) for _ in range(3)]
    assert calls == [] and clocks == [[1410, 1410]] * 3 and hook.point == 0
    assert [s.compute_span for s in meter.steps] == pytest.approx([3.0] * 3)
    clocks.append(_step(hooks, gpu))  # step 3: steps 1 and 2 are exchanged, 4 s > 3 s: point 2 (3.9 s)
    assert [c[0] for c in calls] == [3] and calls[0][1] == (0, pytest.approx(3.0))
    assert hook.switches == [PlanSwitch(3, 0, 0, 2, 4.0, pytest.approx(3.96))] and hook.since_step == 3
    assert hook.point == 2
    assert clocks[3] == [1005, 1005]
    assert meter.steps[3].compute_span == pytest.approx(A100.time(3.0, 1005))
    clocks += [_step(hooks, gpu) for _ in range(3)]  # step 5 decides again, on steps 3 and 4: no change
    assert [c[0] for c in calls] == [3, 5] and calls[1][1] == (0, pytest.approx(A100.time(3.0, 1005)))
    assert len(hook.switches) == 1 and clocks[4:] == [[1005, 1005]] * 3
    other[0] = 3.0  # the straggler recovers: at step 7 everyone goes back to the base
    clocks.append(_step(hooks, gpu))
    assert [c[0] for c in calls] == [3, 5, 7]
    own = A100.time(3.0, 1005) - (3.9 - 3.0)  # pipeline 0's time had it run the base point
    assert hook.switches[1] == PlanSwitch(7, 0, 2, 0, pytest.approx(3.0), pytest.approx(0.99 * 3.0 - (own - 3.0)))
    assert hook.since_step == 7
    assert clocks[7] == [1410, 1410] and hook.point == 0


def test_window_0_never_exchanges(monkeypatch):
    time = FakeTime()
    gpu = SimulatedGPU("A100", clock_source=time.clock, sleep=time.sleep)
    meter = InstructionMeter(gpu, clock=time.clock)
    frontier = _frontier([3.0, 3.9], [900.0, 800.0], [1410, 1005])
    hook = StragglerAwarePlans(gpu, frontier, meter, stage=0, pipeline=0, pipelines=2, base=0, window=0,
                               hysteresis=0.02, margin=0.01)
    monkeypatch.setattr("merak.energy.straggler.groups.gather_from_all", lambda value: pytest.fail("exchanged"))
    hooks = HookList([hook, SimulatedCompute(gpu, 1_000.0), meter])
    assert [_step(hooks, gpu) for _ in range(6)] == [[1410, 1410]] * 6 and hook.switches == []


def test_a_point_with_an_unsupported_clock_fails_before_training():
    gpu = SimulatedGPU("A100")
    frontier = _frontier([3.0, 3.9], [900.0, 800.0], [1410, 1000])  # 1000 MHz is no A100 clock
    with pytest.raises(PlanMismatchError, match=r"frontier point 1 runs stage 0 at \[1000\] MHz"):
        StragglerAwarePlans(gpu, frontier, InstructionMeter(gpu), stage=0, pipeline=0, pipelines=2, base=0,
                            window=2, hysteresis=0.02, margin=0.01)


def test_clock_cap_runs_higher_clocks_at_the_cap():
    time = FakeTime()
    gpu = SimulatedGPU("A100", clock_source=time.clock, sleep=time.sleep, clock_cap=1005)
    assert gpu.clock == 1005 and gpu.name == "simulated A100 capped at 1005 MHz"
    gpu.set_clock(1410)
    assert gpu.clock == 1005
    start, joules = time.now, gpu.energy()
    gpu.begin_compute()
    assert gpu.end_compute(0.5) == pytest.approx(A100.time(0.5, 1005))
    assert time.now - start == pytest.approx(A100.time(0.5, 1005))
    assert gpu.energy() - joules == pytest.approx(A100.energy(0.5, 1005), rel=1e-12)
    gpu.set_clock(705)  # below the cap: as set
    assert gpu.clock == 705
    gpu.reset_clock()
    assert gpu.clock == 1005
    with pytest.raises(ValueError, match="has no clock 1000 MHz to cap at"):
        SimulatedGPU("A100", clock_cap=1000)


@pytest.fixture()
def profile(tmp_path):
    rows = [ProfileRow(s, 0, s, 0, name, option.frequency, option.time, option.energy)
            for (s, name), options in _options(2).items() for option in options[::8]]
    path = tmp_path / "merak+m+p+dp1+pp2+tp1+mbs1.csv"
    write_profile(str(path), rows)
    return path


def _plan(profile, out, *extra) -> Frontier:
    assert cli.main(["plan", str(profile), "--num-stages", "2", "--num-microbatches", "4", "--p2p-power", str(P2P),
                     "--out", str(out), "--points", "6", *extra]) == 0
    frontier = read_frontier(str(out / "frontier.json"))
    frontier.check("1f1b", 2, 4, 1)
    return frontier


def _planner(profile, instruction_overhead):
    planner = FrequencyPlanner(step_graph("1f1b", 2, 4), read_profile(str(profile)), P2P,
                               instruction_overhead=instruction_overhead)
    planner.fastest()  # the command's order of solves
    return planner, planner.frontier(6)


def test_cli_frontier_includes_both_overheads(profile, tmp_path):
    frontier = _plan(profile, tmp_path / "plan", "--step-overhead", "0.01", "--instruction-overhead", "0.001")
    planner, points = _planner(profile, 0.001)
    assert planner.fastest_time() > FrequencyPlanner(planner.graph, read_profile(str(profile)), P2P).fastest_time()
    first = frontier.points[0]
    assert first.iteration_time == pytest.approx(planner.fastest_time() + 0.01, abs=1e-12)
    assert first.energy == pytest.approx(points[0].energy + 2 * P2P * 0.01, rel=1e-12)
    assert [p.iteration_time for p in frontier.points] == pytest.approx([p.iteration_time + 0.01 for p in points])
    report = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert (report["instruction_overhead_s"], report["step_overhead_s"]) == (0.001, 0.01)
    with pytest.raises(SystemExit) as stop:
        cli.main(["plan", str(profile), "--num-stages", "2", "--num-microbatches", "4", "--p2p-power", "80",
                  "--out", str(tmp_path / "bad"), "--step-overhead", "-1"])
    assert stop.value.code == 2 and not (tmp_path / "bad").exists()


def test_cli_reads_the_overheads_measured_with_the_profile(profile, tmp_path):
    write_overheads(str(profile), Overheads(0.002, 0.02))
    frontier = _plan(profile, tmp_path / "measured")
    planner, points = _planner(profile, 0.002)
    assert frontier.points[0].iteration_time == pytest.approx(planner.fastest_time() + 0.02, abs=1e-12)
    assert frontier.points[0].energy == pytest.approx(points[0].energy + 2 * P2P * 0.02, rel=1e-12)
    # an option given on the command line wins over the file
    overridden = _plan(profile, tmp_path / "overridden", "--step-overhead", "0")
    assert overridden.points[0].iteration_time == pytest.approx(planner.fastest_time(), abs=1e-12)
