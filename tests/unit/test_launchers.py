"""Launching through Hydra launchers: the merak_slurm preset, SLURM task environments, sweep summaries."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.utils import JobReturn, JobStatus
from hydra.types import RunMode
from omegaconf import OmegaConf

from merak.config import ConfigError
from merak.distributed import groups, launch
from merak.report.curves import drawn_steps
from merak.report.sweep import SweepSummary, collect, format_table
from merak.report.sweep import main as sweep_main

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.parent.parent.name for p in REPO.glob("recipes/*/conf/train.yaml"))
SLURM_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
              "SLURM_LOCALID", "SLURM_STEP_ID", "SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST")


def _compose(recipe: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(REPO / "recipes" / recipe / "conf"), version_base=None):
        return compose("train", overrides=overrides, return_hydra_config=True)


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_finds_the_slurm_preset_and_the_sweep_callback(recipe):
    cfg = _compose(recipe, ["hydra/launcher=merak_slurm", "hydra.launcher.nodes=1"])
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    world = cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp
    assert launcher.tasks_per_node == world and launcher.nodes == 1
    assert cfg.hydra.callbacks.sweep_summary._target_ == "merak.report.sweep.SweepSummary"


@pytest.mark.parametrize("overrides,nodes,tasks", [
    (["parallel=dp2_tp2_pp2", "hydra.launcher.nodes=2"], 2, 4),
    (["parallel=dp2_tp2_pp2", "hydra.launcher.nodes=8"], 8, 1),
    (["parallel=pp2"], 1, 2),
    (["parallel=dp4_pp2", "parallel.tp=2", "hydra.launcher.nodes=4"], 4, 4),
    (["parallel=pp4", "hydra.launcher.nodes=2", "hydra.launcher.tasks_per_node=1"], 2, 1),  # explicit wins
])
def test_slurm_tasks_follow_the_layout(overrides, nodes, tasks):
    cfg = _compose("gpt", ["hydra/launcher=merak_slurm", *overrides])
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert (launcher["nodes"], launcher["tasks_per_node"]) == (nodes, tasks)
    assert launcher["cpus_per_task"] == cfg.launcher.threads_per_rank
    assert launcher["submitit_folder"].endswith("/.submitit/%j")


def test_uneven_spread_over_nodes_says_what_to_change():
    cfg = _compose("gpt", ["hydra/launcher=merak_slurm", "parallel=dp2_tp2_pp2", "hydra.launcher.nodes=3"])
    with pytest.raises(Exception, match=r"= 8 ranks cannot be spread evenly over hydra.launcher.nodes=3"):
        OmegaConf.to_container(cfg.hydra.launcher, resolve=True)


def test_submitit_writes_one_task_per_rank_into_the_sbatch_script(tmp_path, monkeypatch):
    """The sbatch script submitit would submit, from the launcher the preset configures (a stand-in
    srun on PATH: submitit only checks that it exists)."""
    import submitit
    from hydra.utils import instantiate
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    (tmp_path / "srun").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    cfg = _compose("gpt", ["hydra/launcher=merak_slurm", "parallel=dp2_tp2_pp2", "hydra.launcher.nodes=2",
                           "hydra.launcher.partition=gpu", "hydra.launcher.gpus_per_node=4",
                           f"hydra.sweep.dir={tmp_path}/sweep"])
    params = dict(instantiate(cfg.hydra.launcher).params)
    # What BaseSubmititLauncher.launch does with its params:
    executor = submitit.AutoExecutor(folder=params.pop("submitit_folder"), cluster="slurm",
                                     slurm_max_num_timeout=params.pop("max_num_timeout"))
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})
    script = executor._executor._make_submission_file_text("python -u -m submitit.core._submit FOLDER", "uid")
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --partition=gpu",
                 "#SBATCH --gpus-per-node=4", "#SBATCH --cpus-per-task=1"):
        assert line in script, script
    assert "\nsrun " in script


@pytest.fixture
def clean_env(monkeypatch):
    # setenv first, so monkeypatch records each variable's state and also undoes what
    # _adopt_slurm_environment writes to os.environ directly (delenv of an unset name records nothing,
    # and RANK/WORLD_SIZE left behind made later tests join a world that does not exist).
    for name in SLURM_VARS:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


def _slurm_task(env, **values):
    defaults = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
                "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[01-02]"}
    for name, value in {**defaults, **values}.items():
        if value is not None:
            env.setenv(name, value)


def test_srun_task_derives_rank_and_master(clean_env):
    _slurm_task(clean_env)
    assert launch.existing_world_size() == 4
    groups._adopt_slurm_environment()
    assert {name: os.environ[name] for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")} \
        == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "node01", "MASTER_PORT": "24242"}


def test_the_step_node_list_wins_and_exports_win(clean_env):
    _slurm_task(clean_env, SLURM_STEP_NODELIST="gpu[7-8]")
    groups._adopt_slurm_environment()
    assert os.environ["MASTER_ADDR"] == "gpu7"
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        clean_env.delenv(name)
    _slurm_task(clean_env)
    clean_env.setenv("MASTER_ADDR", "head")
    clean_env.setenv("MASTER_PORT", "1234")
    groups._adopt_slurm_environment()
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("head", "1234")


def test_srun_without_any_node_list_says_what_to_export(clean_env):
    _slurm_task(clean_env, SLURM_JOB_NODELIST=None)
    with pytest.raises(RuntimeError, match="export MASTER_ADDR"):
        groups._adopt_slurm_environment()


def test_a_torchrun_world_is_left_alone(clean_env):
    _slurm_task(clean_env)
    clean_env.setenv("RANK", "0")
    groups._adopt_slurm_environment()
    assert "MASTER_ADDR" not in os.environ


@pytest.mark.parametrize("nodelist,first", [
    ("node01", "node01"), ("node[01-02]", "node01"), ("node[05,01-02],gpu7", "node05"), ("a[1-2],b3", "a1"),
    ("rack[1-2]-n[3-4]", "rack1-n3"), ("n[001-004]-ib,x", "n001-ib"), ("node1,node2", "node1"),
])
def test_first_host_of_a_node_list(nodelist, first):
    assert groups.first_slurm_host(nodelist) == first


def test_master_port_comes_from_the_job_id():
    assert groups.slurm_master_port("4242") == "24242"
    assert groups.slurm_master_port("123456") == str(20000 + 123456 % 40000)
    assert groups.slurm_master_port(None) == "29500"


def _job_config(sweep: Path, num: int, overrides: list[str], layout=(1, 1, 2)):
    return OmegaConf.create({
        "parallel": dict(zip(("dp", "tp", "pp"), layout)), "trainer": {"train_schedule": "1f1b"},
        "hydra": {"mode": RunMode.MULTIRUN, "sweep": {"dir": str(sweep)}, "launcher": {"_target_": "x.BasicLauncher"},
                  "overrides": {"task": overrides, "hydra": []},
                  "job": {"num": num}, "runtime": {"output_dir": str(sweep / str(num))}}})


def test_sweep_summary_lists_ok_and_failed_jobs(tmp_path, clean_env, capsys):
    sweep = tmp_path / "sweep"
    callback = SweepSummary()
    callback.on_multirun_start(config=_job_config(sweep, 0, []))
    jobs = [(["model=toy", "parallel=pp2"], JobStatus.COMPLETED, {}),
            (["model=toy", "parallel=dp2"], JobStatus.FAILED, ConfigError("invalid configuration:\n  - bad dp"))]
    for num, (overrides, status, value) in enumerate(jobs):
        (sweep / str(num)).mkdir(parents=True)
        if status == JobStatus.COMPLETED:
            (sweep / str(num) / "summary.json").write_text(json.dumps({
                "layout": {"dp": 1, "tp": 1, "pp": 2}, "schedule": "gpipe", "final_loss": 3.25,
                "final_learning_rate": 5e-5, "eval": {"step": 2, "eval_loss": 3.5},
                "median_step_time_s": 0.125, "samples_per_s": 128.0, "tokens_per_s": 4096.0}))
            (sweep / str(num) / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in (
                {"step": 1, "loss": 4.0, "learning_rate": 1e-4}, {"step": 2, "loss": 3.25, "learning_rate": 5e-5},
                {"step": 2, "eval_loss": 3.5})) + "\n")
        callback.on_job_end(config=_job_config(sweep, num, overrides, layout=(2, 1, 1)),
                            job_return=JobReturn(overrides=overrides, status=status, _return_value=value))
    callback.on_multirun_end(config=_job_config(sweep, 0, []))
    summary = json.loads((sweep / "sweep_summary.json").read_text())
    assert (summary["num_jobs"], summary["num_ok"], summary["num_failed"]) == (2, 1, 1)
    ok, failed = summary["jobs"]
    assert ok["status"] == "ok" and ok["final_loss"] == 3.25 and ok["schedule"] == "gpipe"
    assert ok["eval_loss"] == 3.5 and ok["final_learning_rate"] == 5e-5
    assert failed["eval_loss"] is None and failed["final_learning_rate"] is None
    assert failed["status"] == "failed" and failed["layout"] == {"dp": 2, "tp": 1, "pp": 1}
    assert failed["error"] == "ConfigError: invalid configuration: - bad dp"
    table = (sweep / "sweep_summary.md").read_text()
    assert "shared overrides: model=toy" in table
    assert "| job | overrides    | dp/tp/pp | schedule | final loss | eval loss | final lr | step time (ms) |" in table
    assert ("| 0   | parallel=pp2 | 1/1/2    | gpipe    |     3.2500 |    3.5000 | 5.00e-05 |          125.0 |"
            "     128.0 |    4,096 | ok") in table, table
    # loss.png compares the jobs that logged steps (the failed job wrote no metrics.jsonl).
    assert drawn_steps(sweep / "loss.png") == {"job 0 parallel=pp2: train": [1, 2], "job 0 parallel=pp2: eval": [2]}
    assert "- job 1 failed: ConfigError: invalid configuration: - bad dp" in table
    # Jobs of an earlier sweep into the same directory are not listed again; a job whose process died
    # before reporting is listed as failed.
    callback.on_multirun_start(config=_job_config(sweep, 0, []))
    hydra_dir = sweep / "2" / ".hydra"
    hydra_dir.mkdir(parents=True)
    (hydra_dir / "overrides.yaml").write_text("- parallel=pp4\n")
    (hydra_dir / "hydra.yaml").write_text("hydra:\n  job:\n    num: 2\n")
    rows = collect(sweep, [], callback._before)
    assert [(r["job"], r["status"]) for r in rows] == [(2, "failed")]
    assert "killed" in rows[0]["error"]
    callback.on_multirun_end(config=_job_config(sweep, 0, []))
    # Written again from the files alone, as after a sweep whose launching process stopped waiting.
    (sweep / "sweep_summary.json").unlink()
    sweep_main([str(sweep)])
    assert "sweep summary: 3 jobs, 1 ok, 2 failed" in capsys.readouterr().out
    assert json.loads((sweep / "sweep_summary.json").read_text())["num_jobs"] == 3


def test_single_runs_write_no_job_file(tmp_path, clean_env):
    config = _job_config(tmp_path, 0, [])
    config.hydra.mode = RunMode.RUN
    SweepSummary().on_job_end(config=config, job_return=JobReturn(status=JobStatus.COMPLETED))
    assert not (tmp_path / "0").exists()


def test_format_table_of_no_shared_overrides():
    rows = [{"job": 0, "overrides": ["a=1"], "status": "ok", "layout": None, "schedule": None, "error": None,
             "final_loss": None, "median_step_time_s": None, "samples_per_s": None, "tokens_per_s": None}]
    assert "| 0   | (none)" in format_table(rows)


@pytest.mark.recipe
@pytest.mark.timeout(180)
def test_submitit_local_launcher_runs_a_sweep_point(tmp_path, cache_dir):
    """hydra/launcher=submitit_local: the job runs in a subprocess that submitit starts and waits for."""
    sweep = tmp_path / "sweep"
    env = {k: v for k, v in os.environ.items() if k not in SLURM_VARS}
    env.update(MERAK_CACHE_DIR=str(cache_dir), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, str(REPO / "recipes/gpt/train.py"), "-m", "hydra/launcher=submitit_local", "model=toy",
         "parallel=single", "trainer.max_steps=2", "trainer.per_device_train_batch_size=2",
         "trainer.gradient_accumulation_steps=4", f"hydra.sweep.dir={sweep}"],
        cwd=REPO, env=env, check=False, capture_output=True, text=True, timeout=170)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((sweep / "0" / "summary.json").read_text())
    assert summary["layout"] == {"dp": 1, "tp": 1, "pp": 1} and summary["steps"] == 2
    assert list((sweep / ".submitit").glob("*/*_0_log.out"))  # it ran as a submitit job
    table = json.loads((sweep / "sweep_summary.json").read_text())
    assert [(j["job"], j["status"]) for j in table["jobs"]] == [(0, "ok")]
    assert table["jobs"][0]["final_loss"] == pytest.approx(summary["final_loss"])


@pytest.mark.parametrize("task,hydra_overrides,warned", [
    (["parallel=pp2,dp2", "model=toy"], [], True),
    (["parallel.pp=2,4"], [], True),
    (["parallel=pp2,dp2"], ["hydra.launcher.tasks_per_node=2"], False),
    (["parallel=pp2", "trainer.learning_rate=1e-3,3e-4"], [], False),
])
def test_sweeping_layouts_under_slurm_warns(task, hydra_overrides, warned, monkeypatch):
    from merak.report import sweep

    messages = []
    monkeypatch.setattr(sweep.logger, "warning", lambda message, *args: messages.append(message % args))
    config = OmegaConf.create({"hydra": {
        "launcher": {"_target_": "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"},
        "overrides": {"task": task, "hydra": hydra_overrides}}})
    sweep._warn_if_slurm_tasks_cannot_follow(config)
    assert bool(messages) == warned
    if warned:
        assert "every SLURM job of a sweep gets the same tasks" in messages[0]
