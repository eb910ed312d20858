"""The README's API as written (``import Merak``, its "Example usage") and the energy README's
``run.sh``, at toy size."""

from __future__ import annotations

import csv
import json
import math
import sys
import tomllib

import pytest
from seed_runs import BIN, REPO, check_training, run_command, seed_env

pytestmark = pytest.mark.recipe


def test_import_Merak_is_the_installed_merak(tmp_path):
    """Outside the checkout, ``import Merak`` (the original package name) gives merak itself, its
    trainer API still loaded on first use, and ``Merak.<sub>`` the very same submodules."""
    probe = (
        "import sys\n"
        "import Merak\n"
        "import merak\n"
        "assert Merak is merak, Merak\n"
        "assert 'transformers' not in sys.modules  # the trainer API loads on first use\n"
        "from Merak import MerakArguments, MerakTrainer, init, set_tp_layer_lists\n"
        "from merak.hf import MerakTrainer as trainer\n"
        "assert MerakTrainer is trainer and init is merak.init\n"
        "import Merak.distributed.groups as alias\n"
        "import merak.distributed.groups as groups\n"
        "assert alias is groups and alias.__name__ == 'merak.distributed.groups'\n"
        "print('ok', Merak.__file__)\n"
    )
    result = run_command([sys.executable, "-c", probe], cwd=tmp_path, env=seed_env(tmp_path / "cache"), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok ") and result.stdout.split()[1] == str(REPO / "merak" / "__init__.py")


def test_the_package_build_includes_the_Merak_alias():
    """`make setup` (pip install -e .) installs the packages pyproject's find rule selects."""
    from setuptools import find_packages

    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(str(REPO), include=find["include"])
    assert "Merak" in packages and "merak" in packages
    assert not [p for p in packages if p.startswith("Merak.")]  # the alias is one module, not a copy


def test_readme_usage_example_runs_as_written(tmp_path):
    """The README's "Example usage" (``MerakTrainer(do_train=..., model=..., args=..., train_data=...,
    eval_data=...)`` after ``Merak.init(dp, tp, pp)``) at dp=2 x pp=2, from a folder outside the checkout."""
    command = [BIN / "torchrun", "--standalone", "--nproc_per_node=4", REPO / "tests/recipes/seed_usage_script.py"]
    result = run_command(command, cwd=tmp_path, env=seed_env(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr[-3000:]
    # 2 replicas x 2 microbatches x 2 sequences per step; output_dir='./path/to/save' as written.
    check_training(tmp_path / "path/to/save", layout={"dp": 2, "tp": 1, "pp": 2}, global_batch_size=8)


def _run_sh(args, tmp_path, cache_dir, timeout=240, **env):
    return run_command(["bash", REPO / "examples/run.sh", *args], cwd=tmp_path,
                       env=seed_env(cache_dir, RUN_DIR=str(tmp_path / "run"), **env), timeout=timeout)


@pytest.mark.timeout(300)
def test_run_sh_energy_workflow_at_toy_size(tmp_path, cache_dir):
    """``run.sh workflow MODEL MBS NMB``: profile with one microbatch, plan, train with the plan."""
    # Toy size: the toy GPT on 2 processes (pp=2), one profiled step per clock, a 10-point frontier,
    # a simulated GPU 5x the default speed (the profile sleeps less per clock), every tenth clock.
    args = ["workflow", "toy", "2", "4", "--max_steps", "2", "--num_warmup_steps", "0", "--num_prof_steps", "1",
            "--simulated_tflops", "0.02", "--profile_clock_step", "150", "--disable_tqdm", "true"]
    result = _run_sh(args, tmp_path, cache_dir, NUM_GPUS="2", PLAN_POINTS="10")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    for step in ("1/3 profile", "2/3 plan", "3/3 train with the plan"):
        assert f"run.sh: {step}" in result.stdout
    run = tmp_path / "run"

    profile = json.loads((run / "profile/summary.json").read_text())
    assert profile["layout"] == {"dp": 1, "tp": 1, "pp": 2} and profile["device"] == "simulated A100"
    with open(profile["profile"], newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert {(r["stage"], r["instruction"]) for r in rows} == {(s, n) for s in "01" for n in ("forward", "backward")}
    assert len(rows) == 4 * profile["clocks_profiled"] and 5 <= profile["clocks_profiled"] <= 9

    report = json.loads((run / "plan/plan.json").read_text())
    assert report["num_stages"] == 2 and report["num_microbatches"] == 4 and report["schedule"] == "1f1b"
    assert report["plan"]["energy"] <= report["all_highest_clock"]["energy"]

    summary = check_training(run / "train", layout={"dp": 1, "tp": 1, "pp": 2}, global_batch_size=8)
    energy = summary["energy"]
    assert energy["plan"] == str(run / "plan/plan.py") and energy["device"] == "simulated A100"
    assert energy["measured_steps"] >= 1 and math.isfinite(energy["iteration_energy_j"])
    assert energy["iteration_energy_j"] > 0


@pytest.mark.parametrize("args, message", [
    (["toy", "2", "4", "--profile", "true"], "--profile true needs 1 as NUM_MICROBATCHES, got 4"),
    (["llama-7b", "2", "4"], "cannot tell the recipe of model 'llama-7b'"),
    (["workflow", "toy", "2", "4", "--profile", "true"], "workflow profiles by itself"),
    (["toy", "2", "4", "--pp"], "--pp needs a value"),
])
def test_run_sh_rejects_bad_arguments_before_running(tmp_path, args, message):
    result = _run_sh(args, tmp_path, tmp_path / "cache", timeout=60)
    assert result.returncode == 2 and message in result.stderr
    assert not (tmp_path / "run").exists()
