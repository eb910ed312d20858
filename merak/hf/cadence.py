"""When MerakTrainer logs, evaluates and saves: Hugging Face's ``*_strategy`` fields resolved to steps.

``logging_strategy``, ``eval_strategy`` and ``save_strategy`` take ``"no"``, ``"steps"``
(every ``*_steps``) or ``"epoch"``; ``save_strategy="best"`` saves whenever the
evaluation metric improves. ``load_best_model_at_end`` keeps a checkpoint at every
evaluation and loads the best one's weights when training ends.

The seed API's ``save`` switch keeps its meaning: ``save=True`` writes checkpoints
(every ``save_steps``, or as ``save_strategy`` says), ``save=False`` writes none.
Left at None, ``save_strategy`` decides alone, as in Hugging Face.
"""

from __future__ import annotations

from dataclasses import dataclass


def _value(value) -> str:
    return str(getattr(value, "value", value))


@dataclass(frozen=True)
class Cadence:
    """Steps at which the trainer acts (None: never)."""

    log_every: int | None
    log_first_step: bool
    eval_every: int | None
    eval_delay: int
    eval_on_start: bool
    save_every: int | None
    save_best: bool
    load_best: bool
    best_metric: str
    greater_is_better: bool

    def evaluates_at(self, step: int) -> bool:
        # Hugging Face evaluates once eval_delay steps (or epochs, counted in steps here) have passed.
        return bool(self.eval_every) and step % self.eval_every == 0 and step >= self.eval_delay

    def logs_at(self, step: int) -> bool:
        return (bool(self.log_every) and step % self.log_every == 0) or (self.log_first_step and step == 1)

    def is_better(self, value: float, best: float | None) -> bool:
        return best is None or (value > best if self.greater_is_better else value < best)


def _every(strategy: str, steps: float | None, steps_per_epoch: int, total_steps: int) -> int | None:
    """Steps between actions; a ``steps`` value below 1 is a fraction of the run, as in Hugging Face."""
    if strategy == "no" or (strategy == "steps" and not steps):
        return None
    if strategy == "epoch":
        return steps_per_epoch
    if steps < 1:
        return max(1, round(steps * total_steps))
    return max(1, int(steps))


def cadence_problems(args) -> list[str]:
    """What cannot work in the strategy fields (empty when fine)."""
    problems = []
    save, evaluate = _value(args.save_strategy), _value(args.eval_strategy)
    if args.save is True and save == "no":
        problems.append("save=True but save_strategy='no': drop one of them")
    if args.load_best_model_at_end:
        if evaluate == "no":
            problems.append("load_best_model_at_end=True needs an eval_strategy ('steps' or 'epoch')")
        if args.save is False or save == "no":
            problems.append("load_best_model_at_end=True needs checkpoints: leave save and save_strategy on")
    if save == "best" and evaluate == "no":
        problems.append("save_strategy='best' needs an eval_strategy ('steps' or 'epoch')")
    return problems


def resolve_cadence(args, *, steps_per_epoch: int, total_steps: int, has_eval_data: bool) -> Cadence:
    """The cadence of these arguments for a run of ``total_steps`` steps."""
    evaluate, save = _value(args.eval_strategy), _value(args.save_strategy)
    eval_every = _every(evaluate, args.eval_steps or args.logging_steps, steps_per_epoch, total_steps) \
        if has_eval_data else None
    save_every = None if args.save is False or save in ("no", "best") else \
        _every(save, args.save_steps, steps_per_epoch, total_steps)
    metric = args.metric_for_best_model or "loss"
    metric = metric if metric.startswith("eval_") else f"eval_{metric}"
    greater = args.greater_is_better if args.greater_is_better is not None else not metric.endswith("loss")
    delay = int(args.eval_delay or 0) * (steps_per_epoch if evaluate == "epoch" else 1)
    return Cadence(log_every=_every(_value(args.logging_strategy), args.logging_steps, steps_per_epoch, total_steps),
                   log_first_step=bool(args.logging_first_step), eval_every=eval_every, eval_delay=delay,
                   eval_on_start=bool(args.eval_on_start) and has_eval_data, save_every=save_every,
                   save_best=save == "best", load_best=bool(args.load_best_model_at_end),
                   best_metric=metric, greater_is_better=bool(greater))


__all__ = ["Cadence", "cadence_problems", "resolve_cadence"]
