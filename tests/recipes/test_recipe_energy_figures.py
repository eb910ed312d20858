"""Energy on every run, end to end: each recipe of the zoo trains its toy model for 2 steps in this
process on a simulated GPU (``trainer.energy_device=simulated``) and reports joules per step, per token
(text) or per sample (images), power per device and FLOP per joule, per logged step and in its summary;
the default (``auto``) on CPU workers measures nothing and says why; two ranks sum their energy every
logged step; MerakTrainer reports the same.

What is asserted is simulated or counted (the simulated A100 draws between its blocked and its
highest power), never how long a step took on this shared machine.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from tiny_models import TinyClassifier
from train_py import read_metrics, run_in_process

from merak.distributed import groups
from merak.energy.runtime import CPU_WORKERS
from merak.energy.simulated import gpu_spec
from merak.report.metrics import format_summary

pytestmark = pytest.mark.recipe

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted(path.parent.name for path in REPO.glob("recipes/*/train.py"))
# One process, two steps of one microbatch of two samples.
TINY = ["model=toy", "parallel=single", "trainer.per_device_train_batch_size=2",
        "trainer.gradient_accumulation_steps=1", "trainer.max_steps=2", "trainer.disable_tqdm=true"]
SIMULATED = "trainer.energy_device=simulated"
A100 = gpu_spec("A100")
ENERGY_KEYS = {"energy_j", "joules_per_token", "joules_per_sample", "power_w"}


def _energy_line(summary: dict) -> str:
    (line,) = [line.strip() for line in format_summary(summary).splitlines() if line.strip().startswith("energy ")]
    return line


def _tokens_per_sample(summary: dict) -> int:
    return round(summary["tokens_per_s"] / summary["samples_per_s"])


def _check_step(line: dict, *, samples: int, tokens: int, devices: int = 1) -> None:
    """A metrics.jsonl line's energy: its figures agree with each other and the simulated A100's power."""
    assert line["energy_j"] > 0
    per = "joules_per_token" if tokens > 1 else "joules_per_sample"
    assert set(line) & ENERGY_KEYS == {"energy_j", per, "power_w"}
    assert line[per] == pytest.approx(line["energy_j"] / (samples * tokens), rel=1e-12)
    assert A100.blocked_power * 0.99 <= line["power_w"] <= A100.max_power * 1.01


@pytest.mark.timeout(300)
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_reports_its_energy_on_a_simulated_gpu(recipe, tmp_path, cache_dir):
    summary = run_in_process(recipe, [*TINY, SIMULATED], tmp_path)
    energy, samples, tokens = summary["energy"], summary["global_batch_size"], _tokens_per_sample(summary)
    assert energy["measured"] is True and energy["device"] == "simulated A100" and energy["devices"] == 1
    assert energy["measured_steps"] == 1  # the first step warms up
    assert energy["joules_per_step"] == energy["iteration_energy_j"] > 0
    per, unit = ("joules_per_token", "J/token") if tokens > 1 else ("joules_per_sample", "J/sample")
    assert energy[per] == pytest.approx(energy["joules_per_step"] / (samples * tokens), rel=1e-12)
    assert A100.blocked_power * 0.99 <= energy["power_w_per_device"] <= A100.max_power * 1.01
    flops = summary["flops"]["model_flops_per_step"]
    assert energy["flop_per_joule"] == pytest.approx(flops / energy["joules_per_step"], rel=1e-12)
    line = _energy_line(summary)
    assert f"J/step on 1 simulated A100, {energy[per]:.3g} {unit}, " in line and line.endswith("FLOP/J"), line
    steps = read_metrics(tmp_path)
    assert [s["step"] for s in steps] == [1, 2]
    for step in steps:
        _check_step(step, samples=samples, tokens=tokens)
    assert steps[-1]["energy_j"] == pytest.approx(energy["joules_per_step"], rel=1e-12)  # the one measured step


@pytest.mark.timeout(300)
def test_auto_on_cpu_workers_measures_nothing_and_says_why(tmp_path, cache_dir):
    summary = run_in_process("gpt", TINY, tmp_path)  # trainer.energy_device=auto, the default
    assert summary["energy"] == {"measured": False, "why": CPU_WORKERS}
    assert _energy_line(summary) == ("energy             not measured: CPU workers have no energy counter "
                                     "(trainer.energy_device=simulated simulates a GPU)")
    assert all(not set(step) & ENERGY_KEYS for step in read_metrics(tmp_path))  # no nulls: no keys


@pytest.mark.timeout(300)
def test_only_logged_steps_gather_their_energy(tmp_path, cache_dir, monkeypatch):
    calls = []
    gather = groups.sum_over_all
    monkeypatch.setattr(groups, "sum_over_all", lambda values: calls.append(values) or gather(values))
    run_in_process("gpt", [*TINY, SIMULATED, "trainer.max_steps=4", "trainer.logging_steps=2"], tmp_path)
    steps = read_metrics(tmp_path)
    assert [s["step"] for s in steps] == [2, 4] and len(calls) == 2
    assert [s["energy_j"] for s in steps] == [values[0] for values in calls]


@pytest.mark.timeout(300)
def test_two_ranks_sum_their_energy_every_logged_step(tmp_path, cache_dir):
    """dp=2, forked workers: each logged step's energy is both devices' (one all-reduce per step, in
    step with the other rank's), and the summary counts two devices."""
    summary = run_in_process("gpt", [*TINY, SIMULATED, "parallel=dp2"], tmp_path)
    energy = summary["energy"]
    assert energy["devices"] == 2 and [r["rank"] for r in energy["ranks"]] == [0, 1]
    assert "on 2 simulated A100" in _energy_line(summary)
    steps = read_metrics(tmp_path)
    for step in steps:
        _check_step(step, samples=summary["global_batch_size"], tokens=_tokens_per_sample(summary))
    # The one measured step of the summary (the first warms up) is the last logged one: the sum of both ranks'.
    assert steps[-1]["energy_j"] == pytest.approx(sum(r["step_energy_j"] for r in energy["ranks"]), rel=1e-12)
    assert steps[-1]["energy_j"] == pytest.approx(energy["joules_per_step"], rel=1e-12)


def _trainer_run(output_dir: Path, **fields) -> dict:
    """MerakTrainer in this process: 2 steps of a tiny classifier; its summary."""
    import merak

    torch.manual_seed(0)
    data = [{"features": torch.randn(4), "labels": torch.tensor(i % 3)} for i in range(8)]
    args = merak.MerakArguments(output_dir=str(output_dir), max_steps=2, per_device_train_batch_size=2,
                                disable_tqdm=True, save=False, **fields)
    try:
        trainer = merak.MerakTrainer(model=TinyClassifier(), args=args, train_data=data)
        trainer.train()
        return trainer.summary
    finally:
        groups.shutdown()


@pytest.mark.timeout(300)
def test_the_trainer_reports_the_same_figures(tmp_path):
    summary = _trainer_run(tmp_path / "simulated", energy_device="simulated")
    energy = summary["energy"]
    assert energy["measured"] is True and energy["devices"] == 1 and energy["device"] == "simulated A100"
    assert energy["joules_per_sample"] == pytest.approx(energy["joules_per_step"] / summary["global_batch_size"])
    assert A100.blocked_power * 0.99 <= energy["power_w_per_device"] <= A100.max_power * 1.01
    assert "J/step on 1 simulated A100" in _energy_line(summary) and "J/sample" in _energy_line(summary)
    for step in read_metrics(tmp_path / "simulated"):
        _check_step(step, samples=summary["global_batch_size"], tokens=1)
    off = _trainer_run(tmp_path / "auto")
    assert off["energy"] == {"measured": False, "why": CPU_WORKERS}
    assert all(not set(step) & ENERGY_KEYS for step in read_metrics(tmp_path / "auto"))
    assert all(math.isfinite(step["loss"]) for step in read_metrics(tmp_path / "auto"))
    assert json.loads((tmp_path / "auto" / "summary.json").read_text())["energy"]["measured"] is False
