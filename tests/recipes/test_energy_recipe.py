"""Energy end to end on simulated GPUs: profile -> merak-energy plan -> run the plan, locally and
through a zeus server on 127.0.0.1."""

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
from train_py import recipe_env

from merak.distributed.launch import free_port
from merak.energy.dag import step_graph
from merak.energy.frontier import read_frontier
from merak.energy.plans import write_plan
from merak.energy.profile_csv import COLUMNS

pytestmark = pytest.mark.recipe

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "recipes/gpt/train.py"
CLI = [sys.executable, "-m", "merak.energy.cli"]
# The seeds' plan (blocks on both stages), on which the step-time margins below were measured.
TOY = ["model=toy", "parallel=pp2", "trainer.per_device_train_batch_size=2", "trainer.disable_tqdm=true",
       "trainer.split_method=farthest_min_deps", "trainer.partition_method=uniform"]
STEP = ["trainer.gradient_accumulation_steps=4", "trainer.max_steps=5"]


def _run(command, cache_dir, timeout=300) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=REPO, env=recipe_env(cache_dir), capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result


def _train(args, cache_dir, timeout=300) -> subprocess.CompletedProcess:
    return _run([sys.executable, str(TRAIN), *TOY, *args], cache_dir, timeout)


def _energy(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())["energy"]


@pytest.fixture(scope="module")
def toy_profile(tmp_path_factory, cache_dir) -> Path:
    """The toy pipeline's instruction profile on a simulated A100 (one run for the module's tests)."""
    profile_dir = tmp_path_factory.mktemp("profile")
    _train(["trainer.gradient_accumulation_steps=1", "trainer.profile=true", "trainer.num_warmup_steps=1",
            "trainer.num_prof_steps=1", f"hydra.run.dir={profile_dir}"], cache_dir)
    return profile_dir / "merak+toy+uniform+dp1+pp2+tp1+mbs2.csv"


@pytest.mark.timeout(600)
def test_profile_plan_and_run_the_plan(tmp_path, cache_dir, toy_profile):
    path, profile_dir = toy_profile, toy_profile.parent
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        assert reader.fieldnames == COLUMNS
        rows = list(reader)
    summary = json.loads((profile_dir / "summary.json").read_text())
    profiled = summary["clocks_profiled"]
    assert summary["highest_clock"] == 1410 and 40 <= profiled <= 81
    assert {(r["stage"], r["instruction"]) for r in rows} == {(s, n) for s in "01" for n in ("forward", "backward")}
    assert len(rows) == 4 * profiled
    # The last stage (the LM head) is all simulated work: its time follows the A100 model,
    # time(f) / time(1410) = 0.3 + 0.7 * 1410 / f, within the noise of sleeping.
    last = {int(r["frequency"]): float(r["time"]) for r in rows if r["stage"] == "1" and r["instruction"] == "backward"}
    for clock in (1005, 810):
        if clock in last:
            assert last[clock] / last[1410] == pytest.approx(0.3 + 0.7 * 1410 / clock, rel=0.05)
    energies = [float(r["energy"]) for r in rows if r["stage"] == "1" and r["instruction"] == "forward"]
    assert min(energies) < 0.8 * energies[0]  # the highest clock is far from the cheapest

    plan_dir = tmp_path / "plan"
    _run([*CLI, "plan", str(path), "--num-stages", "2", "--num-microbatches", "4", "--schedule", "1f1b",
          "--p2p-power", "80", "--out", str(plan_dir), "--points", "20"], cache_dir)
    report = json.loads((plan_dir / "plan.json").read_text())
    with open(plan_dir / "frontier.csv") as handle:
        frontier = list(csv.DictReader(handle))
    times = [float(r["iteration_time"]) for r in frontier]
    energies = [float(r["energy"]) for r in frontier]
    assert times == sorted(times) and energies == sorted(energies, reverse=True) and len(frontier) >= 3
    assert report["plan"]["iteration_time"] == pytest.approx(report["all_highest_clock"]["iteration_time"], rel=1e-9)
    assert report["plan"]["energy"] < report["all_highest_clock"]["energy"]
    assert (plan_dir / "frontier.png").stat().st_size > 0

    planned, baseline = tmp_path / "planned", tmp_path / "baseline"
    _train([*STEP, f"trainer.frequency_plan={plan_dir / 'plan.py'}", f"hydra.run.dir={planned}"], cache_dir)
    _train([*STEP, "trainer.energy_device=simulated", f"hydra.run.dir={baseline}"], cache_dir)
    measured, reference = _energy(planned), _energy(baseline)
    # The prediction includes the host's overheads the profile run measured (transfers around each
    # instruction, the tied-embedding all-reduce and optimizer step after the last one).
    overheads = json.loads(path.with_suffix(".overheads.json").read_text())
    assert 0 < overheads["step_overhead_s"] < 0.5 and 0 <= overheads["instruction_overhead_s"] < 0.05
    assert report["step_overhead_s"] == overheads["step_overhead_s"]
    assert measured["iteration_time_s"] == pytest.approx(report["plan"]["iteration_time"], rel=0.05)
    assert measured["iteration_energy_j"] == pytest.approx(report["plan"]["energy"], rel=0.05)
    # Stage 0 (the embedding) is CPU-bound at the highest clock: its instructions overrun the simulated
    # GPU by what the CPU happens to take, so the all-highest-clock run strays further.
    assert reference["iteration_energy_j"] == pytest.approx(report["all_highest_clock"]["energy"], rel=0.12)
    assert measured["iteration_energy_j"] < reference["iteration_energy_j"]
    assert measured["iteration_time_s"] < 1.05 * reference["iteration_time_s"]


