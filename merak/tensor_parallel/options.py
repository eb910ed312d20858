"""Tensor-parallel settings of one worker and the single call that applies them to a model."""

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

logger = logging.getLogger(__name__)

OVERLAP_LEVELS = (0, 1, 2)  # the original's level 3 (across blocks) rewrote the model; not offered


@dataclass(frozen=True)
class TensorParallelOptions:
    """How a worker splits its model (names as in MerakArguments).

    Attributes:
        plan: the model's TP plan (from its recipe, or built by ``set_tp_layer_lists``).
        size: the tp degree; rank: this worker's place in its tp group.
        parallel_vocab: split the embedding and the output layer by vocabulary.
        sequence_parallel: split activations between the blocks along ``sequence_dim``.
        overlap_level: ``tp_overlapping_level``: 0 none, 1 inside each linear pair,
            2 across whole blocks (merak.tensor_parallel.overlap).
    """

    plan: TPPlan | None = None
    size: int = 1
    rank: int = 0
    parallel_vocab: bool = False
    sequence_parallel: bool = False
    sequence_dim: int = 1
    overlap_level: int = 0


def option_problems(options: TensorParallelOptions, *, prefix: str = "") -> list[str]:
    """What is wrong with ``options`` regardless of the model (empty when nothing).

    ``prefix`` goes before setting names (``"trainer."`` for a run config).
    """
    problems = []
    if options.overlap_level not in OVERLAP_LEVELS:
        problems.append(f"{prefix}tp_overlapping_level={options.overlap_level}; supported levels are "
                        f"{', '.join(map(str, OVERLAP_LEVELS[:-1]))} and {OVERLAP_LEVELS[-1]}")
    if options.size == 1:
        return problems
    if options.plan is None:
        problems.append(f"tp={options.size} needs a TP plan: this model has none (pass one, or describe it "
                        "with merak.set_tp_layer_lists)")
    if options.overlap_level == 2 and options.plan is not None and not options.plan.blocks:
        problems.append(f"{prefix}tp_overlapping_level=2 overlaps inside whole transformer blocks and this model's "
                        "TP plan names none; use level 1")
    return problems


def split_model(model: nn.Module, options: TensorParallelOptions) -> ResolvedPlan | None:
    """Turn ``model`` into this rank's tensor-parallel shard in place (nothing to do for tp=1).

    Where no process group exists (planning before launch), the collectives are
    simulated: shapes as on a worker, no communication.

    Raises:
        TPPlanError: the options or the plan do not fit the model.
    """
    problems = option_problems(options)
    if problems:
        raise TPPlanError("invalid tensor-parallel settings:\n  - " + "\n  - ".join(problems))
    set_vocab_parallel("tp" if options.size > 1 and options.parallel_vocab else None)
    if options.size == 1:
        return None
    resolved = resolve_plan(model, options.plan, tp=options.size, parallel_vocab=options.parallel_vocab,
                            sequence_parallel=options.sequence_parallel)
    if group_registry.group_size("tp") != options.size:
        group_registry.register_group("tp", None, rank=options.rank, size=options.size)
    ctx = ParallelContext(rank=options.rank, size=options.size, group="tp",
                          sequence_dim=options.sequence_dim if options.sequence_parallel else -1,
                          overlap=options.overlap_level >= 1)
    try:
        apply_plan(model, resolved, ctx)
    except (TypeError, ValueError) as error:  # e.g. a tied weight the plan splits two ways
        raise TPPlanError(f"the tensor-parallel plan cannot be applied to {type(model).__name__}: {error}") from error
    if options.overlap_level == 2:
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
