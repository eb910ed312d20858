"""One rank's part of decoding: the decode schedule run by a pipeline executor.

Each decoding step's instructions (:func:`merak.pipeline.decode_schedule.decode_step`)
run on a :class:`~merak.pipeline.executor.PipelineExecutor`: the hidden states travel
as its activations (its point-to-point layer, tags and waits), and the decoding kinds
are handled here: :class:`DecodeForward` runs this rank's blocks with the sequence's KV
cache, :class:`PickToken` chooses the token on the last stage (the tensor-parallel ranks
alike), and :class:`SendToken` / :class:`RecvToken` carry it to the first stage through
the same point-to-point layer. The executor is one of decoding's own, without the
training listeners (timers, energy meters) and step count of the engine's, so that
decoding is not mistaken for training steps.

A sequence ends early when its token is an end-of-sequence token: at the next step the
first stage, which has just received that token, sends a stop marker (no hidden states)
instead of running its blocks; every other stage passes the marker on (the last stage
absorbs it) and stops. No collective is needed for the stages to agree.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from merak.distributed.collectives import all_gather_single
from merak.distributed.groups import ParallelState
from merak.distributed.p2p import PointToPoint
from merak.pipeline.decode_adapter import DecoderAdapter
from merak.pipeline.decode_sampling import GenerationOptions, pick_token
from merak.pipeline.decode_schedule import decode_step
from merak.pipeline.executor import PipelineExecutor
from merak.pipeline.instructions import DecodeForward, PickToken, RecvToken, SendToken

logger = logging.getLogger(__name__)

# Sent on the activation channel in place of hidden states once the sequence has ended.
STOP_MARKER = None


class _Sequence:
    """One sequence's decoding state on this rank."""

    def __init__(self, prompt: list[int], options: GenerationOptions, eos_token_ids: frozenset[int],
                 generator: torch.Generator, cache: object, device: torch.device) -> None:
        self.options, self.eos_token_ids, self.generator, self.cache = options, eos_token_ids, generator, cache
        self.next_ids = torch.tensor([prompt], device=device)  # what the first stage embeds at the next step
        self.position = 0  # where the next step's positions start
        self.picked: list[int] = []  # the tokens this rank picked (last stage)
        self.stop_step: int | None = None  # the step whose token ended the sequence

    def ended_before(self, step: int) -> bool:
        """Whether an earlier step's token ended the sequence."""
        return self.stop_step is not None and step > self.stop_step


def _no_loss(outputs, batch) -> torch.Tensor:
    raise RuntimeError("decoding computes no loss")


