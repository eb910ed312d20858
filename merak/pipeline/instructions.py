"""Pipeline instructions: plain data that schedules emit and the executor runs.

An instruction names one action of one stage for one step. Schedules build
lists of them (pure Python, no torch); the simulator checks the lists of all
stages together; the executor is the only code that turns them into tensor
operations and communication.

Point-to-point instructions name the *peer direction*, not a rank: activations
always travel from stage ``s`` to ``s + 1`` and gradients from ``s + 1`` to
``s``. An :class:`Exchange` groups several point-to-point operations with the
same neighbour that are posted together and completed together (one batched
``batch_isend_irecv``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class LoadMicrobatch:
    """Fetch the inputs (first stage) and/or labels (last stage) of a microbatch."""

    microbatch: int


@dataclass(frozen=True)
class Forward:
    """Run the stage forward on a microbatch, keeping what backward needs."""

    microbatch: int


@dataclass(frozen=True)
class Backward:
    """Run the stage backward of a microbatch (loss on the last stage, else the received gradient)."""

    microbatch: int


@dataclass(frozen=True)
class SendActivation:
    """Send a microbatch's stage output to the next stage."""

    microbatch: int


@dataclass(frozen=True)
class RecvActivation:
    """Receive a microbatch's stage input from the previous stage."""

    microbatch: int


@dataclass(frozen=True)
class SendGrad:
    """Send the gradient of a microbatch's stage input to the previous stage."""

    microbatch: int


@dataclass(frozen=True)
class RecvGrad:
    """Receive the gradient of a microbatch's stage output from the next stage."""

    microbatch: int


P2POp = Union[SendActivation, RecvActivation, SendGrad, RecvGrad]


@dataclass(frozen=True)
class Exchange:
    """Point-to-point operations with one neighbour, posted together, completed together."""

    ops: tuple[P2POp, ...]


@dataclass(frozen=True)
class ReduceTiedGrads:
    """Sum gradients of weights shared between stages (e.g. embedding and LM head)."""


@dataclass(frozen=True)
class ReduceGrads:
    """Average gradients over the data-parallel group."""


@dataclass(frozen=True)
class OptimizerStep:
    """Clip gradients and apply the optimizer update."""


Instruction = Union[
    LoadMicrobatch,
    Forward,
    Backward,
    SendActivation,
    RecvActivation,
    SendGrad,
    RecvGrad,
    Exchange,
    ReduceTiedGrads,
    ReduceGrads,
    OptimizerStep,
]

COMPUTE_TYPES = (Forward, Backward)
P2P_TYPES = (SendActivation, RecvActivation, SendGrad, RecvGrad)
MICROBATCH_TYPES = (LoadMicrobatch, Forward, Backward) + P2P_TYPES
STEP_END_TYPES = (ReduceTiedGrads, ReduceGrads, OptimizerStep)
INSTRUCTION_TYPES = MICROBATCH_TYPES + (Exchange,) + STEP_END_TYPES


def peer_offset(op: P2POp) -> int:
    """Return +1 when ``op`` talks to the next stage, -1 for the previous stage."""
    if isinstance(op, (SendActivation, RecvGrad)):
        return 1
    if isinstance(op, (RecvActivation, SendGrad)):
        return -1
    raise TypeError(f"not a point-to-point instruction: {op!r}")


def is_send(op: P2POp) -> bool:
    """True for the sending half of a point-to-point pair."""
    return isinstance(op, (SendActivation, SendGrad))


def matching_op(op: P2POp) -> P2POp:
    """The instruction the peer stage must run to complete ``op``."""
    pairs = {
        SendActivation: RecvActivation,
        RecvActivation: SendActivation,
        SendGrad: RecvGrad,
        RecvGrad: SendGrad,
    }
    return pairs[type(op)](op.microbatch)


def p2p_ops(instruction: Instruction) -> tuple[P2POp, ...]:
    """The point-to-point operations inside an instruction (empty for compute and others)."""
    if isinstance(instruction, Exchange):
        return instruction.ops
    if isinstance(instruction, P2P_TYPES):
        return (instruction,)
    return ()
