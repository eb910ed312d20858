"""A few seconds of measurement that anchor the cost model to this machine and this model.

The rates of a device (FLOP/s, bytes/s, seconds per operation) price matrix products and memory
traffic well, but not everything a training step runs: the loss in float32, allocator traffic,
autograd's bookkeeping. On the machine at hand the model itself is timed, in fresh processes set up
as training workers are (threads, and glibc keeping freed buffers: without it a large activation
costs fresh pages every step and the timing measures the kernel). One process runs the recipe's
model, loss and backward on real weights at a small and a larger microbatch; the line through both
fits the rate-based estimate to it (how much the work that grows with the microbatch and the
per-operation overhead each really cost), a third size corrects larger microbatches (the sizes are
timed in turns, so that a slow moment of the machine does not fall on one size alone). The optimizer
step is timed the same way, and so is the backward split in two as zero-bubble schedules run it
(input gradients first, weight gradients later: torch's split walks the autograd graph in Python and
keeps the gradients between the halves, which costs more than one backward). Then as many processes as
the run will start time the model all at once, each repetition started together as a synchronous step
is: how much slower each is when they share the cores (more than the cores' count alone says: memory
bandwidth and caches are shared too; between those repetitions one of them runs alone, so the slowdown
is a ratio of times taken moments apart, as a shared machine's speed drifts by tens of percent within
seconds), how long a small all-reduce takes among them (a collective waits for every process to be
scheduled) and in groups of each size while the processes compute between collectives (a tensor-parallel
collective's receiver waits for a core a computing process holds), and how long the scalar reductions
that end every step take (gloo reduces one or two elements by another algorithm than a longer message:
several times faster among many processes), and what ends a step on every process at about the same
time: merak's reduction of the model's gradients in groups of each size the run could use, every group
at once (gloo's copies and sums share the cores: a reduction takes far longer than the link's bandwidth
says), and the clip and optimizer step, all processes stepping together (an optimizer step streams its
state through memory: gpt:toy's clip and step took 17 ms with four processes stepping on two cores, its
step alone 5 ms), and that end as merak's optimizer runs it without ZeRO and with ZeRO-1, in turns
(ZeRO's bookkeeping of padded buckets costs more than its bytes say: bert:toy's ZeRO-1 step on four
processes ended 18 ms after its backward where its collectives' bytes said 6). Only for models small
enough to build here (GPU presets plan giant models from their rates alone).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import itertools
import json
import logging
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from merak.autoplan.busy_collectives import own_group, time_busy_collectives, time_lone_collectives
from merak.autoplan.profile import GraphProfile
from merak.compat.allocator import keep_freed_memory
from merak.core.files import write_json_atomic
from merak.distributed.launch import spawn_workers
from merak.optim.clip import global_grad_norm
from merak.optim.distributed import DistributedOptimizer, ZeroOptions
from merak.optim.grad_sync import all_reduce_tensors, ensure_grads
from merak.optim.schedule import make_optimizer
from merak.session.assemble import CallModel, default_input_names
from merak.shard.costs import LOSS_OPS, LOSS_PASSES_BACKWARD, LOSS_PASSES_FORWARD, MachineRates

logger = logging.getLogger(__name__)

MAX_CALIBRATED_PARAMETERS = 300_000_000
BACKWARD_FLOPS_FACTOR = 2.0  # a backward does twice a forward's matrix work
REPEATS = 3
ALONE_SECONDS = 0.5  # a size is timed again while its runs took less than this in all ...
ALONE_MOST = 12  # ... at most this many times
ALONE_ROUNDS = 3  # the microbatch sizes are timed in this many turns, ...
ALONE_MOST_ROUNDS = 6  # ... more (at most this many) until the last ALONE_ROUNDS of them agree: ...
ALONE_TURNS_AGREE = 1.25  # ... every size's slowest turn within this factor of its fastest
LOAD_SECONDS = 0.1  # loading a microbatch is timed for about this long per size
CONCURRENT_TIMEOUT_S = 120.0
CONCURRENT_SECONDS = 2.0  # of the processes running the model at once (a few repetitions are noisy) ...
CONCURRENT_REPEATS = 5  # ... at least this many times (gpt:demo among 8, from 3: 4.9x to 5.9x)
ALL_REDUCE_ELEMENTS = 1024
ALL_REDUCES = 20
# A step's end as the trainer runs it: the loss's all-reduce (one float64) and the gradient norm's with the
# loss's finiteness (two float64; merak.optim.clip), over every process.
STEP_SCALAR_ELEMENTS = (1, 2)
# The gradients' reduction is timed at their size, capped (a larger one takes proportionally longer).
GRADIENT_ALL_REDUCE_MOST_BYTES = 64 << 20
GRADIENT_ALL_REDUCES = 5
CONCURRENT_OPTIMIZER_STEPS = 5
ZERO_STEP_ENDS = (5, 15)  # pairs timed per group size: at least, at most, ...
ZERO_STEP_ENDS_SECONDS = 2.0  # ... about this long in all (a difference of two noisy times needs many)


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What the measurement found (the defaults: nothing measured, the device rates alone).

    Attributes:
        work_scale: measured over estimated time of the work that grows with the microbatch (matrix
            products, memory traffic).
        launch_scale: measured over estimated time of what each operation costs whatever its size
            (launch and framework overhead).
        size_factors: ``(microbatch, measured over fitted time)`` at every size timed: where the fit
            through the two smallest sizes misses larger ones (caches outgrown, larger matrices faster).
        optimizer_seconds_per_parameter: the optimizer step's time per parameter, one process alone.
        processes: how many processes ran the model at once for ``concurrent_slowdown``.
        concurrent_slowdown: their step time over one process's alone (cores shared, memory
            bandwidth and caches too).
        all_reduce_s: one small all-reduce among ``processes`` processes (the latency of a collective
            when every core has more than one process to run).
        gradient_all_reduces: ``(group size, seconds)``: merak's all-reduce of ``gradient_all_reduce_bytes``
            of the model's gradients (capped) in groups of that size, every group of ``processes``
            processes at once, for each size dividing ``processes``: gloo's copies and sums share the
            cores too, so a large collective takes far longer than the link's bandwidth alone says.
        concurrent_optimizer_seconds_per_parameter: the clip and the optimizer step per parameter with all
            ``processes`` stepping at once (what ends a step: streaming the optimizer's state through
            memory shared by all of them).
        zero_step_differences: ``(group size, seconds)``: a step's end with ZeRO-1 (the gradients' reduce-scatter,
            the update of each process's share, the weights' all-gather) less the end without ZeRO (their
            all-reduce and the whole update), as merak's optimizer runs them on ``gradient_all_reduce_bytes`` of
            gradients in groups of that size, every group at once (ZeRO's padded buckets and copies cost more
            than the bytes it moves say, and among processes sharing the cores more than the update it saves).
        step_scalars_s: the scalar all-reduces that end a step (:data:`STEP_SCALAR_ELEMENTS`) among
            ``processes`` processes, together.
        busy_collectives: ``(group size, seconds)``: a small all-reduce in groups of that size, every group
            of ``processes`` processes at once and each process computing between its collectives, as
            tensor-parallel ranks do (:mod:`merak.autoplan.busy_collectives`): its receivers wait for cores
            held by computing processes, longer than ``all_reduce_s`` says, whose processes all wait in it.
        lone_collectives: ``(group size, seconds)``: the same in one group of that size (fewer than all)
            while the other processes sleep, as a pipeline's stages wait while one computes: a partner that
            sleeps in the collective while its peer computes is slow to wake.
        microbatch_load_seconds: ``(microbatch, seconds)``: reading and collating a microbatch of that many
            samples from the recipe's dataset, one process alone, at every size timed (a step's first stage
            loads its microbatches before it computes: a small model with a masking collator spends a tenth
            of its step there).
        split_backward_factor: a backward split into its input and weight halves (zero-bubble
            schedules) over one backward, measured on the whole model at ``split_backward_micro_batch``.
            What the split adds is autograd's walk of the graph in Python, a cost per operation: the cost
            model spreads it over the pieces by their operations, not their compute.
    """

    work_scale: float = 1.0
    launch_scale: float = 1.0
    size_factors: tuple[tuple[int, float], ...] = ()
    optimizer_seconds_per_parameter: float | None = None
    processes: int = 1
    concurrent_slowdown: float = 1.0
    all_reduce_s: float | None = None
    gradient_all_reduces: tuple[tuple[int, float], ...] = ()
    gradient_all_reduce_bytes: int = 0
    concurrent_optimizer_seconds_per_parameter: float | None = None
    zero_step_differences: tuple[tuple[int, float], ...] = ()
    step_scalars_s: float | None = None
    busy_collectives: tuple[tuple[int, float], ...] = ()
    lone_collectives: tuple[tuple[int, float], ...] = ()
    microbatch_load_seconds: tuple[tuple[int, float], ...] = ()
    split_backward_factor: float = 1.0
    split_backward_micro_batch: int = 1

    def seconds(self, rates: MachineRates, flops: float, bytes_moved: float, ops: float) -> float:
        """The calibrated time of ``flops``, ``bytes_moved`` and ``ops`` at ``rates``."""
        return (self.work_scale * (flops / rates.flops_per_s + bytes_moved / rates.bytes_per_s)
                + self.launch_scale * ops * rates.seconds_per_op)

    def size_factor(self, micro_batch_size: int) -> float:
        """The correction at ``micro_batch_size``: the timed sizes' factors, linear in log2 of the size
        between them, the nearest one's beyond them."""
        if not self.size_factors:
            return 1.0
        sizes = [math.log2(size) for size, _ in self.size_factors]
        factors = [factor for _, factor in self.size_factors]
        where = math.log2(micro_batch_size)
        if where <= sizes[0]:
            return factors[0]
        for (left, low), (right, high) in zip(zip(sizes, factors), zip(sizes[1:], factors[1:])):
            if where <= right:
                return low + (high - low) * (where - left) / (right - left)
        return factors[-1]

    def load_seconds(self, micro_batch_size: int) -> float:
        """Loading one microbatch of ``micro_batch_size`` samples, one process alone: linear in the size
        between the timed sizes, along the nearest two beyond them (in proportion to the size when one was
        timed); nothing when none was."""
        points = self.microbatch_load_seconds
        if not points:
            return 0.0
        if len(points) == 1:
            size, seconds = points[0]
            return seconds * micro_batch_size / size
        (left, low), (right, high) = next(
            (pair for pair in itertools.pairwise(points) if micro_batch_size <= pair[1][0]), points[-2:])
        return max(0.0, low + (high - low) * (micro_batch_size - left) / (right - left))

    def hop_seconds(self, group_size: int) -> float | None:
        """One ring step of a small collective in groups of ``group_size`` with every process busy (its
        all-reduce's :attr:`busy_collectives` time over its ``2 (size - 1)`` steps); None: not timed."""
        timed = dict(self.busy_collectives)
        if group_size < 2 or group_size not in timed:
            return None
        return timed[group_size] / (2 * (group_size - 1))

    def lone_hop_seconds(self, group_size: int) -> float | None:
        """:meth:`hop_seconds` with the group computing alone (:attr:`lone_collectives`); None: not timed (a
        group of every process is never alone)."""
        timed = dict(self.lone_collectives)
        if group_size < 2 or group_size not in timed or group_size >= self.processes:
            return None
        return timed[group_size] / (2 * (group_size - 1))

    def slowdown(self, busy: float, cores: int) -> float | None:
        """The step time of ``busy`` processes computing at once on ``cores`` cores over one alone (None: not
        measured): the cores' share, ``busy / cores`` once they are outnumbered, times what sharing the
        memory and caches adds, from nothing for one process to what ``processes`` showed."""
        if self.processes < 2:
            return None
        sharing = self.concurrent_slowdown / max(1.0, self.processes / cores)
        extra = 1 + (sharing - 1) * min(1.0, max(0.0, busy - 1) / (self.processes - 1))
        return max(1.0, max(1.0, busy / cores) * extra)


