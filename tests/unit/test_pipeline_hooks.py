"""The events listeners receive: two pipeline stages in one process, each executor on its own thread."""

from __future__ import annotations

import queue
import threading
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from merak.pipeline import instructions as ins
from merak.pipeline.executor import PipelineExecutor
from merak.pipeline.hooks import FORWARDS_PER_INSTRUCTION, InstructionEvent, PipelineHook
from merak.pipeline.schedules import build_schedule

MICROBATCHES = 3


class _Sent:
    """A send that completed when it was posted."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        pass


class QueueP2P:
    """Point-to-point between executors of one process: one queue per (sender, receiver), matched by
    order as merak's transports are.

    Like merak's PointToPoint, a received tensor is a detached copy that requires gradients when
    the sent one did.
    """

    def __init__(self, rank: int, queues: dict) -> None:
        self.rank, self.queues = rank, queues

    def post(self, sends, recvs):
        for payload, peer, _ in sends:
            leaves, spec = pytree.tree_flatten(payload)
            wire = [(leaf.detach().clone(), leaf.requires_grad) if isinstance(leaf, torch.Tensor) else (leaf, False)
                    for leaf in leaves]
            self.queues[(self.rank, peer)].put((wire, spec))
        received = []
        for peer, _ in recvs:
            wire, spec = self.queues[(peer, self.rank)].get(timeout=60)
            received.append(pytree.tree_unflatten([leaf.requires_grad_(True) if grad else leaf
                                                   for leaf, grad in wire], spec))
        return _Transfer(received)


class _Transfer:
    def __init__(self, received) -> None:
        self.received, self.send_works = received, [_Sent()]

    def wait(self) -> None:
        pass


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 8)

    def forward(self, batch):
        return torch.tanh(self.linear(batch["x"]))


class Recorder(PipelineHook):
    def __init__(self) -> None:
        self.calls: list[tuple[str, InstructionEvent | None]] = []

    def on_step_begin(self) -> None:
        self.calls.append(("step_begin", None))

    def on_step_end(self) -> None:
        self.calls.append(("step_end", None))

    def on_instruction_begin(self, event: InstructionEvent) -> None:
        self.calls.append(("begin", event))

    def on_instruction_end(self, event: InstructionEvent) -> None:
        self.calls.append(("end", event))

    def ends(self) -> list[InstructionEvent]:
        return [event for call, event in self.calls if call == "end"]


def _loss(output, batch):
    return F.mse_loss(output, batch["y"])


def _run_two_stages(schedule: str, steps: int = 1) -> tuple[list[Recorder], list[PipelineExecutor]]:
    torch.manual_seed(0)
    stages = [Embed(), nn.Linear(8, 2)]
    queues = defaultdict(queue.Queue)
    recorders = [Recorder(), Recorder()]
    executors = [PipelineExecutor(stage=stages[s], stage_id=s, num_stages=2, prev_rank=s - 1 if s else None,
                                  next_rank=1 if s == 0 else None, p2p=QueueP2P(s, queues), loss_fn=_loss,
                                  step_handlers={}, hooks=[recorders[s]])
                 for s in range(2)]
    lists = [[i for i in build_schedule(name=schedule, stage_id=s, num_stages=2, num_microbatches=MICROBATCHES)
              if not isinstance(i, ins.STEP_END_TYPES)] for s in range(2)]
    microbatches = [{"x": torch.randn(2, 4), "y": torch.randn(2, 2)} for _ in range(MICROBATCHES)]
    failures: list[BaseException] = []

    def run(stage: int) -> None:
        try:
            for _ in range(steps):
                executors[stage].run(lists[stage], microbatches)
        except BaseException as error:
            failures.append(error)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "the two stages did not finish"
    if failures:
        raise failures[0]
    return recorders, executors


def test_1f1b_events_name_kind_stage_microbatch_and_chunk_in_order():
    recorders, _ = _run_two_stages("1f1b")
    described = [[(e.name, e.stage, e.microbatch, e.chunk) for e in recorder.ends()] for recorder in recorders]
    assert described[0] == [("forward", 0, 0, 0), ("forward", 0, 1, 0), ("backward", 0, 0, 0), ("forward", 0, 2, 0),
                            ("backward", 0, 1, 0), ("backward", 0, 2, 0)]
    assert described[1] == [("forward", 1, 0, 0), ("backward", 1, 0, 0), ("forward", 1, 1, 0),
                            ("backward", 1, 1, 0), ("forward", 1, 2, 0), ("backward", 1, 2, 0)]
    for recorder in recorders:
        calls = recorder.calls
        assert calls[0] == ("step_begin", None) and calls[-1] == ("step_end", None)
        # Each begin is followed by the end of the same instruction.
        pairs = zip(calls[1:-1:2], calls[2:-1:2], strict=True)
        assert all(b[0] == "begin" and e[0] == "end" and b[1].instruction == e[1].instruction for b, e in pairs)


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1", "pre_recompute_1f1b", "last_no_recompute_1f1b"])
def test_events_follow_the_schedule_and_carry_flops(schedule):
    recorders, executors = _run_two_stages(schedule)
    for stage, (recorder, executor) in enumerate(zip(recorders, executors)):
        expected = [i for i in build_schedule(name=schedule, stage_id=stage, num_stages=2,
                                              num_microbatches=MICROBATCHES) if isinstance(i, ins.COMPUTE_TYPES)]
        ends = recorder.ends()
        assert [e.instruction for e in ends] == expected
        assert [e.name for e in ends] == [ins.INSTRUCTION_NAMES[type(i)] for i in expected]
        forward_flops = executor.chunk_flops[0]
        assert forward_flops > 0
        assert [e.flops for e in ends] == [FORWARDS_PER_INSTRUCTION[e.name] * forward_flops for e in ends]
        begins = [event for call, event in recorder.calls if call == "begin"]
        # The chunk's first forward counts the FLOPs: unknown when it begins, known from then on.
        assert begins[0].flops is None
        assert all(event.flops is not None for event in begins[1:])


def test_events_carry_the_step_index():
    recorders, _ = _run_two_stages("1f1b", steps=2)
    for recorder in recorders:
        steps = [event.step for event in recorder.ends()]
        assert steps == [0] * (2 * MICROBATCHES) + [1] * (2 * MICROBATCHES)


def test_executor_keeps_no_current_instruction():
    _, executors = _run_two_stages("1f1b")
    assert not hasattr(executors[0], "current_instruction")


def test_event_of_an_instruction():
    event = InstructionEvent.of(ins.BackwardInput(3, chunk=1), stage=2, step=7, chunk_forward_flops=100)
    assert (event.name, event.stage, event.chunk, event.microbatch, event.step, event.flops) == \
        ("backward_input", 2, 1, 3, 7, 100)
    whole = InstructionEvent.of(ins.Backward(0), stage=0, step=0, chunk_forward_flops=100)
    assert whole.flops == 200
    assert InstructionEvent.of(ins.PreCheckpointForward(0), stage=0, step=0, chunk_forward_flops=None).name == "forward"
