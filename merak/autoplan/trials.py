"""Trials: the leading layouts trained for a few steps on the processes at hand, the fastest chosen.

On cluster ``this`` a step's time depends on how the operating system schedules processes sharing the
cores: the cost model ranks, the trials decide. Tried: the best layout of each of the first grids within
:data:`TRIAL_WINDOW` of the best prediction, each a real run of the recipe (checkpoints and evaluation off,
its own scratch directory) timed by its median step past the warm-up. Those within :data:`RERUN_WITHIN`
of the fastest run again in the opposite order; the fastest is chosen unless one ranked higher came within
:data:`TRIAL_TIE` of it. A failed trial is recorded and left out.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf, open_dict

from merak.autoplan.layout import Layout
from merak.autoplan.search import Candidate
from merak.config import ConfigError
from merak.distributed.launch import WorkerFailed
from merak.report.console import only_errors

logger = logging.getLogger(__name__)

TRIALS = 3  # layouts tried by default (parallel.trials)
TRIAL_STEPS = 8  # steps of each, at least (parallel.trial_steps)
TRIAL_SECONDS = 3.0  # short steps: more of them, until about this long is timed (parallel.trial_seconds)
TRIAL_MOST_STEPS = 60
TRIAL_WARMUP = 3  # first steps left out of a trial's time (allocator, caches, lazy initialization)
TRIAL_WINDOW = 2.0  # only layouts predicted at most this many times slower than the best are tried
RERUN_WITHIN = 0.15  # layouts measured this close to the fastest are run once more
# A trial must beat a layout the planner ranked higher by more than this to replace it: less than a layout's
# step varies between runs minutes apart, so the ranking breaks such ties.
TRIAL_TIE = 0.03

Train = Callable[[DictConfig], dict]  # runs a composed config to its end (merak.runner.run for one recipe)


@dataclass
class Trial:
    """One layout tried: each run's step times; its time is the fastest run's median step past the warm-up
    (the machine's noise only ever adds time), or None when a run failed (``error``)."""

    candidate: Candidate
    runs: list[list[float]] = field(default_factory=list)
    wall_s: float = 0.0
    error: str | None = None

    @property
    def measured_step_s(self) -> float | None:
        if self.error is not None:
            return None
        medians = [statistics.median(times[TRIAL_WARMUP:] or times[1:] or times) for times in self.runs if times]
        return min(medians, default=None)

    def to_json(self) -> dict:
        return {"key": self.candidate.layout.key(), "predicted_step_s": self.candidate.predicted_step_s,
                "measured_step_s": self.measured_step_s, "runs_step_times_s": self.runs,
                "wall_s": round(self.wall_s, 3), "error": self.error}


@dataclass
class TrialOutcome:
    """The trials of one plan and the layout they chose."""

    trials: list[Trial]
    chosen: Candidate

    @property
    def measured(self) -> list[Trial]:
        return [t for t in self.trials if t.measured_step_s is not None]

    @property
    def step_scale(self) -> float | None:
        """Measured over predicted step time, the geometric mean over the trials (None: none measured)."""
        ratios = [t.measured_step_s / t.candidate.predicted_step_s for t in self.measured]
        return math.exp(statistics.fmean(math.log(r) for r in ratios)) if ratios else None

    def to_json(self) -> dict:
        return {"chosen": self.chosen.layout.key(), "chosen_layout": self.chosen.layout.to_json(),
                "step_scale": self.step_scale,
                "trials": [t.to_json() for t in self.trials]}

    def describe(self) -> str:
        lines = [f"  {t.candidate.layout.key():<40} predicted {t.candidate.predicted_step_s * 1e3:8.1f} ms  "
                 + (f"measured {t.measured_step_s * 1e3:8.1f} ms" if t.measured_step_s is not None
                    else f"failed: {t.error}") for t in self.trials]
        scale = self.step_scale
        fit = "" if scale is None else f" (measured steps {scale:.2f}x the predicted ones)"
        return "\n".join([f"tried {len(self.trials)} layouts, chose {self.chosen.layout.key()}{fit}:", *lines])


def trial_candidates(candidates: list[Candidate], count: int, window: float = TRIAL_WINDOW) -> list[Candidate]:
    """The first fitting candidate of each of the first ``count`` grids, within ``window`` times the best's step."""
    fitting = [c for c in candidates if c.fits]
    if not fitting or count < 1:
        return []
    limit = fitting[0].predicted_step_s * window
    chosen: dict[tuple[int, int, int], Candidate] = {}
    for candidate in fitting:
        if len(chosen) == count:
            break
        if candidate.predicted_step_s <= limit:
            chosen.setdefault(candidate.layout.grid, candidate)
    return list(chosen.values())


def layout_config(cfg: DictConfig, layout: Layout) -> DictConfig:
    """``cfg`` set to run ``layout``: its degrees and the trainer settings it chooses (the rest kept)."""
    chosen = cfg.copy()
    with open_dict(chosen):
        OmegaConf.update(chosen, "parallel", {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp}, merge=False)
        for override in layout.overrides():
            key, value = override.split("=", 1)
            if key.startswith("trainer."):
                OmegaConf.update(chosen, key, _parse(value))
    return chosen


def _parse(value: str):
    """A Hydra override's value as YAML reads it (``true`` -> True, ``4`` -> 4, ``null`` -> None)."""
    import yaml

    return yaml.safe_load(value)


def trial_config(cfg: DictConfig, layout: Layout, *, steps: int, output_dir: str) -> DictConfig:
    """``cfg`` running ``layout`` for ``steps`` steps into ``output_dir``, writing nothing else: no checkpoints,
    no resuming, no evaluation, no energy profile, the workers quiet."""
    trial = layout_config(cfg, layout)
    with open_dict(trial):
        trial.dry_run = False
        for key, value in {"max_steps": steps, "output_dir": output_dir, "save": False,
                           "resume_from_checkpoint": None, "eval_steps": None, "logging_steps": 1,
                           "disable_tqdm": True, "measure_activation_memory": False, "profile": False}.items():
            OmegaConf.update(trial, f"trainer.{key}", value)
        OmegaConf.update(trial, "launcher.quiet_workers", True)
    return trial


def _step_times(output_dir: str) -> list[float]:
    with open(os.path.join(output_dir, "metrics.jsonl"), encoding="utf-8") as handle:
        return [json.loads(line)["step_time_s"] for line in handle if line.strip()]


def measure(train: Train, cfg: DictConfig, trial: Trial, steps: int) -> None:
    """Train ``trial``'s layout ``steps`` steps once more (:func:`trial_config`), adding its step times or error."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="merak-trial-") as output_dir:
        try:
            with only_errors():
                train(trial_config(cfg, trial.candidate.layout, steps=steps, output_dir=output_dir))
            trial.runs.append(_step_times(output_dir))
        except (ConfigError, WorkerFailed, OSError, json.JSONDecodeError, KeyError) as error:
            trial.error = str(error).splitlines()[0] if str(error) else type(error).__name__
            logger.warning("the trial of %s failed: %s", trial.candidate.layout.key(), trial.error)
    trial.wall_s += time.perf_counter() - started


def trial_steps(candidate: Candidate, steps: int, seconds: float) -> int:
    """Steps to train ``candidate`` for: ``steps``, more for short predicted steps until about ``seconds`` are
    timed past the warm-up (at most :data:`TRIAL_MOST_STEPS`): a few short steps give a noisy median."""
    if seconds <= 0 or candidate.predicted_step_s <= 0:
        return steps
    wanted = TRIAL_WARMUP + math.ceil(seconds / candidate.predicted_step_s - 1e-9)  # 3 / 0.1 is 30.000...04
    return max(steps, min(TRIAL_MOST_STEPS, wanted))


def run_trials(candidates: list[Candidate], cfg: DictConfig, train: Train, *, count: int = TRIALS,
               steps: int = TRIAL_STEPS, seconds: float = TRIAL_SECONDS) -> TrialOutcome:
    """Train the leading candidates (:func:`trial_candidates`) :func:`trial_steps` steps each, those within
    :data:`RERUN_WITHIN` of the fastest once more in the opposite order; choose the fastest measured, or a
    higher-ranked layout within :data:`TRIAL_TIE` of it (the best prediction when nothing was measured or tried)."""
    leading = trial_candidates(candidates, count)
    if len(leading) < 2:  # nothing to choose between
        return TrialOutcome(trials=[], chosen=candidates[0])
    tried = [Trial(candidate) for candidate in leading]
    for trial in tried:
        length = trial_steps(trial.candidate, steps, seconds)
        logger.info("trying %s for %d steps (predicted %.1f ms per step)", trial.candidate.layout.key(), length,
                    trial.candidate.predicted_step_s * 1e3)
        measure(train, cfg, trial, length)
    close = _within(tried, RERUN_WITHIN)
    if len(close) > 1:
        for trial in reversed(close):
            logger.info("trying %s again (%.1f ms per step, within %.0f %% of the fastest)",
                        trial.candidate.layout.key(), trial.measured_step_s * 1e3, RERUN_WITHIN * 100)
            measure(train, cfg, trial, trial_steps(trial.candidate, steps, seconds))
    chosen = _within(tried, TRIAL_TIE)
    return TrialOutcome(trials=tried, chosen=chosen[0].candidate if chosen else candidates[0])


def _within(trials: list[Trial], margin: float) -> list[Trial]:
    """The measured trials within ``margin`` of the fastest, in the planner's ranking order."""
    measured = [t for t in trials if t.measured_step_s is not None]
    fastest = min((t.measured_step_s for t in measured), default=0.0)
    return [t for t in measured if t.measured_step_s <= fastest * (1 + margin)]