def estimated_parts(profile: GraphProfile, rates: MachineRates) -> tuple[float, float]:
    """(work, launches): the rate-based estimate of the profiled model's forward, loss and backward at the
    profile's microbatch, split into what grows with the microbatch and what each operation costs."""
    passes = 1 + BACKWARD_FLOPS_FACTOR
    work = passes * sum(f / rates.flops_per_s + b / rates.bytes_per_s
                        for f, b in zip(profile.flops, profile.bytes_moved))
    work += (LOSS_PASSES_FORWARD + LOSS_PASSES_BACKWARD) * profile.output_bytes / rates.bytes_per_s
    launches = (passes * sum(profile.ops) + 2 * LOSS_OPS) * rates.seconds_per_op
    return work, launches


def _typical_of(function, repeats: int = REPEATS, seconds: float = ALONE_SECONDS, most: int = ALONE_MOST) -> float:
    """The median of at least ``repeats`` runs of ``function`` (after a warm-up), more while they take less
    than ``seconds`` in all (at most ``most``): a run's step time is the median of its steps, and on a
    shared machine the noise is part of every step (the fastest run is a moment the run rarely has)."""
    function()  # warm-up: allocator, lazy initialization
    times, spent = [], 0.0
    while len(times) < repeats or (spent < seconds and len(times) < most):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
        spent += times[-1]
    return statistics.median(times)


