"""Runs a stage's instruction list: the only pipeline code that communicates.

The executor owns the per-microbatch state of one step (received inputs,
outputs kept for backward, losses) and maps each instruction to tensor work
or point-to-point transfers. Gradient reduction and the optimizer step are
delegated to handlers supplied by the engine, so this file knows nothing
about data parallelism or optimizers.

A rank may run several model chunks (interleaved schedules); state is keyed
by (chunk, microbatch).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch import nn
from torch.distributed.pipelining._backward import (
    stage_backward_input,
    stage_backward_weight,
)
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from merak.compat.flops import flop_counter
from merak.distributed.p2p import PointToPoint
from merak.pipeline import instructions as ins
from merak.pipeline.compiled import eager_execution
from merak.pipeline.hooks import HookList, InstructionEvent, PipelineHook
from merak.pipeline.memory import ActivationMeter, NoMeter, active_meter
from merak.pipeline.recompute import checkpointing, counting_recomputation, has_random_operations, microbatch_seed

LossFn = Callable[[object, Mapping[str, torch.Tensor]], torch.Tensor]
Key = tuple[int, int]  # (chunk, microbatch)


def _grad_pairs(outputs, grads) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Match output tensors with the gradients received for them."""
    out_leaves = pytree.tree_leaves(outputs)
    grad_leaves = pytree.tree_leaves(grads, is_leaf=lambda x: x is None)
    tensors, gradients = [], []
    for out, grad in zip(out_leaves, grad_leaves, strict=True):
        if isinstance(out, torch.Tensor) and out.requires_grad and grad is not None:
            tensors.append(out)
            gradients.append(grad)
    return tensors, gradients


def _input_grads(inputs):
    """The gradient payload to send back: same structure as the inputs, None where no grad."""
    def grad_of(leaf):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            return leaf.grad
        return None
    return pytree.tree_map(grad_of, inputs)


def _tensor_leaves(payload) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(payload) if isinstance(leaf, torch.Tensor)]


def _cast_floats(tree, dtype: torch.dtype):
    """``tree`` with its floating-point tensors in ``dtype`` (others untouched)."""
    return pytree.tree_map(
        lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype
        else x, tree)