class PipelineDecoder:
    """Continues prompts through the pipeline; every rank of one pipeline (one dp replica) takes part.

    Args:
        adapter: the model family's decoder.
        blocks: the decoder blocks this rank holds, in order.
        state: this rank's place in the grid.
        dtype: the dtype of the hidden states (the training precision).
        vocab_parallel: whether the logits are split over the tensor-parallel ranks.
    """

    def __init__(self, adapter: DecoderAdapter, blocks: list[nn.Module], state: ParallelState, *,
                 dtype: torch.dtype, vocab_parallel: bool) -> None:
        grid, rank = state.grid, state.rank
        self.adapter, self.blocks, self.state = adapter, blocks, state
        self.dtype, self.vocab_parallel = dtype, vocab_parallel
        self.stage_id, self.num_stages = state.coordinates.pp, grid.pp
        self.first, self.last = state.is_first_stage, state.is_last_stage
        self.first_rank, self.last_rank = grid.stage_rank(rank, 0), grid.stage_rank(rank, grid.pp - 1)
        self.p2p = PointToPoint(state.device) if grid.pp > 1 else None
        # Activations and gradients over boundary b are channels 2b and 2b + 1; the token's comes after all.
        self.token_channel = 2 * grid.pp
        self.executor = PipelineExecutor(
            stage=nn.ModuleList(blocks), stage_id=self.stage_id, num_stages=grid.pp,
            prev_rank=None if self.first else grid.stage_rank(rank, self.stage_id - 1),
            next_rank=None if self.last else grid.stage_rank(rank, self.stage_id + 1),
            p2p=self.p2p, loss_fn=_no_loss, step_handlers={},
            instruction_handlers={DecodeForward: self._forward, PickToken: self._pick,
                                  SendToken: self._send_token, RecvToken: self._recv_token})
        self._sequence: _Sequence | None = None

    def continue_prompt(self, prompt: list[int], options: GenerationOptions, eos_token_ids: frozenset[int],
                        generator: torch.Generator) -> list[int] | None:
        """Continue ``prompt`` to ``options.max_length`` tokens, or through the first of ``eos_token_ids``.

        Every rank of the pipeline calls it with the same prompt. Returns the whole sequence on the
        last stage (which picked the tokens), None on the other stages.
        """
        num_steps = max(0, options.max_length - len(prompt))
        sequence = _Sequence(prompt, options, eos_token_ids, generator, self.adapter.new_cache(), self.state.device)
        self._sequence = sequence
        try:
            for step in range(num_steps):
                self.executor.run(decode_step(self.stage_id, self.num_stages, step, num_steps), None)
                if sequence.ended_before(step):  # the stop marker has passed this stage
                    break
        finally:
            self._sequence = None
        return prompt + sequence.picked if self.last else None

    # -- instruction handlers (called by the executor with the step's buffers) ---------------

    def _forward(self, instruction: DecodeForward, step) -> None:
        sequence, key = self._sequence, (0, instruction.microbatch)
        received = None if self.first else step.inputs.pop(key)
        if received is STOP_MARKER and not self.first and sequence.stop_step is None:
            sequence.stop_step = instruction.microbatch - 1
        if sequence.ended_before(instruction.microbatch):
            step.outputs[key] = STOP_MARKER
            return
        length = sequence.next_ids.shape[1] if self.first else received.shape[1]
        positions = torch.arange(sequence.position, sequence.position + length, device=self.state.device)[None]
        hidden = self.adapter.embed(sequence.next_ids, positions).to(self.dtype) if self.first else received
        for block in self.blocks:
            hidden = self.adapter.run_block(block, hidden, sequence.cache, positions)
        sequence.position += length
        # The last stage's output is the logits of the last position; the others' the hidden states.
        step.outputs[key] = self.adapter.head(hidden[:, -1:]).float()[0, -1] if self.last else hidden

    def _pick(self, instruction: PickToken, step) -> None:
        sequence, logits = self._sequence, step.outputs.pop((0, instruction.microbatch))
        if sequence.ended_before(instruction.microbatch):
            return
        if self.vocab_parallel:
            logits = self._whole_vocabulary(logits)
        token = pick_token(logits, sequence.options, sequence.generator)
        sequence.picked.append(token)
        sequence.next_ids = torch.tensor([[token]], device=self.state.device)
        if token in sequence.eos_token_ids:
            sequence.stop_step = instruction.microbatch

    def _whole_vocabulary(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits of every tensor-parallel rank's part of the vocabulary, in rank order."""
        whole = torch.empty(self.state.grid.tp * logits.numel(), dtype=logits.dtype, device=logits.device)
        all_gather_single(whole, logits.contiguous(), group=self.state.tp_group)
        return whole

    def _send_token(self, instruction: SendToken, step) -> None:
        if self._sequence.ended_before(instruction.microbatch):
            return
        token = self._sequence.next_ids[0]
        step.pending.append((token, self.p2p.post_send(token, self.first_rank, self.token_channel)))

    def _recv_token(self, instruction: RecvToken, step) -> None:
        token = self.p2p.recv(self.last_rank, self.token_channel)
        self._sequence.next_ids = token.view(1, 1)
        if int(token) in self._sequence.eos_token_ids:
            self._sequence.stop_step = instruction.microbatch