def _model_step(spec, settings, micro_batch_size: int):
    """(one forward + loss + backward of the recipe's model on real weights, the model), or None when the
    model is too large to build here."""
    built = _model_steps(spec, settings, micro_batch_size)
    return None if built is None else (built.step, built.model)


@dataclasses.dataclass
class _ModelSteps:
    """One training step of the whole model, as a later pipeline stage runs it with the backward whole and
    split, and the model."""

    model: torch.nn.Module
    step: object  # forward, loss and backward
    stage_step: object | None  # the same from inputs that need gradients, as a later stage's (None: no input
    # tensor to start from)
    split_step: object | None  # the same, the backward split as zero-bubble schedules split it
    forward: object  # forward and loss alone
    load: object  # reading and collating the microbatch, as the trainer's loader does on a first stage


def _model_steps(spec, settings, micro_batch_size: int, model: torch.nn.Module | None = None) -> _ModelSteps | None:
    """The recipe's model on real weights (``model``, else built), a microbatch of its data and its steps (None:
    the model is too large to build here)."""
    model_cfg = settings.model_cfg
    if model is None:
        torch.manual_seed(settings.trainer.seed)
        model = spec.build_model(model_cfg)
        count = sum(p.numel() for p in model.parameters())
        if count > MAX_CALIBRATED_PARAMETERS:
            logger.info("not timing %s here (%s parameters): compute costs from the device rates alone", spec.name,
                        f"{count:,}")
            return None
    model.train()
    prepared = spec.prepare_data(settings.data_cfg, model_cfg)
    dataset = spec.load_dataset(prepared, model_cfg)
    batch = spec.collate([dataset[i % len(dataset)] for i in range(micro_batch_size)])
    names = settings.trainer.input_names or spec.input_names or default_input_names(model, batch)
    runner = CallModel(model, list(names))
    stage_inputs = _StageInputs(model, batch, names)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        spec.loss_fn(runner(batch), batch).backward()

    def load() -> None:
        spec.collate([dataset[i % len(dataset)] for i in range(micro_batch_size)])

    def forward() -> None:
        with torch.no_grad():
            spec.loss_fn(runner(batch), batch)

    def stage_step() -> None:
        model.zero_grad(set_to_none=True)
        with stage_inputs:
            spec.loss_fn(runner(stage_inputs.batch), batch).backward()

    def split_step() -> None:
        # As a middle stage runs it: the input gradients first, then the weights' from what that kept.
        model.zero_grad(set_to_none=True)
        params = [p for p in model.parameters() if p.requires_grad]
        with stage_inputs:
            loss = spec.loss_fn(runner(stage_inputs.batch), batch)
            _, groups = stage_backward_input([loss], None, stage_inputs.leaves, iter(params))
        stage_backward_weight(iter(params), groups)

    found = stage_inputs.available
    return _ModelSteps(model=model, step=step, forward=forward, stage_step=stage_step if found else None,
                       split_step=split_step if found else None, load=load)


