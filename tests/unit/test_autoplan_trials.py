"""merak.autoplan.trials: which layouts are tried, how a trial is timed, and which one is chosen."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
from omegaconf import OmegaConf

from merak.autoplan.auto import _trial_settings
from merak.autoplan.cluster import preset
from merak.autoplan.cost import Prediction
from merak.autoplan.layout import Layout
from merak.autoplan.planner import PlanReport
from merak.autoplan.search import Candidate
from merak.autoplan.table import format_table
from merak.autoplan.trials import (
    TRIAL_MOST_STEPS,
    TRIAL_TIE,
    TRIAL_WARMUP,
    Trial,
    layout_config,
    run_trials,
    trial_candidates,
    trial_config,
    trial_steps,
)
from merak.config import ConfigError
from merak.distributed.launch import WorkerFailed


def candidate(dp: int, tp: int, pp: int, step_s: float, *, fits: bool = True, zero: int = 0) -> Candidate:
    layout = Layout(dp=dp, tp=tp, pp=pp, micro_batch_size=2, num_microbatches=8 // (2 * dp), zero_stage=zero)
    return Candidate(layout, Prediction(layout=layout, step_s=step_s, stage_memory=(1,) * pp), fits)


RANKED = [candidate(2, 1, 2, 0.10), candidate(2, 1, 2, 0.101, zero=1), candidate(4, 1, 1, 0.12),
          candidate(1, 2, 2, 0.15, fits=False), candidate(1, 1, 4, 0.18), candidate(1, 4, 1, 0.35)]

BASE_CFG = OmegaConf.create({
    "parallel": {"auto": True, "world_size": 4, "dp": 1, "tp": 1, "pp": 1, "trials": 3},
    "trainer": {"max_steps": 1000, "save": True, "output_dir": "/somewhere", "learning_rate": 0.1},
    "launcher": {"timeout_s": 30.0}, "dry_run": True})


# --- which layouts ---------------------------------------------------------------------------------------------


def test_one_layout_per_grid_in_the_planners_order():
    tried = trial_candidates(RANKED, count=3)
    assert [c.layout.grid for c in tried] == [(2, 1, 2), (4, 1, 1), (1, 1, 4)]
    assert tried[0] is RANKED[0]  # the grid's first-ranked layout, not its ZeRO-1 twin


def test_layouts_that_do_not_fit_or_are_far_behind_are_not_tried():
    assert all(c.fits for c in trial_candidates(RANKED, count=10))
    assert [c.layout.grid for c in trial_candidates(RANKED, count=10)] == [(2, 1, 2), (4, 1, 1), (1, 1, 4)]
    assert len(trial_candidates(RANKED, count=10, window=4.0)) == 4
    assert trial_candidates(RANKED, count=0) == [] and trial_candidates([RANKED[3]], count=3) == []


# --- one trial -------------------------------------------------------------------------------------------------


def test_a_trial_is_its_fastest_runs_median_step_past_the_warm_up():
    slow_start = [5.0] * TRIAL_WARMUP
    assert Trial(RANKED[0], runs=[[*slow_start, 0.3, 0.1, 0.2]]).measured_step_s == pytest.approx(0.2)
    assert Trial(RANKED[0], runs=[[9.0, 0.4]]).measured_step_s == pytest.approx(0.4)  # too short: all but one
    two_runs = Trial(RANKED[0], runs=[[*slow_start, 0.3, 0.3, 0.3], [*slow_start, 0.25, 0.5, 0.2]])
    assert two_runs.measured_step_s == pytest.approx(0.25)
    assert Trial(RANKED[0], runs=[[*slow_start, 0.3]], error="boom").measured_step_s is None
    assert Trial(RANKED[0]).measured_step_s is None


def test_a_trial_config_runs_the_layout_briefly_and_writes_nowhere_else():
    layout = RANKED[2].layout
    trial = trial_config(BASE_CFG, layout, steps=5, output_dir="/tmp/trial")
    assert OmegaConf.to_container(trial.parallel) == {"dp": 4, "tp": 1, "pp": 1}  # no longer auto
    assert trial.trainer.max_steps == 5 and trial.trainer.output_dir == "/tmp/trial"
    assert trial.trainer.save is False and trial.trainer.resume_from_checkpoint is None
    assert trial.trainer.eval_steps is None and trial.trainer.logging_steps == 1 and trial.dry_run is False
    assert trial.launcher.quiet_workers is True and trial.launcher.timeout_s == 30.0
    assert trial.trainer.learning_rate == 0.1  # the user's other settings stay
    assert trial.trainer.per_device_train_batch_size == layout.micro_batch_size
    assert trial.trainer.gradient_accumulation_steps == layout.num_microbatches
    assert BASE_CFG.trainer.max_steps == 1000 and BASE_CFG.parallel.auto  # the original is untouched
    chosen = layout_config(BASE_CFG, layout)
    assert chosen.trainer.max_steps == 1000 and chosen.trainer.zero_optimization is False
    selective = layout_config(BASE_CFG, dataclasses.replace(layout, recompute="selective", zero_stage=3)).trainer
    assert (selective.activation_checkpointing, selective.selective_recompute) == ("selective", "matmuls")
    assert (selective.zero_optimization, selective.zero_stage) == (True, 3)


# --- choosing --------------------------------------------------------------------------------------------------


class FakeTraining:
    """Writes metrics.jsonl as a run of the config's layout would, with a step time per grid (a list: one per
    run, in turn)."""

    def __init__(self, step_s: dict, failing: tuple = ()) -> None:
        self.step_s, self.failing, self.configs = step_s, failing, []

    def grids(self) -> list[tuple[int, int, int]]:
        return [(cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp) for cfg in self.configs]

    def __call__(self, cfg) -> dict:
        self.configs.append(cfg)
        grid = self.grids()[-1]
        if grid in self.failing:
            raise WorkerFailed(f"rank 1 exited with status 1 running {grid}\nmore lines")
        per_run = self.step_s[grid] if isinstance(self.step_s[grid], list) else [self.step_s[grid]]
        step_s = per_run[min(self.grids().count(grid), len(per_run)) - 1]
        times = [1.0] * TRIAL_WARMUP + [step_s] * (cfg.trainer.max_steps - TRIAL_WARMUP)
        with open(os.path.join(cfg.trainer.output_dir, "metrics.jsonl"), "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps({"step": i + 1, "step_time_s": t}) + "\n" for i, t in enumerate(times))
        return {}


def test_the_fastest_measured_layout_is_chosen():
    training = FakeTraining({(2, 1, 2): 0.30, (4, 1, 1): 0.20, (1, 1, 4): 0.25})
    outcome = run_trials(RANKED, BASE_CFG, training, count=3, steps=6)
    assert outcome.chosen is RANKED[2]
    assert [t.measured_step_s for t in outcome.trials] == [0.30, 0.20, 0.25]
    # Predicted 100, 120 and 180 ms per step: about 3 s timed past the warm-up.
    assert [cfg.trainer.max_steps for cfg in training.configs] == [TRIAL_WARMUP + n for n in (30, 25, 17)]
    assert len({cfg.trainer.output_dir for cfg in training.configs}) == len(training.configs)  # scratch, each
    assert not any(os.path.exists(cfg.trainer.output_dir) for cfg in training.configs)  # and removed
    ratios = [0.30 / 0.10, 0.20 / 0.12, 0.25 / 0.18]
    assert outcome.step_scale == pytest.approx(math.prod(ratios) ** (1 / 3))
    saved = outcome.to_json()
    assert saved["chosen"] == RANKED[2].layout.key() and saved["chosen_layout"]["dp"] == 4
    assert [t["measured_step_s"] for t in saved["trials"]] == [0.30, 0.20, 0.25]
    assert "chose dp4 tp1 pp1" in outcome.describe()


def test_layouts_close_to_the_fastest_run_again_in_the_opposite_order():
    # (1, 1, 4) is 10 % behind in the first runs and ahead in the second: the faster run of each counts.
    training = FakeTraining({(2, 1, 2): 0.30, (4, 1, 1): [0.20, 0.21], (1, 1, 4): [0.22, 0.19]})
    outcome = run_trials(RANKED, BASE_CFG, training, count=3, steps=6)
    assert training.grids() == [(2, 1, 2), (4, 1, 1), (1, 1, 4), (1, 1, 4), (4, 1, 1)]  # (2, 1, 2): 50 % behind
    assert outcome.chosen is RANKED[4]
    assert [len(t.runs) for t in outcome.trials] == [1, 2, 2]
    assert [t.measured_step_s for t in outcome.trials] == [0.30, 0.20, 0.19]


def test_a_layout_ranked_higher_within_the_tie_margin_of_the_fastest_stays():
    # (4, 1, 1) is 2.5 % faster than the planner's first choice: within run-to-run noise, the ranking decides.
    training = FakeTraining({(2, 1, 2): 0.205, (4, 1, 1): 0.20, (1, 1, 4): 0.30})
    assert run_trials(RANKED, BASE_CFG, training, count=3, steps=6).chosen is RANKED[0]
    # 5 % is more than the margin: the trial decides.
    training = FakeTraining({(2, 1, 2): 0.21, (4, 1, 1): 0.20, (1, 1, 4): 0.30})
    assert run_trials(RANKED, BASE_CFG, training, count=3, steps=6).chosen is RANKED[2]
    assert 0.205 <= 0.20 * (1 + TRIAL_TIE) < 0.21


def test_a_failed_trial_is_recorded_and_left_out():
    training = FakeTraining({(2, 1, 2): 0.30, (4, 1, 1): 0.20, (1, 1, 4): 0.25}, failing=((4, 1, 1),))
    outcome = run_trials(RANKED, BASE_CFG, training, count=3, steps=6)
    assert outcome.chosen is RANKED[4]
    failed = outcome.trials[1]
    assert failed.measured_step_s is None and failed.error == "rank 1 exited with status 1 running (4, 1, 1)"
    assert "failed: rank 1 exited" in outcome.describe()


def test_without_any_measurement_the_best_prediction_stays():
    training = FakeTraining({}, failing=((2, 1, 2), (4, 1, 1), (1, 1, 4)))
    outcome = run_trials(RANKED, BASE_CFG, training, count=3, steps=6)
    assert outcome.chosen is RANKED[0] and outcome.step_scale is None and len(outcome.trials) == 3


def test_nothing_is_tried_with_a_single_grid_in_the_running():
    training = FakeTraining({(2, 1, 2): 0.3})
    outcome = run_trials(RANKED[:2], BASE_CFG, training, count=3, steps=6)
    assert outcome.chosen is RANKED[0] and outcome.trials == [] and training.configs == []


def test_trial_settings_are_checked():
    assert _trial_settings(OmegaConf.create({"parallel": {"auto": True}})) == (3, 8, 3.0)
    assert _trial_settings(OmegaConf.create({"parallel": {"trials": 0, "trial_steps": 2, "trial_seconds": 0}})) \
        == (0, 2, 0.0)
    with pytest.raises(ConfigError) as raised:
        _trial_settings(OmegaConf.create({"parallel": {"trials": -1, "trial_steps": True, "trial_seconds": -1}}))
    assert "parallel.trials=-1 must be an integer >= 0" in str(raised.value)
    assert "parallel.trial_steps=True must be an integer >= 1" in str(raised.value)
    assert "parallel.trial_seconds=-1 must be a number >= 0" in str(raised.value)


def test_short_steps_are_tried_for_longer():
    fast, slow = RANKED[0], RANKED[-1]
    assert trial_steps(dataclasses.replace(fast, prediction=dataclasses.replace(
        fast.prediction, step_s=0.1)), 8, 3.0) == TRIAL_WARMUP + 30
    assert trial_steps(dataclasses.replace(slow, prediction=dataclasses.replace(
        slow.prediction, step_s=2.0)), 8, 3.0) == 8  # 8 steps time more than 3 s already
    tiny = dataclasses.replace(fast, prediction=dataclasses.replace(fast.prediction, step_s=1e-4))
    assert trial_steps(tiny, 8, 3.0) == TRIAL_MOST_STEPS
    assert trial_steps(tiny, 8, 0.0) == 8


# --- the table ---------------------------------------------------------------------------------------------------


def test_the_table_marks_the_layout_the_trials_chose():
    ranked = [dataclasses.replace(c, why_not=f"reason {rank}") for rank, c in enumerate(RANKED, 1) if c.fits]
    report = PlanReport(recipe="gpt", model="toy", cluster=preset("h100-80"), world_size=4, global_batch_size=8,
                        candidates=ranked, profile_seconds=0.0, search_seconds=0.0)
    plain = format_table(report)
    assert "(chosen)" in plain.splitlines()[2] and "fastest in the trials" not in plain
    marked = format_table(report, chosen=ranked[2])
    lines = marked.splitlines()
    assert lines[2].endswith("(slower in the trials)") and lines[4].endswith("(chosen: fastest in the trials)")
    assert lines[3].endswith("reason 2")
    # Chosen below the rows shown: it follows them, with its rank.
    below = format_table(report, top=2, chosen=ranked[4]).splitlines()
    assert len(below) == 2 + 3 and below[-1].startswith("5 ") and below[-1].endswith("(chosen: fastest in the trials)")
    assert format_table(report, chosen=ranked[0]) == plain  # the best prediction chosen: as without trials
