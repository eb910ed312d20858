"""Runs a stage's instruction list: the only pipeline code that communicates.

The executor owns the per-microbatch state of one step (received inputs,
outputs kept for backward, losses) and maps each instruction to tensor work
or point-to-point transfers. Gradient reduction and the optimizer step are
delegated to handlers supplied by the engine, so this file knows nothing
about data parallelism or optimizers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from merak.distributed.p2p import PointToPoint
from merak.pipeline import instructions as ins
from merak.pipeline.hooks import HookList, PipelineHook

LossFn = Callable[[object, Mapping[str, torch.Tensor]], torch.Tensor]


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


class PipelineExecutor:
    """Executes instruction lists for one pipeline stage.

    Args:
        stage: this rank's stage module.
        stage_id: index of the stage.
        num_stages: number of pipeline stages.
        prev_rank: global rank of the previous stage (None on the first stage).
        next_rank: global rank of the next stage (None on the last stage).
        p2p: transport for pytrees between stages.
        loss_fn: ``loss_fn(stage_output, microbatch) -> scalar`` (last stage only).
        step_handlers: callables for ReduceTiedGrads, ReduceGrads and OptimizerStep.
        hooks: listeners called around the step and each compute instruction.
    """

    def __init__(self, *, stage: nn.Module, stage_id: int, num_stages: int,
                 prev_rank: int | None, next_rank: int | None, p2p: PointToPoint | None,
                 loss_fn: LossFn, step_handlers: Mapping[type, Callable[[], None]],
                 hooks: Sequence[PipelineHook] = ()) -> None:
        self.stage = stage
        self.stage_id = stage_id
        self.num_stages = num_stages
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self.p2p = p2p
        self.loss_fn = loss_fn
        self.step_handlers = dict(step_handlers)
        self.hooks = HookList(hooks)
        self.is_first = stage_id == 0
        self.is_last = stage_id == num_stages - 1

    def run(self, instructions: Sequence[ins.Instruction],
            microbatches: Sequence[Mapping[str, torch.Tensor]] | None) -> float | None:
        """Run one step.

        Args:
            instructions: this stage's list from a schedule.
            microbatches: the step's microbatches (dicts of tensors) on the first and
                last stage; None elsewhere.

        Returns:
            On the last stage, the mean of the microbatch losses; None elsewhere.
        """
        num_microbatches = sum(isinstance(i, ins.Forward) for i in instructions)
        self._step = _StepState(num_microbatches)
        self._microbatches = microbatches
        self.hooks.on_step_begin()
        try:
            for instruction in instructions:
                self._dispatch(instruction)
            self._wait_sends()
        finally:
            self.hooks.on_step_end()
        losses = self._step.losses
        self._step = None
        if not self.is_last:
            return None
        return float(sum(loss.item() for loss in losses.values()))

    # -- dispatch ----------------------------------------------------------------

    def _dispatch(self, instruction: ins.Instruction) -> None:
        kind = type(instruction)
        if kind is ins.Forward:
            self._forward(instruction.microbatch)
        elif kind is ins.Backward:
            self._backward(instruction.microbatch)
        elif kind is ins.LoadMicrobatch:
            self._load(instruction.microbatch)
        elif kind is ins.Exchange:
            self._exchange(instruction.ops)
        elif kind in ins.P2P_TYPES:
            self._exchange((instruction,))
        elif kind in self.step_handlers:
            self.step_handlers[kind]()
        else:
            raise TypeError(f"stage {self.stage_id} cannot run instruction {instruction!r}")

    def _load(self, microbatch: int) -> None:
        if self._microbatches is None:
            raise RuntimeError(f"stage {self.stage_id} was asked to load data but was given none")
        batch = self._microbatches[microbatch]
        self._step.batches[microbatch] = batch
        if self.is_first:
            self._step.inputs[microbatch] = batch

    def _forward(self, microbatch: int) -> None:
        step = self._step
        inputs = step.inputs[microbatch]
        self.hooks.on_instruction_begin("forward")
        outputs = self.stage(inputs)
        if self.is_last:
            loss = self.loss_fn(outputs, step.batches.pop(microbatch))
            step.losses[microbatch] = loss / step.num_microbatches
        else:
            step.outputs[microbatch] = outputs
        self.hooks.on_instruction_end("forward")
        if self.is_first:
            # The first stage's inputs are data, not activations: nothing to send back.
            step.inputs.pop(microbatch)

    def _backward(self, microbatch: int) -> None:
        step = self._step
        self.hooks.on_instruction_begin("backward")
        if self.is_last:
            step.losses[microbatch].backward()
            step.losses[microbatch] = step.losses[microbatch].detach()
        else:
            tensors, grads = _grad_pairs(step.outputs.pop(microbatch), step.grads.pop(microbatch))
            if tensors:
                torch.autograd.backward(tensors, grads)
        if not self.is_first:
            step.input_grads[microbatch] = _input_grads(step.inputs.pop(microbatch))
        self.hooks.on_instruction_end("backward")

    # -- communication -----------------------------------------------------------

    def _exchange(self, ops: Sequence[ins.P2POp]) -> None:
        # Post every send first, then block on receives: a peer that runs the
        # matching operations one at a time can then never wait on us.
        for op in ops:
            if isinstance(op, ins.SendActivation):
                # post_send detaches what it transmits; the requires_grad flags it
                # announces tell the next stage which inputs need gradients back.
                self._post(self._step.outputs[op.microbatch], self.next_rank)
            elif isinstance(op, ins.SendGrad):
                self._post(self._step.input_grads.pop(op.microbatch), self.prev_rank)
        for op in ops:
            if isinstance(op, ins.RecvActivation):
                self._step.inputs[op.microbatch] = self.p2p.recv(self.prev_rank)
            elif isinstance(op, ins.RecvGrad):
                self._step.grads[op.microbatch] = self.p2p.recv(self.next_rank)

    def _post(self, payload, peer: int | None) -> None:
        if peer is None:
            raise RuntimeError(f"stage {self.stage_id} has no neighbour to send to")
        self._step.pending.append((payload, self.p2p.post_send(payload, peer)))

    def _wait_sends(self) -> None:
        for _, works in self._step.pending:
            for work in works:
                work.wait()
        self._step.pending.clear()


class _StepState:
    """Per-step, per-microbatch buffers; dropped when the step ends."""

    def __init__(self, num_microbatches: int) -> None:
        self.num_microbatches = num_microbatches
        self.batches: dict[int, Mapping[str, torch.Tensor]] = {}
        self.inputs: dict[int, object] = {}
        self.outputs: dict[int, object] = {}
        self.grads: dict[int, object] = {}
        self.input_grads: dict[int, object] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.pending: list = []