class _StageInputs:
    """Within the block, the model runs from inputs that need gradients, as a later pipeline stage's do:
    its floating-point inputs, else its input embeddings' output (detached there, by a hook held only within
    the block). ``leaves``: those of the last run."""

    def __init__(self, model: torch.nn.Module, batch, names) -> None:
        self.floating = [name for name in names
                         if isinstance(batch[name], torch.Tensor) and batch[name].is_floating_point()]
        self.source, self.leaves, self._hook = batch, [], None
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        self.embeddings = embeddings if not self.floating and isinstance(embeddings, torch.nn.Module) else None
        self.available = bool(self.floating) or self.embeddings is not None

    def _cut(self, module, args, output):
        leaf = output.detach().requires_grad_()
        self.leaves.append(leaf)
        return leaf

    @property
    def batch(self):
        """The batch the model reads within the block."""
        if not self.floating:
            return self.source
        copy = dict(self.source)
        for name in self.floating:
            copy[name] = self.source[name].detach().requires_grad_()
            self.leaves.append(copy[name])
        return copy

    def __enter__(self) -> _StageInputs:
        self.leaves = []
        if self.embeddings is not None:
            self._hook = self.embeddings.register_forward_hook(self._cut)
        return self

    def __exit__(self, *exc) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def _concurrent_worker(spec, settings, micro_batch_size: int, threads: int, steps: int, out_dir: str) -> None:
    """One of the processes timing the model all at once, ``steps`` times, each started together (as the
    steps of a synchronous run are), rank 0 timing it alone between them; then small all-reduces among
    them, reductions of its gradients in groups, its clip and optimizer step, and merak's optimizer ending a
    step without and with ZeRO-1."""
    torch.set_num_threads(threads)
    _as_training_does(settings)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=CONCURRENT_TIMEOUT_S))
    rank = int(os.environ["RANK"])  # set by spawn_workers
    try:
        step, model = _model_step(spec, settings, micro_batch_size)
        step()  # warm-up
        times, alone = [], []
        for _ in range(steps):
            dist.barrier()
            times.append(_timed(step))
            dist.barrier()
            if rank == 0:  # the others wait at the next barrier
                alone.append(_timed(step))
        dist.barrier()
        message = torch.zeros(ALL_REDUCE_ELEMENTS)
        dist.all_reduce(message)
        started = time.perf_counter()
        for _ in range(ALL_REDUCES):
            dist.all_reduce(message)
        all_reduce = (time.perf_counter() - started) / ALL_REDUCES
        scalars = _step_scalar_reductions()
        busy = time_busy_collectives(group_sizes(dist.get_world_size()))
        lone = time_lone_collectives(group_sizes(dist.get_world_size()))
        gradients = _gradient_all_reduces(model)
        optimizer = _optimizer_steps(model)
        zero = _zero_step_ends(model)
    finally:
        dist.destroy_process_group()
    write_json_atomic(os.path.join(out_dir, f"rank{rank}.json"),
                      {"step_s": times, "alone_s": alone, "all_reduce_s": all_reduce, "step_scalars_s": scalars,
                       "busy_collectives_s": busy, "lone_collectives_s": lone,
                       "optimizer_s": optimizer, "zero_step_ends_s": zero, **gradients})


