"""How one worker splits its model (its TP plan, degree, rank and the tensor-parallel section) and the
single call that applies it."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

from torch import nn

from merak.core import group_registry
from merak.core.names import module_pattern
from merak.tensor_parallel.cross_entropy import set_vocab_parallel, vocab_parallel_group
from merak.tensor_parallel.layers import ParallelContext
from merak.tensor_parallel.overlap import dropout_modules
from merak.tensor_parallel.plan import ResolvedPlan, TPPlan, TPPlanError, apply_plan, resolve_plan
from merak.tensor_parallel.settings import TensorParallelSettings

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class TensorParallelSplit:
    """How one worker splits its model.

    Attributes:
        plan: the model's TP plan (from its recipe, or built by ``set_tp_layer_lists``).
        size: the tp degree; rank: this worker's place in its tp group.
        settings: the tensor-parallel section of the config (vocabulary split, sequence
            parallelism, ``tp_overlapping_level``).
    """

    plan: TPPlan | None = None
    size: int = 1
    rank: int = 0
    settings: TensorParallelSettings = TensorParallelSettings()


def option_problems(options: TensorParallelSplit, *, prefix: str = "") -> list[str]:
    """What is wrong with ``options`` regardless of the model (empty when nothing); ``prefix`` goes before
    setting names (``"trainer."`` for a run config)."""
    return options.settings.problems(plan=options.plan, tp=options.size, prefix=prefix)


def split_model(model: nn.Module, options: TensorParallelSplit) -> ResolvedPlan | None:
    """Turn ``model`` into this rank's tensor-parallel shard in place (nothing to do for tp=1).

    Where no process group exists (planning before launch), the collectives are
    simulated: shapes as on a worker, no communication.

    Raises:
        TPPlanError: the options or the plan do not fit the model.
    """
    problems = option_problems(options)
    if problems:
        raise TPPlanError("invalid tensor-parallel settings:\n  - " + "\n  - ".join(problems))
    settings = options.settings
    set_vocab_parallel("tp" if options.size > 1 and settings.parallel_vocab else None)
    if options.size == 1:
        return None
    resolved = resolve_plan(model, options.plan, tp=options.size, parallel_vocab=settings.parallel_vocab,
                            sequence_parallel=settings.sequence_parallel)
    if group_registry.group_size("tp") != options.size:
        group_registry.register_group("tp", None, rank=options.rank, size=options.size)
    ctx = ParallelContext(rank=options.rank, size=options.size, group="tp",
                          sequence_dim=settings.sequence_dim if settings.sequence_parallel else -1,
                          overlap=settings.tp_overlapping_level >= 1)
    try:
        apply_plan(model, resolved, ctx)
    except (TypeError, ValueError) as error:  # e.g. a tied weight the plan splits two ways
        raise TPPlanError(f"the tensor-parallel plan cannot be applied to {type(model).__name__}: {error}") from error
    if settings.tp_overlapping_level == 2:
        _check_block_overlap(model, options.plan)
    logger.info("tensor-parallel rank %d of %d: the plan changes %d modules or tensors", options.rank,
                options.size, len(resolved.changes))
    logger.debug("tensor-parallel changes:\n%s", resolved.describe())
    return resolved


def _check_block_overlap(model: nn.Module, plan: TPPlan) -> None:
    problems = [f"tp_overlapping_level=2: block {p!r} matches no module" for p in plan.blocks
                if not any(module_pattern(p).fullmatch(n) for n, _ in model.named_modules())]
    dropout = dropout_modules(model)
    if dropout:
        problems.append(f"tp_overlapping_level=2 runs the two halves of a microbatch on two threads, which "
                        f"cannot reproduce dropout masks; set the model's dropout to 0 (e.g. {dropout[0]}) or "
                        "use level 1")
    if problems:
        raise TPPlanError("invalid tensor-parallel settings:\n  - " + "\n  - ".join(problems))


@contextlib.contextmanager
def tensor_parallel_state_kept():
    """The tensor-parallel state :func:`split_model` sets for this process (the registered groups, the
    vocabulary split of the loss), restored on exit: the launching process splits models to plan a
    layout, and it, or a later run in it, must not train as a worker of that layout."""
    vocab_group = vocab_parallel_group()
    with group_registry.groups_kept():
        try:
            yield
        finally:
            set_vocab_parallel(vocab_group)
