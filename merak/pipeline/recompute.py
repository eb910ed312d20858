"""Activation checkpointing of pipeline stages and reproducible dropout.

A stage is a sequence of parts (the shards of the captured graph). With
checkpointing, the first ``round(ratio * parts)`` parts run under
``torch.utils.checkpoint`` in chunks of ``checkpoint_num_layers`` parts: only
the chunk inputs are kept and the backward recomputes the rest.

Stage-aware recomputation: from the first stage's ratio ``r0``, stage ``i``
of ``S`` uses ``r_i = 1 - (1 - r0)(S - 1)/(S - 1 - i)`` (no checkpointing
when that is <= 0) and the last stage none, so kept activations times
microbatches in flight are about equal on every stage.

Recomputation must see the dropout masks of the first run. Rather than
replaying a saved RNG state, every part of the model reseeds the RNG before
it runs, from (run seed, data-parallel rank, step, microbatch, part index).
A part therefore draws the same masks however often and wherever it runs:
recomputed early (RecomputeForward), inside the backward, or in another
pipeline layout that cuts the same parts into different stages.

Selective recomputation (merak.pipeline.selective) keeps the same chunks but saves some operators'
outputs inside them (matrix products, or all but the attention core), so the backward recomputes
only the rest.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import fx, nn

from merak.trace.capture import RebuildOutput
from merak.trace.simplify import DROPOUT_CALLS, is_inactive_dropout

# What the stage forward currently runs: "configured" (the stage's checkpointing) or "none"; and, while a
# chunk's forward is counted, the FLOPs of its checkpointed parts (what its backward runs again).
_state = {"checkpointing": "configured", "seed": None, "recomputed": None, "saved": None}


@dataclass(frozen=True)
class StageRecomputation:
    """Activation checkpointing of one stage.

    Attributes:
        parts: How many leading parts of the stage run under checkpoint.
        num_layers: Parts per checkpointed chunk (``checkpoint_num_layers``).
        saves: None: a checkpointed chunk keeps only its inputs (full recomputation); else what
            selective recomputation saves inside it, ``"matmuls"`` or ``"attention"``
            (merak.pipeline.selective).
    """

    parts: int = 0
    num_layers: int = 1
    saves: str | None = None


def stage_checkpoint_ratios(ratio: float | Sequence[float] | None, num_stages: int, *,
                            last_stage_checkpoints: bool = True) -> list[float]:
    """Per-stage fractions of parts to checkpoint.

    Args:
        ratio: None: every part of every stage; a float: the first stage's
            ratio, the others derived (stage-aware); a sequence: one per stage.
        num_stages: Number of (virtual) pipeline stages.
        last_stage_checkpoints: False for schedules whose last stage keeps full activations.

    Raises:
        ValueError: If a ratio is outside [0, 1] or the sequence has the wrong length.
    """
    if ratio is None:
        ratios = [1.0] * num_stages
    elif isinstance(ratio, (int, float)) and not isinstance(ratio, bool):
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"activation_checkpoint_ratio={ratio} must be in [0, 1]")
        if num_stages == 1:  # the first stage is also the last: its own ratio applies
            ratios = [float(ratio)]
        else:
            ratios = [max(0.0, 1.0 - (1.0 - ratio) * (num_stages - 1) / (num_stages - 1 - i))
                      for i in range(num_stages - 1)] + [0.0]
    else:
        ratios = [float(r) for r in ratio]
        if len(ratios) != num_stages or not all(0.0 <= r <= 1.0 for r in ratios):
            raise ValueError(f"activation_checkpoint_ratio={list(ratio)} must hold {num_stages} values in [0, 1], "
                             "one per pipeline stage")
    if not last_stage_checkpoints:
        ratios[-1] = 0.0
    return ratios


def checkpointed_parts(ratio: float, num_parts: int) -> int:
    """How many of ``num_parts`` parts a ratio checkpoints (rounded to the nearest part)."""
    return min(num_parts, int(ratio * num_parts + 0.5))


@contextlib.contextmanager
def checkpointing(mode: str) -> Iterator[None]:
    """Run stage forwards with their configured checkpointing (``"configured"``) or none (``"none"``).

    A process-wide setting on purpose: tensor-parallel overlap runs stage halves on helper threads.
    """
    previous = _state["checkpointing"]
    _state["checkpointing"] = mode
    try:
        yield
    finally:
        _state["checkpointing"] = previous


def checkpointing_mode() -> str:
    """The mode set by :func:`checkpointing`."""
    return _state["checkpointing"]


class RecomputedWork:
    """The FLOPs of the checkpointed parts a forward ran: its backward runs them again."""

    def __init__(self) -> None:
        self.flops = 0


@contextlib.contextmanager
def counting_recomputation() -> Iterator[RecomputedWork]:
    """Within the block, the forwards of checkpointed parts add their FLOPs to the yielded
    :class:`RecomputedWork` (a simulated GPU charges the backward for them, as a real one takes the time)."""
    previous, work = _state["recomputed"], RecomputedWork()
    _state["recomputed"] = work
    try:
        yield work
    finally:
        _state["recomputed"] = previous


class _SavedWork:
    """The FLOPs of the operators a selective checkpointed run saved (its backward skips them)."""

    def __init__(self, counter) -> None:
        self.counter = counter
        self.flops = 0


@contextlib.contextmanager
def checkpointed_part() -> Iterator[None]:
    """Around a checkpointed run of parts: counted into the active :func:`counting_recomputation`, if any
    (less the operators selective recomputation saved, :func:`note_saved_flops`)."""
    work = _state["recomputed"]
    if work is None:
        yield
        return
    from merak.compat.flops import flop_counter

    counter = flop_counter()  # entering a counter clears it: one per checkpointed run
    previous, saved = _state["saved"], _SavedWork(counter)
    _state["saved"] = saved
    try:
        with counter:
            yield
    finally:
        _state["saved"] = previous
    work.flops += counter.get_total_flops() - saved.flops


def saved_operator_flops(func, args, kwargs, output) -> int:
    """The FLOPs of an operator whose output selective recomputation saves, by the counter's own formula,
    while a checkpointed run's recomputation is counted (0 otherwise)."""
    saved = _state["saved"]
    if saved is None:
        return 0
    formula = saved.counter.flop_registry.get(getattr(func, "_overloadpacket", None))
    return formula(*args, **kwargs, out_val=output) if formula is not None else 0


