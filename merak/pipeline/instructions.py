"""Pipeline instructions: plain data that schedules emit and the executor runs.

An instruction names one action of one stage for one step. Schedules build
lists of them (pure Python, no torch); the simulator checks the lists of all
stages together; the executor is the only code that turns them into tensor
operations and communication.

A rank may hold several *chunks* of the model (interleaved schedules): chunk
``c`` of stage (rank) ``s`` is the virtual stage ``c * S + s`` of ``V * S``.
Activations always travel from virtual stage ``v`` to ``v + 1`` and gradients
from ``v + 1`` to ``v``; with one chunk per rank that is simply stage ``s`` to
``s + 1``. Point-to-point instructions name the direction, not a rank.

The executor posts the transfers at each point of a list as one batched group
(an :class:`Exchange`, or a lone transfer), sends complete in the background
(the executor waits for them when the step ends), and a received payload is
waited for just before its first use. Messages between two ranks are matched by
posting order: :mod:`merak.pipeline.transfers` makes both peers post in one
order, and sends that would otherwise wait on each other later, so the lists run
on NCCL's unbuffered sends.

Forward kinds, as in Merak's schedules:

- :class:`Forward` runs under the stage's activation-checkpointing settings
  (any recomputation then happens inside the backward);
- :class:`PreCheckpointForward` (PF) keeps only the stage inputs;
  :class:`RecomputeForward` (RrG) later recomputes that microbatch with full
  activations, before the stage blocks on its gradient, so the backward that
  follows has nothing to recompute. Each is one instruction with its own mode,
  so no global checkpoint setting is flipped and none needs restoring.

Decoding (text generation with a KV cache, :mod:`merak.pipeline.decode_schedule`)
uses the same lists with ``microbatch`` as the decoding step: the hidden states
travel as activations, :class:`DecodeForward` runs a stage's part of one step,
:class:`PickToken` chooses the token on the last stage and :class:`SendToken` /
:class:`RecvToken` carry it from the last stage back to the first (one chunk per
stage).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class _MicrobatchInstruction:
    """Base of instructions about one microbatch of one chunk; ``chunk`` is shown only when not 0."""

    microbatch: int
    chunk: int = 0

    def __repr__(self) -> str:
        chunk = f", chunk={self.chunk}" if self.chunk else ""
        return f"{type(self).__name__}({self.microbatch}{chunk})"


class LoadMicrobatch(_MicrobatchInstruction):
    """Fetch the inputs (first virtual stage) and/or labels (last virtual stage) of a microbatch."""


class Forward(_MicrobatchInstruction):
    """Run the forward of a microbatch under the stage's checkpointing settings."""


class PreCheckpointForward(_MicrobatchInstruction):
    """Run the forward keeping only the stage inputs (PF); a RecomputeForward must follow."""


class RecomputeForward(_MicrobatchInstruction):
    """Recompute a pre-checkpointed microbatch with full activations (RrG), before its backward."""


class Backward(_MicrobatchInstruction):
    """Run the whole backward of a microbatch (loss on the last stage, else the received gradient)."""


class BackwardInput(_MicrobatchInstruction):
    """The input-gradient half of a backward (zero-bubble schedules); sends can follow it."""


class BackwardWeight(_MicrobatchInstruction):
    """The weight-gradient half of a backward, after its BackwardInput."""


class SendActivation(_MicrobatchInstruction):
    """Send a microbatch's stage output to the next virtual stage."""


class RecvActivation(_MicrobatchInstruction):
    """Receive a microbatch's stage input from the previous virtual stage."""


class SendGrad(_MicrobatchInstruction):
    """Send the gradient of a microbatch's stage input to the previous virtual stage."""


class RecvGrad(_MicrobatchInstruction):
    """Receive the gradient of a microbatch's stage output from the next virtual stage."""


class DecodeForward(_MicrobatchInstruction):
    """Decoding: run this stage's blocks on one step's new positions, extending their KV cache
    (the first stage embeds the step's tokens, the last turns its output into next-token logits)."""


class PickToken(_MicrobatchInstruction):
    """Decoding, last stage: choose the step's token from its logits."""


class SendToken(_MicrobatchInstruction):
    """Decoding, last stage: send the step's token to the first stage, whose next step reads it."""


class RecvToken(_MicrobatchInstruction):
    """Decoding, first stage: receive the token the last stage picked at a step."""


# Type aliases (annotations only; isinstance checks use the *_TYPES tuples below). ``X | Y`` of
# classes is evaluated at import time, which Python 3.10+ (requires-python) supports.
P2POp = SendActivation | RecvActivation | SendGrad | RecvGrad
TokenOp = SendToken | RecvToken


