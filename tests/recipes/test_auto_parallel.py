"""``parallel=auto`` through a recipe's real train.py (the trials, the exit status of a model that fits
nowhere) or in this process: the planner chooses, the run trains what it chose."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from train_py import run_in_process

from merak.autoplan.cli import main as merak_plan
from merak.autoplan.trials import TRIAL_TIE

pytestmark = pytest.mark.recipe

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "recipes/gpt/train.py"


def _train(args, cache_dir, timeout=300, script: Path = TRAIN) -> subprocess.CompletedProcess:
    env = dict(os.environ, MERAK_CACHE_DIR=str(cache_dir), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, str(script), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.timeout(400)
def test_auto_trains_the_layout_its_trials_chose(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    # Two trials (the planner's two leading grids), five steps each.
    result = _train(["model=toy", "parallel=auto", "parallel.world_size=2", "parallel.trials=2",
                     "parallel.trial_steps=5", "parallel.trial_seconds=0", "trainer.global_batch_size=8",
                     "trainer.max_steps=2", f"hydra.run.dir={run_dir}"], cache_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["world_size"] == 2 and plan["global_batch_size"] == 8
    # The two leading grids are in the running: each trained 5 steps; the chosen is the fastest measured,
    # or a layout the planner ranked higher (the trials are in its order) measured within the tie margin.
    trials = plan["trials"]["trials"]
    assert len(trials) >= 2 and len({t["key"].split(" mb")[0] for t in trials}) == len(trials)
    assert all(t["error"] is None and all(len(run) == 5 for run in t["runs_step_times_s"]) for t in trials)
    fastest = min(t["measured_step_s"] for t in trials)
    expected = next(t for t in trials if t["measured_step_s"] <= fastest * (1 + TRIAL_TIE))
    assert plan["trials"]["chosen"] == expected["key"] and plan["trials"]["step_scale"] > 0
    chosen = plan["trials"]["chosen_layout"]
    assert chosen["dp"] * chosen["tp"] * chosen["pp"] == 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["layout"] == {"dp": chosen["dp"], "tp": chosen["tp"], "pp": chosen["pp"]}
    assert summary["global_batch_size"] == 8 and summary["num_microbatches"] == chosen["num_microbatches"]
    assert summary["schedule"] == chosen["schedule"] and summary["steps"] == 2
    printed = result.stdout + result.stderr
    assert "parallel=auto chose" in printed and f"tried {len(trials)} layouts" in printed
    assert "[rank 0]" not in printed.split("parallel=auto chose")[0]  # the trials' workers stay quiet


@pytest.fixture(scope="module")
def gpt2_plan(cache_dir, tmp_path_factory):
    """``merak-plan`` (in this process) for gpt2 on two 8 x H100 servers: (exit status, plan.json, printed).

    It profiles gpt2 at each tensor degree into the session's cache ($MERAK_CACHE_DIR/profiles), where the
    dry run below finds the same profiles (moved here from tests/unit/test_autoplan_cli.py to share them)."""
    out = tmp_path_factory.mktemp("merak-plan") / "plan.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = merak_plan(["gpt", "model=gpt2", "trainer.global_batch_size=16", "--cluster", "h100-80",
                             "--nodes", "2", "--out", str(out), "--top", "3"])
    return status, json.loads(out.read_text()) if out.exists() else None, printed.getvalue()


@pytest.mark.timeout(400)
def test_cli_plans_gpt2_on_two_gpu_servers(gpt2_plan):
    status, payload, printed = gpt2_plan
    assert status == 0
    assert payload["world_size"] == 16
    assert payload["cluster"]["nodes"] == 2 and payload["cluster"]["devices_per_node"] == 8
    best = payload["best"]["layout"]
    assert best["dp"] * best["tp"] * best["pp"] == 16
    assert best["tp"] in (1, 2, 4)  # 12 heads: no tensor degree of 8, and none across nodes
    assert payload["best"]["fits"] and 0 < payload["best"]["mfu"] < 1
    assert payload["compared"] == []
    assert "gpt/gpt2 on 16 x H100-80GB" in printed


@pytest.mark.timeout(400)
def test_auto_dry_run_plans_for_a_gpu_cluster(tmp_path, cache_dir, gpt2_plan):
    """In this process (gpt2's profiles taken by gpt2_plan; train.py's own runs of parallel=auto: above and below)."""
    run_dir = tmp_path / "run"
    # Weightless (meta) like a giant model: the dry run then partitions without computing anything.
    run_in_process("gpt", ["model=gpt2", "parallel=auto", "cluster=h100-80", "cluster.nodes=2",
                           "trainer.init_device=meta", "trainer.global_batch_size=64", "dry_run=true"], run_dir)
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["world_size"] == 16 and plan["cluster"]["accelerator"]["name"].startswith("H100")
    assert plan["best"]["fits"] and plan["best"]["mfu"] > 0
    best = plan["best"]["layout"]
    # The chosen layout is then partitioned as a dry run does, and nothing trains.
    partition = json.loads((run_dir / "partition.json").read_text())
    assert partition["layout"] == {"dp": best["dp"], "tp": best["tp"], "pp": best["pp"]}
    assert not (run_dir / "summary.json").exists()
    # One plan, one set of numbers: the stage table is priced as the plan's first row, on the cluster.
    priced = partition["priced_on_cluster"]
    assert priced["step_s"] == pytest.approx(plan["best"]["predicted_step_s"])
    assert [s["memory_bytes"] for s in priced["stages"]] == plan["best"]["predicted_stage_memory_bytes"]
    assert priced["schedule"].split()[0] == best["schedule"] and priced["zero_stage"] == best["zero_stage"]
    assert len(priced["stages"]) == best["pp"]


@pytest.mark.timeout(300)
def test_auto_names_what_would_fit(tmp_path, cache_dir):
    # 6.7 B parameters with Adam take ~107 GB before any activation: not on one 80 GB device.
    result = _train(["model=gpt3-6.7b", "parallel=auto", "cluster=h100-80", "cluster.devices_per_node=1",
                     "trainer.global_batch_size=8", "dry_run=true", f"hydra.run.dir={tmp_path / 'run'}"], cache_dir)
    assert result.returncode == 2
    printed = result.stdout + result.stderr
    assert "does not fit on 1 x H100" in printed and "try at least 2 devices" in printed
    assert "Traceback" not in printed


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(400)
def test_a_stage_without_parameters_trains_with_zero(tmp_path, cache_dir):
    """A plan the planner may choose: bert's first stage holds only the mask shard (no parameter), and
    ZeRO-1 over dp=2 leaves that stage's ranks nothing to update. It trains as the same microbatches do
    in one pipeline stage (the masked-token mean of each microbatch is the loss, so the comparison keeps
    the microbatches)."""
    common = ["model=toy", "trainer.global_batch_size=16", "trainer.per_device_train_batch_size=8",
              "trainer.max_steps=3", "trainer.activation_checkpointing=false", "parallel.dp=2", "parallel.tp=1"]
    runs = {"one_stage": ["parallel.pp=1"],
            "empty_stage": ["parallel.pp=2", "trainer.zero_optimization=true", "trainer.partition_method=custom",
                            "trainer.custom_partition=[0,1,25]"]}
    # The reference in this process (merak.run as train.py calls it); the empty stage through bert's real
    # train.py (its one run on CPU).
    run_in_process("bert", [*common, *runs["one_stage"]], tmp_path / "one_stage")
    result = _train([*common, *runs["empty_stage"], f"hydra.run.dir={tmp_path / 'empty_stage'}"], cache_dir,
                    script=REPO / "recipes/bert/train.py")
    assert result.returncode == 0, result.stderr[-3000:]
    losses = {name: _losses(tmp_path / name) for name in runs}
    assert losses["empty_stage"] == pytest.approx(losses["one_stage"], rel=1e-6)


@pytest.mark.timeout(300)
def test_auto_runs_the_least_energy_layout_with_its_clock_plan(tmp_path, cache_dir):
    """``parallel.objective=energy@1.2x`` on simulated GPUs: no trials; the run applies the chosen layout's
    frontier (written into the run directory) at the point the objective chose."""
    from merak.energy.frontier import read_frontier

    run_dir = tmp_path / "run"
    summary = run_in_process("gpt", ["model=toy", "parallel=auto", "parallel.world_size=2",
                                     "parallel.objective=energy@1.2x", "trainer.energy_device=simulated",
                                     "trainer.global_batch_size=8", "trainer.max_steps=3",
                                     "trainer.straggler_window=0"], run_dir)
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["objective"] == "energy@1.2x" and "trials" not in plan
    best = plan["best"]
    assert best["energy"]["meets_bound"] and best["energy"]["step_s"] <= best["energy"]["bound_s"] * (1 + 1e-6)
    clock_plan = plan["run_clock_plan"]
    assert clock_plan["frequency_frontier"] == str(run_dir / "frontier.json")
    frontier = read_frontier(clock_plan["frequency_frontier"])
    layout = best["layout"]
    assert summary["layout"] == {"dp": layout["dp"], "tp": layout["tp"], "pp": layout["pp"]}
    energy = summary["energy"]
    assert energy["frontier"] == clock_plan["frequency_frontier"]
    assert energy["base_point"] == frontier.index_within(clock_plan["frontier_deadline"])
    point = frontier.points[energy["base_point"]]
    assert point.iteration_time == pytest.approx(best["energy"]["frontier_time_s"], rel=1e-6)
