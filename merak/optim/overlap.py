"""Data-parallel gradient reduction that overlaps the backward (``trainer.overlap_grad_reduce``).

A stage's gradients are final once its last weight-gradient pass of the step has run through
them: the last ``Backward`` (or ``BackwardWeight`` of the zero-bubble schedules) of each model
chunk. The engine *arms* a chunk when that instruction begins; from then on every parameter whose
gradient autograd accumulates marks its bucket, and a bucket whose gradients are all final starts
its reduction at once (``async_op``), while the backward goes on computing the rest. When the
instruction ends the chunk's remaining buckets start (a parameter that got no gradient counts
as zeros, as without overlap), and the optimizer waits for every reduction only at the step's end.

Buckets are fixed when the engine starts: per chunk, the parameters in reverse registration
order (about the order the backward produces them) in runs of about ``bucket_bytes`` of one
dtype. Every data-parallel replica holds the same buckets and starts them in the same order (a
bucket waits for every earlier one of its chunk; chunks start in schedule order), as collectives
on one group must be. Parameters whose gradients other groups sum first (tied copies across
stages, sequence-parallel replicas) are left out and reduced at the step's end as before.

What a bucket's reduction is depends on the optimizer (:class:`merak.optim.distributed.DistributedOptimizer`):
an all-reduce into the parameters' gradients (ZeRO 0, fp32), into fp32 master gradients (ZeRO 0,
half precision), or a reduce-scatter into the owned pieces' master gradients (ZeRO 1). ZeRO-2
reduce-scatters during every backward already and does not use this module.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import nn

from merak.optim.grad_sync import dtype_runs


@dataclass
class Bucket:
    """Parameters (optimizer indices) reduced together, and this step's progress."""

    index: int
    chunk: int
    params: list[int]
    nbytes: int
    final: set[int] = field(default_factory=set)
    launched: bool = False


@dataclass
class Reduction:
    """A bucket's reduction in flight: its handle and what finishes it once it is done."""

    bucket: Bucket
    handle: object
    finish: Callable[[], None]
    started: float
    finished: float | None = None


class OverlappedReduction:
    """The buckets of one rank's parameters and their reductions during the step.

    Args:
        params: the optimizer's parameters, in its order.
        chunk_of: the model chunk holding each parameter.
        excluded: optimizer indices reduced at the step's end instead (their gradients are summed over
            other groups first).
        bucket_bytes: about this many gradient bytes per bucket.
        launch: starts one bucket's reduction and returns ``(handle, finish)``; called in bucket order.
    """

    def __init__(self, params: Sequence[nn.Parameter], chunk_of: Sequence[int], excluded: set[int],
                 bucket_bytes: int, launch: Callable[[list[int]], tuple[object, Callable[[], None]]]) -> None:
        self.params, self.launch = list(params), launch
        self.excluded = sorted(excluded)
        self.buckets: list[Bucket] = []
        self.by_chunk: dict[int, list[Bucket]] = {}
        for chunk in sorted(set(chunk_of)):
            mine = [i for i in reversed(range(len(self.params))) if chunk_of[i] == chunk and i not in excluded]
            for run in dtype_runs(mine, bucket_bytes, lambda i: self.params[i]):
                bucket = Bucket(len(self.buckets), chunk, run, sum(_nbytes(self.params[i]) for i in run))
                self.buckets.append(bucket)
                self.by_chunk.setdefault(chunk, []).append(bucket)
        self.bucket_of = {i: bucket for bucket in self.buckets for i in bucket.params}
        self.armed: set[int] = set()
        self.in_flight: list[Reduction] = []
        self.last_step: list[Reduction] = []  # the finished step's reductions (the timeline reads them)
        for i in self.bucket_of:
            self.params[i].register_post_accumulate_grad_hook(lambda _, i=i: self._final(i))

    def arm(self, chunk: int) -> None:
        """The chunk's last weight-gradient pass of the step begins: its gradients become final as it runs."""
        self.armed.add(chunk)

    def _final(self, index: int) -> None:
        bucket = self.bucket_of[index]
        if bucket.chunk not in self.armed:
            return
        if bucket.launched or index in bucket.final:
            raise RuntimeError(f"a gradient of chunk {bucket.chunk} accumulated twice in its last backward pass "
                               "after its bucket was final: set trainer.overlap_grad_reduce=false")
        bucket.final.add(index)
        self._start_ready(bucket.chunk)

    def _start_ready(self, chunk: int) -> None:
        """Start the chunk's buckets that are complete, in order (a bucket waits for every earlier one)."""
        for bucket in self.by_chunk.get(chunk, ()):
            if bucket.launched:
                continue
            if len(bucket.final) < len(bucket.params):
                return
            self._start(bucket)

    def _start(self, bucket: Bucket) -> None:
        started = time.perf_counter()
        handle, finish = self.launch(bucket.params)
        bucket.launched = True
        self.in_flight.append(Reduction(bucket, handle, finish, started))

    def flush(self, chunk: int) -> None:
        """The chunk's last weight-gradient pass ended: start what is left of its buckets."""
        for bucket in self.by_chunk.get(chunk, ()):
            if not bucket.launched:
                self._start(bucket)
        self.armed.discard(chunk)

    def finish(self) -> None:
        """Start every bucket not started yet (chunks in order), wait for all, and finish them; ready the
        buckets for the next step."""
        for chunk in sorted(self.by_chunk):
            self.flush(chunk)
        for reduction in self.in_flight:
            if reduction.handle is not None:
                reduction.handle.wait()
            reduction.finish()
            reduction.finished = time.perf_counter()
        self.last_step, self.in_flight = self.in_flight, []
        for bucket in self.buckets:
            bucket.final, bucket.launched = set(), False
        self.armed.clear()


def _nbytes(param: nn.Parameter) -> int:
    return param.numel() * param.element_size()


def last_weight_passes(instructions: Sequence, num_chunks: int) -> dict[int, object]:
    """Per chunk, the instruction after which its gradients are final: the last of its backward passes
    (``Backward``, ``BackwardInput``, ``BackwardWeight``) in the stage's list."""
    from merak.pipeline import instructions as ins

    passes = (ins.Backward, ins.BackwardInput, ins.BackwardWeight)
    last: dict[int, object] = {}
    for instruction in instructions:
        if isinstance(instruction, passes) and instruction.chunk < num_chunks:
            last[instruction.chunk] = instruction
    return last


__all__ = ["Bucket", "OverlappedReduction", "last_weight_passes"]