def note_saved_flops(flops: int) -> None:
    """FLOPs of the counted checkpointed run that its backward does not recompute (saved outputs)."""
    saved = _state["saved"]
    if saved is not None:
        saved.flops += flops


def part_seed(base: int, *keys: int) -> int:
    """A 63-bit seed mixed from ``base`` and ``keys`` (stable across processes and runs)."""
    text = ",".join(str(k) for k in (base, *keys)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & (2**63 - 1)


@contextlib.contextmanager
def microbatch_seed(seed: int | None) -> Iterator[None]:
    """Within the block, each stage part reseeds the RNG from ``seed`` and its index (None: no reseeding).

    The RNG state of the caller is restored afterwards, so reseeding never leaks.
    """
    previous = _state["seed"]
    _state["seed"] = seed
    cpu_state = torch.random.get_rng_state() if seed is not None else None
    cuda_state = _cuda_state() if seed is not None else None
    try:
        yield
    finally:
        _state["seed"] = previous
        if cpu_state is not None:
            torch.random.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state)


def current_seed() -> int | None:
    """The microbatch seed set by :func:`microbatch_seed` (None outside)."""
    return _state["seed"]


def reseed_part(seed: int | None, part_index: int) -> None:
    """Reseed the RNG for the part ``part_index`` of the model from a microbatch ``seed`` (None: leave it)."""
    if seed is None:
        return
    value = part_seed(seed, part_index)
    torch.default_generator.manual_seed(value)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.manual_seed(value)


def _cuda_state():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.get_rng_state()
    return None


# Python-level random functions fx may record (aten operators carry the nondeterministic_seeded tag).
_RANDOM_FUNCTIONS = {torch.rand, torch.randn, torch.randint, torch.randperm, torch.bernoulli, torch.normal,
                     torch.multinomial, torch.rand_like, torch.randn_like, torch.randint_like}


def _dropout_is_active(node: fx.Node) -> bool:
    """A dropout call draws random numbers unless its probability is 0 or it is in eval mode."""
    training = node.kwargs.get("training", node.kwargs.get("train", node.args[2] if len(node.args) > 2 else True))
    return not is_inactive_dropout(node) and training is not False


def operator_draws(op: torch._ops.OpOverload, args: Sequence, kwargs: dict) -> bool:
    """Whether a seeded aten operator called with ``args`` and ``kwargs`` draws: not when its dropout
    probability is 0 (dropout, attention) or it runs in eval mode (``train=False``)."""
    for index, argument in enumerate(op._schema.arguments):
        if argument.name not in ("p", "dropout_p", "train"):
            continue
        if argument.name in kwargs:
            value = kwargs[argument.name]
        elif index < len(args):
            value = args[index]
        else:
            value = argument.default_value
        if argument.name == "train" and value is False:
            return False
        if argument.name != "train" and isinstance(value, (int, float)) and value == 0:
            return False
    return True


def _node_is_random(graph_module: fx.GraphModule, node: fx.Node) -> bool:
    target = node.target
    if node.op == "call_function":
        if isinstance(target, torch._ops.OpOverload):
            return torch.Tag.nondeterministic_seeded in target.tags and operator_draws(target, node.args, node.kwargs)
        if target in DROPOUT_CALLS:
            return _dropout_is_active(node)
        return target in _RANDOM_FUNCTIONS
    if node.op == "call_method":
        return target in ("bernoulli_", "uniform_", "normal_", "random_", "exponential_", "geometric_",
                          "cauchy_", "log_normal_", "bernoulli")
    if node.op == "call_module":
        return _module_is_random(graph_module.get_submodule(target))
    return False


def _module_is_random(module: nn.Module) -> bool:
    """A module kept whole by capture: random when it is dropout with p > 0, or when it is not one of
    torch.nn's own modules (its forward cannot be read; assume it may draw)."""
    if isinstance(module, fx.GraphModule):
        return any(_node_is_random(module, node) for node in module.graph.nodes)
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return module.p > 0
    if not type(module).__module__.startswith("torch.nn."):
        return True
    return any(_module_is_random(child) for child in module.children())


def has_random_operations(stage: nn.Module) -> bool:
    """Whether running ``stage`` may draw random numbers, so that its parts need reseeding.

    Captured graphs are read node by node (dropout with p = 0 does not count); a stage made of
    anything else is assumed to draw.
    """
    parts = getattr(stage, "parts", None)
    if parts is None:
        return True
    for part in parts:
        graphs = [part] if isinstance(part, fx.GraphModule) else list(part.children())
        if not graphs or not all(isinstance(g, (fx.GraphModule, RebuildOutput)) for g in graphs):
            return True
        if any(_module_is_random(g) for g in graphs if isinstance(g, fx.GraphModule)):
            return True
    return False
