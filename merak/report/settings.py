"""The reporting section of the ``trainer`` config: where the run writes, how often it logs,
evaluates held-out samples and reports to trackers. Consumed by merak.report.metrics (MetricsWriter),
merak.report.trackers and the run loop (merak.session.training)."""

from __future__ import annotations

from dataclasses import dataclass

from merak.core.fields import positive, positive_finite, setting


@dataclass(frozen=True)
class ReportSettings:
    """Output directory, metrics, evaluation and experiment trackers."""

    output_dir: str | None = setting(None, "null: the Hydra run directory")
    logging_steps: int = setting(1, "metrics.jsonl gets every n-th step", check=positive,
                                 requirement="must be a positive integer")
    disable_tqdm: bool = setting(False, "no progress bar")
    peak_tflops: float | None = setting(None, "per-device peak TFLOP/s for MFU (null: known GPUs' dense peak; "
                                              "none on CPU)",
                                        check=positive_finite, requirement="must be null or a positive number")
    # Recipes evaluate the last eval_holdout of the samples; MerakTrainer uses its eval_data instead.
    eval_steps: int | None = setting(None, "evaluate held-out samples every n steps (null: no evaluation)",
                                     check=positive, requirement="must be null (no evaluation) or a positive integer")
    eval_iters: int | None = setting(None, "evaluation steps each time (null: the whole held-out set)",
                                     check=positive,
                                     requirement="must be null (the whole held-out set) or a positive integer")
    eval_holdout: float = setting(0.05, "fraction of the dataset held out when eval_steps is set",
                                  check=lambda v: 0 < v <= 0.5, requirement="must be within (0, 0.5]")
    report_to: str | list[str] = setting("none", "none | tensorboard | wandb | all, or a list: [tensorboard, "
                                                 "wandb] (wandb runs offline)")
    run_name: str | None = setting(None, "the trackers' run name")

    def problems(self) -> list[str]:
        from merak.report.trackers import tracker_problems

        return tracker_problems(self.report_to)