def _timed(function) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def _step_scalar_reductions() -> float:
    """The median time of the all-reduces that end a step (:data:`STEP_SCALAR_ELEMENTS` float64 elements),
    run back to back as a step runs them."""
    messages = [torch.zeros(n, dtype=torch.float64) for n in STEP_SCALAR_ELEMENTS]
    for message in messages:  # warm-up
        dist.all_reduce(message)
    times = []
    for _ in range(ALL_REDUCES):
        started = time.perf_counter()
        for message in messages:
            dist.all_reduce(message)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def group_sizes(processes: int) -> list[int]:
    """The sizes of data-parallel groups (and the tied weights' pairs) a run of ``processes`` could use."""
    return [size for size in range(2, processes + 1) if processes % size == 0]


def _capped_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The model's parameters in order, their gradients up to :data:`GRADIENT_ALL_REDUCE_MOST_BYTES` (at least
    one), each with a gradient."""
    params, total = [], 0
    for param in model.parameters():
        nbytes = param.numel() * param.element_size()
        if params and total + nbytes > GRADIENT_ALL_REDUCE_MOST_BYTES:
            break
        params.append(param)
        total += nbytes
    ensure_grads(params)
    return params


def _capped_gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    """The gradients of :func:`_capped_parameters`."""
    return [param.grad for param in _capped_parameters(model)]


def _gradient_all_reduces(model: torch.nn.Module) -> dict:
    """Times of ``GRADIENT_ALL_REDUCES`` of merak's reductions of the model's gradients (capped) in groups of
    each of :func:`group_sizes` of the processes, every group at once and each repetition started together,
    as a run's data-parallel groups reduce their gradients after a backward."""
    grads = _capped_gradients(model)
    times = {}
    for size in group_sizes(dist.get_world_size()):
        reduce = functools.partial(all_reduce_tensors, grads, group=own_group(size), scale=1 / size)
        reduce()  # warm-up: gloo's buffers for this size
        runs = []
        for _ in range(GRADIENT_ALL_REDUCES):
            dist.barrier()
            runs.append(_timed(reduce))
        times[str(size)] = runs
    dist.barrier()
    return {"gradient_all_reduces_s": times,
            "gradient_all_reduce_bytes": sum(g.numel() * g.element_size() for g in grads)}


def _zero_step_ends(model: torch.nn.Module) -> dict[str, list[list[float]]]:
    """By group size, pairs of times of a step's end as merak's optimizer runs it (reducing the model's
    gradients, capped, over the group, then the clip and update) without ZeRO and with ZeRO-1 (scattering the
    reduced gradients, each process updating its share, gathering the weights), every group at once and each
    time started together: ZeRO's padded buckets, copies and two collectives against one all-reduce and the
    whole update. The pairs are timed in turns, moments apart (the machine's speed drifts within seconds), as
    many as take about :data:`ZERO_STEP_ENDS_SECONDS` within :data:`ZERO_STEP_ENDS`."""
    params = _capped_parameters(model)
    gradients = [param.grad.clone() for param in params]
    rank, processes = dist.get_rank(), dist.get_world_size()
    times = {}
    for size in group_sizes(processes):
        group = own_group(size)
        ends = [DistributedOptimizer(params, dp_group=group, dp_size=size, dp_rank=rank % size, norm_group=None,
                                     norm_group_size=1, counted=[True] * len(params), zero=ZeroOptions(stage=stage),
                                     make_optimizer=_calibration_optimizer)
                for stage in (0, 1)]
        _step_end_pair(ends, params, gradients)  # warm-up: the optimizers' state, gloo's buffers
        pairs = [_step_end_pair(ends, params, gradients)]
        # Every process must time as many pairs: the count follows the slowest process's first pair.
        first = torch.tensor([sum(pairs[0])], dtype=torch.float64)
        dist.all_reduce(first, op=dist.ReduceOp.MAX)
        fewest, most = ZERO_STEP_ENDS
        count = min(most, max(fewest, math.ceil(ZERO_STEP_ENDS_SECONDS / max(float(first), 1e-9))))
        pairs += [_step_end_pair(ends, params, gradients) for _ in range(count - 1)]
        times[str(size)] = pairs
    dist.barrier()
    return times


def _step_end_pair(optimizers: list[DistributedOptimizer], params: list[torch.nn.Parameter],
                   gradients: list[torch.Tensor]) -> list[float]:
    """The time of each optimizer's reduction and step of ``gradients`` (copied into ``params``' gradients),
    each started together on every process."""
    seconds = []
    for optimizer in optimizers:
        for param, gradient in zip(params, gradients):
            param.grad = gradient.clone()
        dist.barrier()
        started = time.perf_counter()
        optimizer.reduce_gradients()
        optimizer.step(max_grad_norm=1.0)
        seconds.append(time.perf_counter() - started)
    return seconds


def _calibration_optimizer(pairs) -> torch.optim.Optimizer:
    """AdamW, as recipes train, with a learning rate that leaves the weights about as they are."""
    return make_optimizer(pairs, kind="adamw_torch", learning_rate=1e-6, weight_decay=0.0, betas=(0.9, 0.999),
                          eps=1e-8)