class PipelineExecutor:
    """Executes instruction lists for one pipeline stage.

    Args:
        stage: this rank's stage module (one chunk); or give ``stages``.
        stages: this rank's modules by chunk (interleaved schedules).
        stage_id: index of the stage (rank position in the pipeline).
        num_stages: number of pipeline stages.
        num_chunks: model chunks per stage.
        prev_rank: global rank of the previous stage (None on the first stage without chunks).
        next_rank: global rank of the next stage (None on the last stage without chunks).
        p2p: transport for pytrees between stages.
        loss_fn: ``loss_fn(stage_output, microbatch) -> scalar`` (last virtual stage only).
        step_handlers: callables for ReduceTiedGrads, ReduceGrads and OptimizerStep.
        hooks: listeners called around the step and each compute instruction.
        dropout_seed: ``dropout_seed(step, microbatch)`` -> the seed parts reseed from (None: no reseeding).
        free_sent_outputs: release an activation's storage once it has been sent, keeping
            whatever backward needs (``dealloc_pipeoutput``).
        record_timeline: keep (instruction, start, end) of every instruction of the last step.
        compute_dtype: the dtype of floating-point data fed to the first stage (fp16/bf16
            runs); the last stage's outputs reach ``loss_fn`` in float32, unless the loss is marked
            with ``merak.tensor_parallel.cross_entropy.accepts_half_precision`` (then as they are).
        loss_scale: the current fp16 loss scale (the backward starts from this gradient).
        measure_activations: file every tensor autograd saves (a Python hook per saved tensor) to
            report the exact peak of saved activations; off, nothing runs per saved tensor. Forced on
            by ``free_sent_outputs``, which must know what the backward still reads.
        instruction_handlers: ``handler(instruction, step)`` for instruction kinds run outside this
            file (decoding's: :mod:`merak.pipeline.decode`). ``step`` holds the step's ``inputs`` and
            ``outputs`` by (chunk, microbatch), which the activation transfers fill and send, and its
            ``pending`` sends, which are awaited when the step ends.
    """

    def __init__(self, *, stage: nn.Module | None = None, stages: Mapping[int, nn.Module] | None = None,
                 stage_id: int, num_stages: int, num_chunks: int = 1,
                 prev_rank: int | None, next_rank: int | None, p2p: PointToPoint | None,
                 loss_fn: LossFn, step_handlers: Mapping[type, Callable[[], None]],
                 hooks: Sequence[PipelineHook] = (), dropout_seed: Callable[[int, int], int] | None = None,
                 free_sent_outputs: bool = False, record_timeline: bool = False,
                 compute_dtype: torch.dtype = torch.float32, loss_scale: Callable[[], float] | None = None,
                 measure_activations: bool = False,
                 instruction_handlers: Mapping[type, Callable[[ins.Instruction, _StepState], None]] | None = None,
                 ) -> None:
        if (stage is None) == (stages is None):
            raise ValueError("give either stage or stages")
        self.stages = dict(stages) if stages is not None else {0: stage}
        self.stage = self.stages[0]
        self.stage_id = stage_id
        self.num_stages = num_stages
        self.num_chunks = num_chunks
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self.p2p = p2p
        self.loss_fn = loss_fn
        self.step_handlers = dict(step_handlers)
        self.instruction_handlers = dict(instruction_handlers or {})
        self.hooks = HookList(hooks)
        self.dropout_seed = dropout_seed
        self.free_sent_outputs = free_sent_outputs
        self.record_timeline = record_timeline
        self.compute_dtype = compute_dtype
        self._cast_outputs = compute_dtype != torch.float32 and not getattr(loss_fn, "accepts_half_precision", False)
        self.loss_scale = loss_scale
        self.timeline: list[tuple[ins.Instruction, float, float]] = []
        params = {id(p): p for module in self.stages.values() for p in module.parameters()}
        self.meter = ActivationMeter(params.values()) if measure_activations or free_sent_outputs else NoMeter()
        # Reseeding the RNG before every part costs host time; stages without random operations skip it.
        self._reseeds = {chunk: has_random_operations(module) for chunk, module in self.stages.items()}
        self.step_index = 0
        # Forward FLOPs of one microbatch in each local chunk, counted on the chunk's first forward
        # (for the run summary's model FLOPs and MFU, and the listeners' instruction events).
        self.chunk_flops: dict[int, int] = {}
        self.chunk_recomputed_flops: dict[int, int] = {}  # of the checkpointed parts its backward runs again
        self.outputs: dict[int, object] = {}

    @property
    def forward_flops(self) -> int | None:
        """Forward FLOPs of one microbatch through this rank's chunks (None before they all ran)."""
        return sum(self.chunk_flops.values()) if len(self.chunk_flops) == self.num_chunks else None

    def _virtual(self, chunk: int) -> int:
        return ins.virtual_stage(self.stage_id, chunk, self.num_stages)

    def _is_first(self, chunk: int) -> bool:
        return self._virtual(chunk) == 0

    def _is_last(self, chunk: int) -> bool:
        return self._virtual(chunk) == self.num_chunks * self.num_stages - 1

    def run(self, instructions: Sequence[ins.Instruction],
            microbatches: Sequence[Mapping[str, torch.Tensor]] | None, *, keep_outputs: bool = False) -> float | None:
        """Run one step.

        Args:
            instructions: this stage's list from a schedule.
            microbatches: the step's microbatches (dicts of tensors) on the ranks holding the
                first or last virtual stage; None elsewhere.
            keep_outputs: keep the last virtual stage's outputs in ``self.outputs`` (microbatch ->
                outputs) for prediction; a training step leaves it empty.

        Returns:
            On the rank holding the last virtual stage, the sum of the (scaled) microbatch
            losses; None elsewhere.
        """
        forwards = sum(isinstance(i, ins.FORWARD_TYPES) for i in instructions)
        self._step = _StepState(forwards // self.num_chunks)
        self._microbatches = microbatches
        self._keep_outputs = keep_outputs
        self.outputs = {}
        self.timeline = []
        clock = time.perf_counter
        self.hooks.on_step_begin()
        try:
            with active_meter(self.meter):
                for instruction in instructions:
                    start = clock()
                    self._dispatch(instruction)
                    if self.record_timeline:
                        self.timeline.append((instruction, start, clock()))
                    if self._step.pending:
                        self._prune_sends()
            self._wait_sends()
        finally:
            self.hooks.on_step_end()
        losses = self._step.losses
        self._step = None
        self.step_index += 1
        if not self._is_last(self.num_chunks - 1):
            return None
        # One host-device synchronisation per step, not one per microbatch.
        return float(torch.stack(list(losses.values())).sum()) if losses else 0.0

    def step_loss(self) -> torch.Tensor | None:
        """The sum of the current step's (scaled) microbatch losses so far, on the rank holding the
        last virtual stage (None elsewhere, or outside a step). No host synchronisation."""
        losses = self._step.losses if self._step is not None else {}
        return torch.stack([loss.detach() for loss in losses.values()]).sum() if losses else None

    # -- dispatch ----------------------------------------------------------------

    def _dispatch(self, instruction: ins.Instruction) -> None:
        kind = type(instruction)
        if kind in ins.FORWARD_TYPES or kind is ins.RecomputeForward:
            self._forward(instruction)
        elif kind in (ins.Backward, ins.BackwardInput):
            self._backward(instruction)
        elif kind is ins.BackwardWeight:
            self._backward_weight(instruction)
        elif kind is ins.LoadMicrobatch:
            self._load(instruction)
        elif kind is ins.Exchange:
            self._exchange(instruction.ops)
        elif kind in ins.P2P_TYPES:
            self._exchange((instruction,))
        elif kind in self.step_handlers:
            self.step_handlers[kind]()
        elif kind in self.instruction_handlers:
            self._arrive_all()  # handlers read the step's buffers directly
            self.instruction_handlers[kind](instruction, self._step)
        else:
            raise TypeError(f"stage {self.stage_id} cannot run instruction {instruction!r}")

    def _event(self, instruction: ins.Instruction) -> InstructionEvent:
        """What listeners learn about compute ``instruction``."""
        return InstructionEvent.of(instruction, stage=self.stage_id, step=self.step_index,
                                   chunk_forward_flops=self.chunk_flops.get(instruction.chunk),
                                   chunk_recomputed_flops=self.chunk_recomputed_flops.get(instruction.chunk, 0))

    @contextlib.contextmanager
    def _counting_flops(self, chunk: int) -> Iterator[None]:
        """On the chunk's first forward (of any kind), count the FLOPs of the block into ``chunk_flops``."""
        if chunk in self.chunk_flops:
            yield
            return
        counter = flop_counter()
        with counter, counting_recomputation() as recomputed, eager_execution():  # dynamo does not trace
            yield                                                                 # under a counting mode
        self.chunk_flops[chunk] = counter.get_total_flops()
        self.chunk_recomputed_flops[chunk] = recomputed.flops

    def _load(self, instruction: ins.LoadMicrobatch) -> None:
        if self._microbatches is None:
            raise RuntimeError(f"stage {self.stage_id} was asked to load data but was given none")
        key = (instruction.chunk, instruction.microbatch)
        batch = self._microbatches[instruction.microbatch]
        self._step.batches[key] = batch
        if self._is_first(instruction.chunk):
            self._step.inputs[key] = batch if self.compute_dtype == torch.float32 \
                else _cast_floats(batch, self.compute_dtype)

    def _forward(self, instruction) -> None:
        step, chunk, m = self._step, instruction.chunk, instruction.microbatch
        key = (chunk, m)
        self._arrive(True, key)
        stage, inputs = self.stages[chunk], step.inputs[key]
        kind = type(instruction)
        seed = self.dropout_seed(self.step_index, m) \
            if self.dropout_seed is not None and self._reseeds[chunk] else None
        self.hooks.on_instruction_begin(self._event(instruction))
        if kind is ins.RecomputeForward:
            self.meter.release(key)  # the pre-checkpointed run kept only the inputs, filed again below
        with microbatch_seed(seed), self.meter.saving(key):
            if not self._is_first(chunk):
                self.meter.keep(key, inputs)
            with self._counting_flops(chunk):
                if kind is ins.PreCheckpointForward:
                    # Only the inputs are kept; the outputs still carry a graph, so the next stage
                    # learns which of them need gradients.
                    with checkpointing("none"):
                        outputs = checkpoint(stage, inputs, use_reentrant=False)
                elif kind is ins.RecomputeForward:
                    with checkpointing("none"):
                        outputs = stage(inputs)
                else:
                    outputs = stage(inputs)
            if self._is_last(chunk):
                batch = step.batches[key] if kind is ins.PreCheckpointForward else step.batches.pop(key)
                if self._cast_outputs:
                    outputs = _cast_floats(outputs, torch.float32)
                if self._keep_outputs:
                    self.outputs[m] = outputs
                step.losses[key] = self.loss_fn(outputs, batch) / step.num_microbatches
            else:
                step.outputs[key] = outputs
        self.hooks.on_instruction_end(self._event(instruction))
        if self._is_first(chunk) and kind is not ins.PreCheckpointForward:
            # The first stage's inputs are data, not activations: nothing to send back.
            step.inputs.pop(key)

    def _backward(self, instruction) -> None:
        step, chunk = self._step, instruction.chunk
        key = (chunk, instruction.microbatch)
        whole = type(instruction) is ins.Backward
        self.hooks.on_instruction_begin(self._event(instruction))
        if self._is_last(chunk):
            loss = step.losses[key]
            scale = self.loss_scale() if self.loss_scale is not None else 1.0
            tensors, grads = [loss], [torch.full_like(loss, scale)]
            step.losses[key] = loss.detach()
        else:
            self._arrive(False, key)
            tensors, grads = _grad_pairs(step.outputs.pop(key), step.grads.pop(key))
        inputs = step.inputs.pop(key, None)
        leaves = [] if self._is_first(chunk) else [leaf for leaf in _tensor_leaves(inputs) if leaf.requires_grad]
        if whole or not leaves:
            # No input gradient to hurry (the first stage's inputs are data, and so are those of a stage fed
            # only data, such as token ids passed on by a stage without weights): BackwardInput does the whole
            # backward. torch's split would compute no weight gradient at all for such a stage.
            if tensors:
                torch.autograd.backward(tensors, grads)
            if not whole:
                step.split_done.add(key)
            input_grads = None if self._is_first(chunk) else _input_grads(inputs)
        else:
            weights = [p for p in self.stages[chunk].parameters() if p.requires_grad]
            grads_in, param_groups = stage_backward_input(tensors, grads, leaves, iter(weights))
            step.param_groups[key] = (weights, param_groups)
            by_id = {id(leaf): grad for leaf, grad in zip(leaves, grads_in)}
            input_grads = pytree.tree_map(
                lambda leaf: by_id.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None, inputs)
        if not self._is_first(chunk):
            step.input_grads[key] = input_grads
        if whole:
            self.meter.release(key)
        self.hooks.on_instruction_end(self._event(instruction))

    def _backward_weight(self, instruction: ins.BackwardWeight) -> None:
        key = (instruction.chunk, instruction.microbatch)
        self.hooks.on_instruction_begin(self._event(instruction))
        if key in self._step.split_done:
            self._step.split_done.discard(key)
        else:
            weights, param_groups = self._step.param_groups.pop(key)
            stage_backward_weight(iter(weights), param_groups)
        self.meter.release(key)
        self.hooks.on_instruction_end(self._event(instruction))

    # -- communication -----------------------------------------------------------

    def _peer(self, op: ins.P2POp) -> int:
        rank = self.next_rank if ins.peer_offset(op) > 0 else self.prev_rank
        if rank is None:
            raise RuntimeError(f"stage {self.stage_id} has no neighbour for {op!r}")
        return rank

    def _channel(self, op: ins.P2POp) -> int:
        """The label both sides give a transfer: one per chain boundary and direction (boundary ``b`` joins
        virtual stages ``b`` and ``b + 1``; activations over it are ``2b``, gradients ``2b + 1``). It keys
        the description cache only: messages are matched by posting order."""
        boundary = self._virtual(op.chunk) + (0 if ins.peer_offset(op) > 0 else -1)
        return 2 * boundary + (0 if isinstance(op, (ins.SendActivation, ins.RecvActivation)) else 1)

    def _exchange(self, ops: Sequence[ins.P2POp]) -> None:
        """Post the transfers of one point of the schedule as one batched group, in the list's order (the
        schedule gives both peers the same order: :mod:`merak.pipeline.transfers`). Receives are waited
        for where their payload is first used, not here."""
        step = self._step
        sends, recvs = [], []
        for op in ops:
            key = (op.chunk, op.microbatch)
            if isinstance(op, ins.SendActivation):
                # Sending detaches what it transmits; the requires_grad flags it announces
                # tell the next stage which inputs need gradients back.
                sends.append((op, step.outputs[key]))
            elif isinstance(op, ins.SendGrad):
                sends.append((op, step.input_grads.pop(key)))
            else:
                recvs.append(op)
        transfer = self.p2p.post([(payload, self._peer(op), self._channel(op)) for op, payload in sends],
                                 [(self._peer(op), self._channel(op)) for op in recvs])
        if sends:  # the payloads and the transfer (its wire buffers) stay alive until the sends complete
            step.pending.append((([payload for _, payload in sends], transfer), transfer.send_works))
        if self.free_sent_outputs:
            for op, payload in sends:
                if isinstance(op, ins.SendActivation):
                    self._release_outputs((op.chunk, op.microbatch), payload)
        for op, value in zip(recvs, transfer.received):
            activation = isinstance(op, ins.RecvActivation)
            key = (op.chunk, op.microbatch)
            (step.inputs if activation else step.grads)[key] = value
            step.arriving[(activation, key)] = transfer

    def _arrive(self, activation: bool, key: Key) -> None:
        """Wait for a received payload before its first use (on NCCL the stream waits, not the host)."""
        transfer = self._step.arriving.pop((activation, key), None)
        if transfer is not None:
            transfer.wait()

    def _arrive_all(self) -> None:
        for transfer in self._step.arriving.values():
            transfer.wait()
        self._step.arriving.clear()

    def _release_outputs(self, key: Key, outputs) -> None:
        """Point sent output tensors at a one-element placeholder; the transfer keeps its own
        reference until it completes. Tensors the backward reads (saved by autograd, kept by a
        checkpoint, or stage inputs passed through) are left alone."""
        needed = self.meter.kept_storages(key)
        for leaf in _tensor_leaves(outputs):
            if leaf.grad_fn is None or leaf.device.type == "meta":
                continue
            if leaf.untyped_storage().data_ptr() in needed:
                continue
            placeholder = torch.zeros((), dtype=leaf.dtype, device=leaf.device).expand(leaf.shape)
            leaf.data = placeholder

    def _prune_sends(self) -> None:
        """Drop finished sends from the front of the queue, so their buffers can be freed before the step
        ends (sends finish in about the order they were posted; a later one that finished first waits
        its turn, which keeps this check cheap however many are queued)."""
        pending = self._step.pending
        while pending and all(work.is_completed() for work in pending[0][1]):
            pending.pop(0)

    def _wait_sends(self) -> None:
        self._arrive_all()
        for _, works in self._step.pending:
            for work in works:
                work.wait()
        self._step.pending.clear()


class _StepState:
    """Per-step, per-(chunk, microbatch) buffers; dropped when the step ends."""

    def __init__(self, num_microbatches: int) -> None:
        self.num_microbatches = num_microbatches
        self.batches: dict[Key, Mapping[str, torch.Tensor]] = {}
        self.inputs: dict[Key, object] = {}
        self.outputs: dict[Key, object] = {}
        self.grads: dict[Key, object] = {}
        self.input_grads: dict[Key, object] = {}
        self.losses: dict[Key, torch.Tensor] = {}
        self.param_groups: dict[Key, tuple] = {}
        self.split_done: set[Key] = set()
        self.pending: list = []
        self.arriving: dict[tuple[bool, Key], object] = {}  # (activation?, key) -> its Transfer
