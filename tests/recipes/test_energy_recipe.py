"""Energy end to end on simulated GPUs: profile -> merak-energy plan -> run the plan, locally and
through a zeus server on 127.0.0.1.

The runs train in this process (``run_in_process``: workers forked from it); only the zeus server is
a process of its own. What is asserted is simulated or counted (clocks, instruction counts, power,
switches, energies against the frontier's predictions), never how long a step took on this shared
machine: whether a plan meets its predicted step time is a benchmark's question (bench/)."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from train_py import recipe_env, run_in_process

from merak.config import ConfigError
from merak.distributed.launch import free_port
from merak.energy import cli
from merak.energy.dag import step_graph
from merak.energy.frontier import read_frontier
from merak.energy.hooks import FrequencyPlanHook
from merak.energy.plans import read_plan, write_plan
from merak.energy.profile_csv import COLUMNS
from merak.energy.simulated import gpu_spec

pytestmark = pytest.mark.recipe

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "merak.energy.cli"]
# The seeds' plan (blocks on both stages), on which the step-time margins below were measured.
TOY = ["model=toy", "parallel=pp2", "trainer.per_device_train_batch_size=2", "trainer.disable_tqdm=true",
       "trainer.split_method=farthest_min_deps", "trainer.partition_method=uniform"]
STEPS = 3
CLOCK_STEP = 45  # MHz between profiled clocks: 27 of the simulated A100's 81
STEP = ["trainer.gradient_accumulation_steps=4", f"trainer.max_steps={STEPS}"]


def _plan(*args: str) -> None:
    """``merak-energy plan`` in this process (its command line: tests/unit/test_energy_cli_numbers.py)."""
    assert cli.main(["plan", *args]) == 0


def _train(args, output_dir: Path) -> dict:
    return run_in_process("gpt", [*TOY, *args], output_dir)


def _energy(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())["energy"]


@pytest.fixture(scope="module")
def toy_profile(tmp_path_factory, cache_dir) -> Path:
    """The toy pipeline's instruction profile on a simulated A100 (one run for the module's tests), at
    every third of its 81 clocks (1410, 1365, ... 240 MHz)."""
    profile_dir = tmp_path_factory.mktemp("profile")
    _train(["trainer.gradient_accumulation_steps=1", "trainer.profile=true", "trainer.num_warmup_steps=1",
            "trainer.num_prof_steps=1", f"trainer.profile_clock_step={CLOCK_STEP}"], profile_dir)
    return profile_dir / "merak+toy+uniform+dp1+pp2+tp1+mbs2.csv"


@pytest.fixture
def applied_clocks(tmp_path, monkeypatch):
    """Every clock a frequency plan sets, as ``(stage, instruction, MHz the GPU then runs at)`` per stage, in
    order: each forked worker appends to its own file."""
    folder = tmp_path / "clocks"
    folder.mkdir()
    original = FrequencyPlanHook.on_instruction_begin

    def recording(self, event):
        original(self, event)
        with open(folder / f"{os.getpid()}.txt", "a") as handle:
            handle.write(f"{self.stage} {event.plan_name} {self.device.clock}\n")

    monkeypatch.setattr(FrequencyPlanHook, "on_instruction_begin", recording)

    def read() -> dict[int, list[tuple[str, int]]]:
        stages: dict[int, list[tuple[str, int]]] = {}
        for path in sorted(folder.glob("*.txt")):
            for line in path.read_text().splitlines():
                stage, name, clock = line.split()
                stages.setdefault(int(stage), []).append((name, int(clock)))
        return stages

    return read


@pytest.mark.timeout(600)
def test_profile_plan_and_run_the_plan(tmp_path, cache_dir, toy_profile, applied_clocks):
    path, profile_dir = toy_profile, toy_profile.parent
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        assert reader.fieldnames == COLUMNS
        rows = list(reader)
    summary = json.loads((profile_dir / "summary.json").read_text())
    profiled = summary["clocks_profiled"]
    every_third = list(range(1410, 209, -CLOCK_STEP))
    assert summary["highest_clock"] == 1410 and summary["clocks_supported"] == 81
    assert len(every_third) / 2 <= profiled <= len(every_third)  # it may stop past the energy minimum
    assert sorted({int(r["frequency"]) for r in rows}, reverse=True) == every_third[:profiled]
    assert summary["steps"] == 2 * profiled  # one warm-up and one measured step per clock
    assert {(r["stage"], r["instruction"]) for r in rows} == {(s, n) for s in "01" for n in ("forward", "backward")}
    assert len(rows) == 4 * profiled
    # The last stage (the LM head) is all simulated work: while it computes, the simulated A100 draws
    # its busy power at the locked clock, whatever the instruction took on this machine.
    a100 = gpu_spec("A100")
    last = [r for r in rows if r["stage"] == "1" and r["instruction"] == "backward"]
    for row in last:
        watts = float(row["energy"]) / float(row["time"])
        assert watts == pytest.approx(a100.busy_power(int(row["frequency"])), rel=0.05), row
    energies = [float(r["energy"]) for r in rows if r["stage"] == "1" and r["instruction"] == "forward"]
    assert min(energies) < 0.8 * energies[0]  # the highest clock is far from the cheapest

    plan_dir = tmp_path / "plan"
    _plan(str(path), "--num-stages", "2", "--num-microbatches", "4", "--schedule", "1f1b", "--p2p-power", "80",
          "--out", str(plan_dir), "--points", "20")
    report = json.loads((plan_dir / "plan.json").read_text())
    with open(plan_dir / "frontier.csv") as handle:
        frontier = list(csv.DictReader(handle))
    times = [float(r["iteration_time"]) for r in frontier]
    energies = [float(r["energy"]) for r in frontier]
    assert times == sorted(times) and energies == sorted(energies, reverse=True) and len(frontier) >= 3
    assert report["plan"]["iteration_time"] == pytest.approx(report["all_highest_clock"]["iteration_time"], rel=1e-9)
    # At the fastest step the plan saves what the measured profile leaves as slack: nothing, when this
    # shared machine's load gave the stages equal times. Slower frontier points always save.
    assert report["plan"]["energy"] <= report["all_highest_clock"]["energy"]
    assert energies[-1] < report["all_highest_clock"]["energy"]
    assert (plan_dir / "frontier.png").stat().st_size > 0
    # The prediction includes the host's overheads the profile run measured (transfers around each
    # instruction, the tied-embedding all-reduce and optimizer step after the last one).
    overheads = json.loads(path.with_suffix(".overheads.json").read_text())
    assert overheads["step_overhead_s"] > 0 and overheads["instruction_overhead_s"] >= 0
    assert report["step_overhead_s"] == overheads["step_overhead_s"]

    planned = tmp_path / "planned"
    _train([*STEP, f"trainer.frequency_plan={plan_dir / 'plan.py'}"], planned)
    # Every step ran each stage's plan, instruction by instruction, at the plan's clocks (a plan that
    # does not fit the schedule stops the run: PlanMismatchError).
    plans = read_plan(str(plan_dir / "plan.py"))
    assert applied_clocks() == {stage: plan * STEPS for stage, plan in enumerate(plans)}
    assert any(mhz < 1410 for plan in plans for _, mhz in plan)  # the plan slows some instruction
    measured = _energy(planned)
    assert measured["plan"] == str(plan_dir / "plan.py") and measured["device"] == "simulated A100"
    assert measured["measured_steps"] == STEPS - 1 and measured["iteration_energy_j"] > 0  # the first step warms up
    assert [r["steps"] for r in measured["ranks"]] == [STEPS - 1] * 2


def _pipelines(run_dir: Path) -> tuple[dict, list[dict]]:
    energy = _energy(run_dir)
    return energy, energy["pipelines"]


@pytest.mark.timeout(600)
def test_straggler_aware_plans_slow_the_fast_pipeline(tmp_path, cache_dir, toy_profile):
    """dp=2 x pp=2, pipeline 1's simulated GPUs capped at 1005 MHz: pipeline 0 moves along the frontier
    to a point predicted to finish within the straggler's time, and uses the energy the frontier
    predicts for that point over the job's step, a real saving over the fastest point's."""
    plan_dir = tmp_path / "plan"
    _plan(str(toy_profile), "--num-stages", "2", "--num-microbatches", "8", "--p2p-power", "80",
          "--out", str(plan_dir), "--points", "40")
    frontier = read_frontier(str(plan_dir / "frontier.json"))
    adapted = tmp_path / "adapted"
    _train(["parallel=dp2_pp2", "trainer.gradient_accumulation_steps=8",
            f"trainer.frequency_frontier={plan_dir / 'frontier.json'}", "trainer.simulated_straggler_pipeline=1",
            "trainer.simulated_straggler_clock=1005", "trainer.max_steps=7", "trainer.straggler_window=3"], adapted)
    after, after_pipelines = _pipelines(adapted)

    # Pipeline 0 moves to a slower point (decisions after steps 1-3 and, with more steps, every 3 steps
    # after: a later window may correct it when the straggler's time moved by more than the hysteresis);
    # the straggler stays on the fastest.
    assert after["switches"] and all(s["pipeline"] == 0 for s in after["switches"])
    assert after["switches"][0]["step"] == 4  # the first decision, after steps 1-3
    assert after["base_point"] == 0
    slowed = after_pipelines[0]["point"]
    assert slowed > 0 and after_pipelines[1]["point"] == 0
    # The least-energy point predicted to finish within the straggler's time as measured when it was chosen,
    # less the margin and pipeline 0's own excess over the prediction (the target moves with this machine's
    # load afterwards; within the hysteresis nothing switches again).
    chosen = [switch for switch in after["switches"] if switch["pipeline"] == 0][-1]
    assert chosen["after"] == slowed
    times = [point.iteration_time for point in frontier.points]
    assert times[slowed] <= chosen["limit"] and (slowed + 1 == len(times) or times[slowed + 1] > chosen["limit"])
    # The frontier's prediction for pipeline 0's point over the job's step, as reported; at that step, the
    # fastest point would use a tenth more.
    step = after["iteration_time_s"]
    predicted = frontier.energy_at(slowed, step)
    assert after_pipelines[0]["predicted_energy_at_job_step_j"] == pytest.approx(predicted, rel=1e-9)
    assert frontier.energy_at(0, step) - predicted > 0.1 * frontier.energy_at(0, step)  # a real saving
    # (The measured energy against that prediction depends on this machine's load: a benchmark's question.)


def _wait_for(url: str, server: subprocess.Popen, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the zeus server exited: {server.stdout.read()[-3000:]}")
        try:
            httpx.get(url + "/docs", timeout=2.0)
            return
        except httpx.HTTPError:
            time.sleep(0.3)
    raise AssertionError("the zeus server did not start within a minute")


@pytest.mark.timeout(400)
def test_zeus_server_serves_the_plan_and_receives_results(tmp_path, cache_dir):
    pytest.importorskip("zeus")
    graph = step_graph("1f1b", 2, 4)
    plans = [[(name, 1410 if name == "backward" else 1005) for name in graph.stage_names(s)] for s in range(2)]
    write_plan(str(tmp_path / "plan.py"), plans)
    port, dump = free_port(), tmp_path / "dump"
    server = subprocess.Popen([*CLI, "serve", str(tmp_path / "plan.py"), "--port", str(port), "--dump-dir", str(dump)],
                              cwd=REPO, env=recipe_env(cache_dir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_for(url, server)
        run_dir = tmp_path / "run"
        _train(["trainer.gradient_accumulation_steps=4", "trainer.max_steps=5", f"trainer.pfo_server_url={url}",
                "trainer.num_warmup_steps=1", "trainer.num_prof_steps=2"], run_dir)
        energy = _energy(run_dir)
        job = energy["zeus_job_id"]
        assert job and "MerakPlan3D" in job
        results = json.loads((dump / job / "0.prof.json").read_text())
        assert sorted(r["rank"] for r in results) == [0, 1]
        for result in results:
            assert len(result["iter_time"]) == 2 and len(result["iter_energy"]) == 2
            assert set(result["time_breakdown"]) == {"forward", "backward"}
            assert [len(step) for step in result["time_breakdown"]["forward"]] == [4, 4]
        schedules = json.loads((dump / job / "0.sched.json").read_text())
        assert [[tuple(x) for x in s["frequencies"]] for s in sorted(schedules, key=lambda s: s["rank"])] == plans
        assert energy["iteration_energy_j"] > 0
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def test_bad_energy_settings_fail_before_launch(tmp_path, cache_dir):
    """Both problems at once, before any worker starts (train.py's status 2 for a ConfigError:
    tests/recipes/test_console.py)."""
    unreachable = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConfigError) as error:
        _train(["trainer.gradient_accumulation_steps=4", "trainer.profile=true",
                f"trainer.pfo_server_url={unreachable}"], tmp_path / "run")
    for expected in ("are exclusive", "cannot reach the zeus server"):
        assert expected in str(error.value)
    assert not (tmp_path / "run" / "summary.json").exists()