def _optimizer_steps(model: torch.nn.Module) -> list[float]:
    """Times of ``CONCURRENT_OPTIMIZER_STEPS`` clips and optimizer steps of the model, every process stepping
    at once (each repetition started together, as a synchronous run's steps end)."""
    grads = ensure_grads(model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def step() -> None:
        global_grad_norm(grads, group=None, group_size=1)
        torch._foreach_mul_(grads, 1.0)  # the clip's scaling: a pass over the gradients whatever the factor
        optimizer.step()

    step()  # warm-up: the optimizer's state
    times = []
    for _ in range(CONCURRENT_OPTIMIZER_STEPS):
        dist.barrier()
        times.append(_timed(step))
    dist.barrier()
    return times


def measure_concurrent(spec, settings, micro_batch_size: int, processes: int, threads: int,
                       steps: int = REPEATS) -> dict:
    """``processes`` processes running the model at once, ``steps`` times: ``step_s``, ``alone_s`` (one of them alone,
    between those steps), ``slowdown`` (the median of each such step over the alone one after it: timed moments
    apart, a drift of the machine's speed hardly tilts it), ``all_reduce_s`` (a small one), ``step_scalars_s`` (a
    step's scalar reductions), ``busy_collectives_s`` (by group size: a small all-reduce with the processes
    computing between them, :mod:`merak.autoplan.busy_collectives`), ``lone_collectives_s`` (the same in one group
    alone, the others asleep), ``gradient_all_reduces_s`` (by group size),
    ``gradient_all_reduce_bytes``, ``optimizer_s`` (the clip and step, all at once) and ``zero_step_differences_s``
    (by group size: ZeRO-1's step end over the plain one). A synchronous step (or collective) waits for the slowest
    process: each time is the median over the repetitions of the slowest process's (processes sharing cores finish a
    time slice apart, and which one is last varies)."""
    with tempfile.TemporaryDirectory(prefix="merak-calibrate-") as out_dir:
        spawn_workers(_concurrent_worker, world_size=processes,
                      args=(spec, settings, micro_batch_size, threads, steps, out_dir),
                      env={"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"},
                      store_timeout_s=CONCURRENT_TIMEOUT_S)
        reports = [json.loads(Path(out_dir, f"rank{r}.json").read_text(encoding="utf-8")) for r in range(processes)]

    def slowest(runs) -> float:
        return statistics.median(max(times) for times in zip(*runs))

    together = [max(times) for times in zip(*(r["step_s"] for r in reports))]
    return {"step_s": statistics.median(together), "alone_s": statistics.median(reports[0]["alone_s"]),
            "slowdown": statistics.median(step / alone for step, alone in zip(together, reports[0]["alone_s"])),
            "all_reduce_s": statistics.median(r["all_reduce_s"] for r in reports),
            "step_scalars_s": statistics.median(r["step_scalars_s"] for r in reports),
            "busy_collectives_s": {int(size): seconds for size, seconds in reports[0]["busy_collectives_s"].items()},
            "lone_collectives_s": {int(size): seconds for size, seconds in reports[0]["lone_collectives_s"].items()},
            "gradient_all_reduces_s": {int(size): slowest(r["gradient_all_reduces_s"][size] for r in reports)
                                       for size in reports[0]["gradient_all_reduces_s"]},
            "gradient_all_reduce_bytes": reports[0]["gradient_all_reduce_bytes"],
            "optimizer_s": slowest(r["optimizer_s"] for r in reports),
            "zero_step_differences_s": {int(size): _zero_difference([r["zero_step_ends_s"][size] for r in reports])
                                        for size in reports[0]["zero_step_ends_s"]}}


def _zero_difference(pairs_by_rank: list[list[list[float]]]) -> float:
    """The median over repetitions of ZeRO-1's step end over the one without ZeRO, each the slowest process's
    (the step waits for it)."""
    differences = []
    for pairs in zip(*pairs_by_rank):
        plain, zero = (max(times) for times in zip(*pairs))
        differences.append(zero - plain)
    return statistics.median(differences)


def fit_scales(small: tuple[float, float, float], large: tuple[float, float, float] | None) -> tuple[float, float]:
    """(work_scale, launch_scale) from ``(work, launches, measured)`` at two microbatch sizes: the line through
    both measurements. A step that grows faster than its work (caches outgrown) gives no line with a positive
    launch scale: then no launch scale, and the work scale that fits both best. One measurement: one scale."""
    work, launches, measured = small
    if large is not None and large[0] > work:
        work_scale = (large[2] - measured) / (large[0] - work)
        launch_scale = (measured - work_scale * work) / launches if launches > 0 else 0.0
        if work_scale > 0 and launch_scale >= 0:
            return work_scale, launch_scale
        if work_scale > 0:  # least squares through the origin over both points
            return (work * measured + large[0] * large[2]) / (work ** 2 + large[0] ** 2), 0.0
    scale = measured / (work + launches) if work + launches > 0 else 1.0
    return scale, scale


def _alone_worker(spec, settings, micro_batch_sizes: tuple[int, ...], threads: int, out_dir: str) -> None:
    """One process timing the model alone at each size, and the optimizer step (written as JSON; nothing
    when the model is too large to build here)."""
    torch.set_num_threads(threads)
    _as_training_does(settings)
    measured, loads, optimizer_seconds, count, split = [], [], None, 0, None
    first = _model_steps(spec, settings, micro_batch_sizes[0])
    if first is not None:
        built = [first] + [_model_steps(spec, settings, micro, first.model) for micro in micro_batch_sizes[1:]]
        measured = _in_turns([b.step for b in built])
        loads = [_typical_of(b.load, seconds=LOAD_SECONDS) for b in built]
        for micro, seconds, load in zip(micro_batch_sizes, measured, loads):
            logger.info("timed %s at microbatch %d: %.1f ms for forward, loss and backward, %.2f ms to load",
                        spec.name, micro, seconds * 1e3, load * 1e3)
        at_split = built[min(1, len(built) - 1)]
        if at_split.stage_step is not None:
            split = _split_factor(at_split)
        optimizer = torch.optim.AdamW(first.model.parameters(), lr=1e-6)
        optimizer_seconds = _typical_of(optimizer.step)
        count = sum(p.numel() for p in first.model.parameters())
    write_json_atomic(os.path.join(out_dir, "alone.json"),
                      {"measured_s": measured, "load_s": loads, "optimizer_s": optimizer_seconds, "parameters": count,
                       "split_backward_factor": split})


def _in_turns(steps, rounds: int = ALONE_ROUNDS, most_rounds: int = ALONE_MOST_ROUNDS) -> list[float]:
    """Each step's median time over turns through all of them, each turn running a step for about
    ``ALONE_SECONDS / rounds`` (at least once): the times are compared or fitted with each other, and on a
    shared machine whose speed drifts within seconds one step timed in a slow moment would tilt them. After
    ``rounds`` turns, more follow until the last ``rounds`` agree (:func:`_turns_agree`), at most
    ``most_rounds``; the medians are those of the agreeing turns, else of all (one calibration of bert:toy
    timed microbatch 4 at 17.4 ms, 9.5 ms an hour earlier, and every layout was priced from that)."""
    for step in steps:  # warm-up: allocator, lazy initialization
        step()
    turns: list[list[list[float]]] = [[] for _ in steps]  # per step, each turn's runs
    while True:
        for step, mine in zip(steps, turns):
            runs, spent = [], 0.0
            while not runs or (spent < ALONE_SECONDS / rounds and len(runs) < ALONE_MOST // rounds):
                runs.append(_timed(step))
                spent += runs[-1]
            mine.append(runs)
        done = len(turns[0])
        if done >= rounds and _turns_agree([mine[-rounds:] for mine in turns]):
            return [statistics.median([t for runs in mine[-rounds:] for t in runs]) for mine in turns]
        if done >= most_rounds:
            logger.info("the machine's speed drifted during the timing: the median of %d turns", done)
            return [statistics.median([t for runs in mine for t in runs]) for mine in turns]


def _turns_agree(turns: list[list[list[float]]]) -> bool:
    """Whether every step's turns (each a list of runs) have medians within :data:`ALONE_TURNS_AGREE` of
    each other."""
    for mine in turns:
        medians = [statistics.median(runs) for runs in mine]
        if max(medians) > ALONE_TURNS_AGREE * min(medians):
            return False
    return True


def _split_factor(built: _ModelSteps) -> float:
    """The split backward's time over the whole backward's, each the step's less its forward's, from inputs
    that need gradients; timed in turns (the machine's speed drifts)."""
    plain, split, forward = _in_turns([built.stage_step, built.split_step, built.forward])
    backward = plain - forward
    if backward <= 0:
        return 1.0
    factor = (split - forward) / backward
    logger.info("the backward split in two (zero-bubble schedules) takes %.2fx one backward", factor)
    return max(1.0, factor)


def _as_training_does(settings) -> None:
    """The allocator as a training worker sets it: large freed buffers kept in the heap (else every step
    of a model with large activations pays for fresh pages, and the timing says more about the kernel than
    about the model)."""
    if settings.launcher.keep_freed_memory:
        keep_freed_memory()


def measure_alone(spec, settings, micro_batch_sizes: tuple[int, ...], threads: int) -> dict:
    """:func:`_alone_worker`'s result, timed in a fresh process set up as a training worker is (its threads
    and allocator; this process's heap and settings left as they are)."""
    with tempfile.TemporaryDirectory(prefix="merak-calibrate-") as out_dir:
        spawn_workers(_alone_worker, world_size=1, args=(spec, settings, micro_batch_sizes, threads, out_dir),
                      env={"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"},
                      store_timeout_s=CONCURRENT_TIMEOUT_S)
        return json.loads(Path(out_dir, "alone.json").read_text(encoding="utf-8"))


def measure(spec, settings, profile: GraphProfile, rates: MachineRates, *, micro_batch_sizes: tuple[int, ...],
            threads: int = 1, processes: int = 1, cores: int = 1) -> Calibration:
    """Time the recipe's model alone at each of ``micro_batch_sizes`` and fit the estimate to it (the two
    smallest fix the scales, the others correct them); with ``processes`` > 1, also time that many
    processes running it at once on ``cores`` cores (at the second size, for about ``CONCURRENT_SECONDS``).
    Every timing runs in fresh processes set up as training workers are."""
    sizes = tuple(sorted(set(micro_batch_sizes)))
    alone = measure_alone(spec, settings, sizes, threads)
    if len(alone["measured_s"]) < len(sizes):
        logger.info("not timing %s here: compute costs from the device rates alone", spec.name)
        return Calibration()
    points = [(*estimated_parts(profile.scaled(micro), rates), measured)
              for micro, measured in zip(sizes, alone["measured_s"])]
    work_scale, launch_scale = fit_scales(points[0], points[1] if len(points) > 1 else None)
    factors = tuple((size, measured / (work_scale * work + launch_scale * launches))
                    for size, (work, launches, measured) in zip(sizes, points))
    logger.info("compute estimates scaled by %.2f (work growing with the microbatch) and %.2f (per operation), "
                "then by %s at microbatches %s; optimizer step %.1f ms", work_scale, launch_scale,
                ", ".join(f"{f:.2f}" for _, f in factors), ", ".join(str(s) for s in sizes),
                alone["optimizer_s"] * 1e3)
    calibration = Calibration(work_scale=work_scale, launch_scale=launch_scale, size_factors=factors,
                              optimizer_seconds_per_parameter=alone["optimizer_s"] / max(alone["parameters"], 1),
                              microbatch_load_seconds=tuple(zip(sizes, alone.get("load_s") or ())),
                              split_backward_factor=alone["split_backward_factor"] or 1.0,
                              split_backward_micro_batch=sizes[min(1, len(sizes) - 1)])
    if processes < 2:
        return calibration
    # At the second size: large enough to be typical, small enough for every process to run it quickly.
    concurrent_size = sizes[1] if len(sizes) > 1 else sizes[0]
    alone_s = points[sizes.index(concurrent_size)][2]
    # Enough repetitions for about CONCURRENT_SECONDS if the processes share the cores evenly.
    steps = max(CONCURRENT_REPEATS, math.ceil(CONCURRENT_SECONDS / (alone_s * max(1.0, processes / max(cores, 1)))))
    concurrent = measure_concurrent(spec, settings, concurrent_size, processes, threads, steps)
    slowdown = concurrent["slowdown"]
    reductions = tuple(sorted(concurrent["gradient_all_reduces_s"].items()))
    zero = tuple(sorted(concurrent["zero_step_differences_s"].items()))
    logger.info("%d processes at once: %.1f ms per step each (%.2fx one alone between them, %.1f ms); among them "
                "a small all-reduce %.2f ms, a step's scalar reductions %.2f ms, the gradients (%.3g MB) reduced "
                "in groups of %s: %s ms (ZeRO-1's step end %s ms more), a small all-reduce in those groups between "
                "computing %s ms (one group alone: %s ms); the clip and optimizer step %.1f ms",
                processes,
                concurrent["step_s"] * 1e3, slowdown, concurrent["alone_s"] * 1e3, concurrent["all_reduce_s"] * 1e3,
                concurrent["step_scalars_s"] * 1e3, concurrent["gradient_all_reduce_bytes"] / 1e6,
                ", ".join(str(size) for size, _ in reductions),
                ", ".join(f"{seconds * 1e3:.1f}" for _, seconds in reductions),
                ", ".join(f"{seconds * 1e3:.1f}" for _, seconds in zero),
                ", ".join(f"{seconds * 1e3:.2f}" for _, seconds in sorted(concurrent["busy_collectives_s"].items())),
                ", ".join(f"{seconds * 1e3:.2f}" for _, seconds in sorted(concurrent["lone_collectives_s"].items())),
                concurrent["optimizer_s"] * 1e3)
    return dataclasses.replace(
        calibration, processes=processes, concurrent_slowdown=slowdown, all_reduce_s=concurrent["all_reduce_s"],
        step_scalars_s=concurrent["step_scalars_s"], gradient_all_reduces=reductions,
        busy_collectives=tuple(sorted(concurrent["busy_collectives_s"].items())),
        lone_collectives=tuple(sorted(concurrent["lone_collectives_s"].items())),
        gradient_all_reduce_bytes=concurrent["gradient_all_reduce_bytes"], zero_step_differences=zero,
        concurrent_optimizer_seconds_per_parameter=concurrent["optimizer_s"] / max(alone["parameters"], 1))