@dataclass(frozen=True)
class Exchange:
    """The point-to-point operations of one point of a stage's list (with either neighbour), posted
    together as one batched group, in the order the peers post theirs (:mod:`merak.pipeline.transfers`)."""

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


Instruction = (
    LoadMicrobatch | Forward | PreCheckpointForward | RecomputeForward | Backward | BackwardInput
    | BackwardWeight | SendActivation | RecvActivation | SendGrad | RecvGrad | Exchange | ReduceTiedGrads
    | ReduceGrads | OptimizerStep | DecodeForward | PickToken | SendToken | RecvToken
)

FORWARD_TYPES = (Forward, PreCheckpointForward)
BACKWARD_TYPES = (Backward, BackwardInput, BackwardWeight)
COMPUTE_TYPES = FORWARD_TYPES + (RecomputeForward,) + BACKWARD_TYPES
P2P_TYPES = (SendActivation, RecvActivation, SendGrad, RecvGrad)
# Decoding's token transfers are point-to-point too, but between the last and the first stage, not
# neighbours: the executor leaves them to the decoding handlers, the simulator pairs them.
TOKEN_TYPES = (SendToken, RecvToken)
DECODE_TYPES = (DecodeForward, PickToken) + TOKEN_TYPES
MICROBATCH_TYPES = (LoadMicrobatch,) + COMPUTE_TYPES + P2P_TYPES + DECODE_TYPES
STEP_END_TYPES = (ReduceTiedGrads, ReduceGrads, OptimizerStep)
INSTRUCTION_TYPES = MICROBATCH_TYPES + (Exchange,) + STEP_END_TYPES

# The names listeners receive (zeus's PipelineFrequencyOptimizer knows "forward" and "backward").
INSTRUCTION_NAMES = {
    Forward: "forward", PreCheckpointForward: "forward", RecomputeForward: "recompute",
    Backward: "backward", BackwardInput: "backward_input", BackwardWeight: "backward_weight",
}


def plan_name(instruction: Instruction) -> str:
    """The name energy profiles and frequency plans give a compute instruction: its
    ``INSTRUCTION_NAMES`` name, with ``@chunk`` after it for an interleaved stage's later chunks
    (they hold other layers, so they are profiled and clocked apart)."""
    name = INSTRUCTION_NAMES[type(instruction)]
    return f"{name}@{instruction.chunk}" if instruction.chunk else name


def peer_offset(op: P2POp) -> int:
    """Return +1 when ``op`` talks to the next virtual stage, -1 for the previous one."""
    if isinstance(op, (SendActivation, RecvGrad)):
        return 1
    if isinstance(op, (RecvActivation, SendGrad)):
        return -1
    raise TypeError(f"not a point-to-point instruction: {op!r}")


def is_send(op: P2POp | TokenOp) -> bool:
    """True for the sending half of a point-to-point pair."""
    return isinstance(op, (SendActivation, SendGrad, SendToken))


def virtual_stage(stage_id: int, chunk: int, num_stages: int) -> int:
    """The position of chunk ``chunk`` of stage ``stage_id`` in the model's chain of virtual stages."""
    return chunk * num_stages + stage_id


def peer_of(op: P2POp | TokenOp, stage_id: int, num_stages: int) -> tuple[int, int]:
    """``(stage, chunk)`` of the partner of ``op`` run on ``stage_id``."""
    if isinstance(op, TOKEN_TYPES):
        return (0, 0) if is_send(op) else (num_stages - 1, 0)
    peer = virtual_stage(stage_id, op.chunk, num_stages) + peer_offset(op)
    return peer % num_stages, peer // num_stages


def matching_op(op: P2POp | TokenOp, stage_id: int, num_stages: int) -> P2POp | TokenOp:
    """The instruction the peer stage must run to complete ``op`` run on ``stage_id``."""
    pairs = {
        SendActivation: RecvActivation,
        RecvActivation: SendActivation,
        SendGrad: RecvGrad,
        RecvGrad: SendGrad,
        SendToken: RecvToken,
        RecvToken: SendToken,
    }
    _, chunk = peer_of(op, stage_id, num_stages)
    return pairs[type(op)](op.microbatch, chunk)


def p2p_ops(instruction: Instruction) -> tuple[P2POp | TokenOp, ...]:
    """The point-to-point operations inside an instruction (empty for compute and others)."""
    if isinstance(instruction, Exchange):
        return instruction.ops
    if isinstance(instruction, P2P_TYPES + TOKEN_TYPES):
        return (instruction,)
    return ()