def _pipelines(run_dir: Path) -> tuple[dict, list[dict]]:
    energy = _energy(run_dir)
    return energy, energy["pipelines"]


@pytest.mark.timeout(600)
def test_straggler_aware_plans_slow_the_fast_pipeline(tmp_path, cache_dir, toy_profile):
    """dp=2 x pp=2, pipeline 1's simulated GPUs capped at 1005 MHz: pipeline 0 moves along the frontier
    to the straggler's time, the step takes as long as with the straggler alone, and pipeline 0's
    energy drops by what the frontier predicts."""
    plan_dir = tmp_path / "plan"
    _run([*CLI, "plan", str(toy_profile), "--num-stages", "2", "--num-microbatches", "8", "--p2p-power", "80",
          "--out", str(plan_dir), "--points", "40"], cache_dir)
    frontier = read_frontier(str(plan_dir / "frontier.json"))
    common = ["parallel=dp2_pp2", "trainer.gradient_accumulation_steps=8",
              f"trainer.frequency_frontier={plan_dir / 'frontier.json'}", "trainer.simulated_straggler_pipeline=1",
              "trainer.simulated_straggler_clock=1005"]
    alone, adapted = tmp_path / "straggler-alone", tmp_path / "adapted"
    _train([*common, "trainer.max_steps=9", "trainer.straggler_window=0", f"hydra.run.dir={alone}"], cache_dir)
    _train([*common, "trainer.max_steps=13", "trainer.straggler_window=3", f"hydra.run.dir={adapted}"], cache_dir)
    before, before_pipelines = _pipelines(alone)
    after, after_pipelines = _pipelines(adapted)

    assert before["switches"] == [] and [p["point"] for p in before_pipelines] == [0, 0]
    # Pipeline 0 moves to a slower point (a later window may correct it when the straggler's time
    # moved by more than the hysteresis); the straggler stays on the fastest.
    assert after["switches"] and all(s["pipeline"] == 0 for s in after["switches"])
    assert after["switches"][0]["step"] == 4  # the first decision, after steps 1-3
    slowed = after_pipelines[0]["point"]
    assert slowed > 0 and after_pipelines[1]["point"] == 0
    assert frontier.points[slowed].iteration_time <= after["straggler_target_s"]
    # No longer a step (the decision keeps a 1 % margin below the straggler's time).
    assert after["iteration_time_s"] == pytest.approx(before["iteration_time_s"], rel=0.015)
    # Pipeline 0's energy per step, measured, against the frontier's prediction for each run's step.
    predicted_before = frontier.energy_at(0, before["iteration_time_s"])
    predicted_after = frontier.energy_at(slowed, after["iteration_time_s"])
    measured_drop = before_pipelines[0]["step_energy_j"] - after_pipelines[0]["step_energy_j"]
    assert predicted_before - predicted_after > 0.1 * predicted_before  # a real saving to measure
    assert measured_drop == pytest.approx(predicted_before - predicted_after, rel=0.02)
    assert after_pipelines[0]["energy_error_at_job_step"] == pytest.approx(0, abs=0.02)


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
        _train([*STEP, f"trainer.pfo_server_url={url}", "trainer.num_warmup_steps=1", "trainer.num_prof_steps=2",
                f"hydra.run.dir={run_dir}"], cache_dir)
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
    unreachable = f"http://127.0.0.1:{free_port()}"
    result = subprocess.run([sys.executable, str(TRAIN), *TOY, "trainer.gradient_accumulation_steps=4",
                             "trainer.profile=true", f"trainer.pfo_server_url={unreachable}",
                             f"hydra.run.dir={tmp_path / 'run'}"],
                            cwd=REPO, env=recipe_env(cache_dir), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2  # cannot start: run_command logs the ConfigError (Hydra logs to stdout)
    output = result.stdout + result.stderr
    for expected in ("are exclusive", "cannot reach the zeus server"):
        assert expected in output
    assert not (tmp_path / "run" / "summary.json").exists()
