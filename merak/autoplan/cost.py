"""Predicting a layout's step time and memory per device from a graph profile and a cluster.

Compute: each unit of the captured graph (:mod:`merak.autoplan.profile`, at the layout's tensor
degree and microbatch) takes ``flops / F + bytes / B + ops * c`` (the partitioner's model,
:class:`merak.shard.costs.MachineRates`) with the accelerator's rates. That sum is the efficiency
curve: small matrices are held back by memory traffic and launch overhead, large ones approach
``F``. On a CPU node the processes busy at once share the cores, slowed as much as the calibration
measured (:mod:`merak.autoplan.calibrate`). The backward costs twice the forward; recomputation adds
a forward to it.

Communication: tensor-parallel collectives from their bytes in the graph (ring all-reduce,
all-gather and reduce-scatter on the tensor group's link), pipeline transfers from what crosses
each stage boundary, the data-parallel gradient reduction (and ZeRO's gather) from the stage's
gradient bytes, all over the link that joins the group's ranks (:meth:`Cluster.link_for`).

Pipeline: the stages' per-microbatch costs run through the schedule simulator
(:func:`merak.pipeline.simulate.simulate`) with the real instruction lists, so bubbles,
interleaving and zero-bubble splits count as they run; :func:`quick_step_seconds` is its closed
form for ranking many candidates first. On CPU processes the first stage also loads the step's
microbatches before it computes, as the calibration timed loading them.

Memory: parameters, gradients, master weights and optimizer state of the stage's parameters
(ZeRO divides what it shards by dp), plus activations: what autograd saves per microbatch times
the microbatches the schedule keeps in flight, or with recomputation only the checkpointed
inputs plus one layer being recomputed.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from merak.autoplan.calibrate import BACKWARD_FLOPS_FACTOR, Calibration
from merak.autoplan.cluster import Cluster, Link
from merak.autoplan.layout import Layout
from merak.autoplan.profile import GraphProfile
from merak.core.partition import PartitionError
from merak.distributed.topology import RankGrid
from merak.pipeline.instructions import (
    COMPUTE_TYPES,
    P2P_TYPES,
    Backward,
    BackwardInput,
    BackwardWeight,
    Exchange,
    Forward,
    PreCheckpointForward,
    RecomputeForward,
)
from merak.pipeline.schedules import build_schedule
from merak.pipeline.simulate import simulate
from merak.shard.costs import (
    LOSS_OPS,
    LOSS_PASSES_BACKWARD,
    LOSS_PASSES_FORWARD,
    MachineRates,
    loss_seconds,
    nominal_rates,
)
from merak.shard.plan import ShardingOptions, stage_unit_bounds
from merak.shard.split import ShardingError

ADAM_BYTES_PER_PARAMETER = 28  # read weight, gradient, two moments; write weight and moments (fp32)
STEP_SCALAR_REDUCTIONS = 2  # per step, over every process: the loss (for the log) and the gradient norm
SCALAR_BYTES = 8
SIMULATED_MICROBATCHES = 8  # a longer step is simulated at about this many and extended linearly
SPLIT_BACKWARD_SCHEDULES = ("zb_h1",)  # those whose instruction lists split backwards in BackwardInput/Weight
QUICK_RUNTIME_CUTS_MOST_UNITS = 256  # larger models are ranked on the planner's own cuts first (_piece_bounds)


class LayoutError(ValueError):
    """The layout cannot run this model (too few cuts for the stages, a schedule that does not fit)."""


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each kind of model state."""

    weight: int = 4
    gradient: int = 4
    master: int = 0
    optimizer: int = 8

    @classmethod
    def of(cls, dtype_bytes: int) -> Precision:
        return cls() if dtype_bytes == 4 else cls(weight=dtype_bytes, gradient=dtype_bytes, master=4, optimizer=8)


@dataclass(frozen=True)
class VirtualStage:
    """One model piece's per-microbatch costs (seconds) and sizes (bytes)."""

    forward: float
    backward: float
    recompute: float
    send_bytes: int
    params: int
    saved: int  # autograd's saved tensors per microbatch without recomputation (the loss's included)
    kept: int  # per microbatch with recomputation: the checkpointed inputs (and the loss's)
    largest_layer: int  # saved bytes of the largest layer: live while it is recomputed
    tp_seconds: float  # of forward + backward, included in forward/backward
    tied: int = 0  # elements of parameters another piece reads too (tied weights): their gradients are summed
    split_backward: float | None = None  # the backward split into input and weight halves (None: as ``backward``)

    @property
    def split(self) -> float:
        """The backward's cost when a zero-bubble schedule splits it (its input and weight halves together)."""
        return self.backward if self.split_backward is None else self.split_backward


@dataclass
class Prediction:
    """A layout's predicted step and memory, and where the time goes."""

    layout: Layout
    step_s: float
    stage_memory: tuple[int, ...]
    breakdown: dict[str, float] = field(default_factory=dict)
    simulated: bool = False

    @property
    def max_memory(self) -> int:
        return max(self.stage_memory)


def device_rates(cluster: Cluster, dtype: str) -> MachineRates:
    """One device's rates when it has its compute to itself."""
    accelerator = cluster.accelerator
    return MachineRates(flops_per_s=accelerator.flops_per_s(dtype),
                        bytes_per_s=accelerator.memory_bandwidth_gbs * 1e9,
                        seconds_per_op=accelerator.seconds_per_op)


def _slowed(link: Link, slowdown: float) -> Link:
    """``link`` with its bandwidth divided by ``slowdown`` (the latency is measured as it is)."""
    return link if slowdown == 1.0 else dataclasses.replace(link, bandwidth_gbs=link.bandwidth_gbs / slowdown)


def _reduction_links(calibration: Calibration, link: Link) -> dict[int, Link]:
    """By group size, the link whose ring all-reduce takes what the calibration's reduction of the gradients
    took in groups of that size (nothing timed: none). The latency is ``link``'s whole hop latency, the rest
    of the time (at least half of it) bandwidth: the timed reductions started together from a barrier, while
    a run's start as each process comes from its backward, their hops waiting for their receivers to be
    scheduled as the small all-reduce's did (on the sweep of 04:02 UTC in BENCHMARKS.md section 13, 31 of 45
    steps within 15 % so, 30 with the timing alone)."""
    links = {}
    for size, seconds in calibration.gradient_all_reduces:
        if size < 2 or calibration.gradient_all_reduce_bytes <= 0:
            continue
        steps = 2 * (size - 1)
        moving = max(seconds - steps * link.latency_us * 1e-6, seconds / 2)
        links[size] = dataclasses.replace(
            link, bandwidth_gbs=steps / size * calibration.gradient_all_reduce_bytes / moving / 1e9)
    return links


def _hops(all_reduces: int, gathers: int, size: int) -> int:
    """Ring steps of ``all_reduces`` all-reduces and ``gathers`` all-gathers (or reduce-scatters) over ``size``
    ranks."""
    return 2 * (size - 1) * all_reduces + (size - 1) * gathers


def _calls(profile: GraphProfile, field: str) -> tuple[int, ...]:
    """How many collectives make up ``field``'s bytes in each unit (a profile without the counts: one per unit
    that moves bytes)."""
    return getattr(profile, f"{field}_calls") or tuple(int(bool(b)) for b in getattr(profile, field))


def p2p_seconds(nbytes: float, link: Link) -> float:
    """One stage-to-stage transfer: a small header first (what follows: shapes, dtypes), then the tensors."""
    return link.latency_us * 1e-6 + link.seconds(nbytes)


def all_reduce_seconds(nbytes: float, size: int, link: Link) -> float:
    """A ring all-reduce of ``nbytes`` over ``size`` ranks."""
    if size == 1 or nbytes == 0:
        return 0.0
    steps = 2 * (size - 1)
    return steps * link.latency_us * 1e-6 + steps / size * nbytes / (link.bandwidth_gbs * 1e9)


def gather_seconds(nbytes: float, size: int, link: Link) -> float:
    """A ring all-gather (or reduce-scatter) whose full tensor has ``nbytes``."""
    if size == 1 or nbytes == 0:
        return 0.0
    steps = size - 1
    return steps * link.latency_us * 1e-6 + steps / size * nbytes / (link.bandwidth_gbs * 1e9)


@functools.lru_cache(maxsize=4096)
def _group_links(cluster: Cluster, dp: int, tp: int, pp: int) -> tuple[Link, Link, Link]:
    """The links of rank 0's tensor, data and pipeline groups (the slowest hop decides a ring)."""
    grid = RankGrid(dp=dp, tp=tp, pp=pp)
    return tuple(cluster.link_for(grid.axis_groups(axis)[0]) for axis in ("tp", "dp", "pp"))


def _cuts(profile: GraphProfile, pieces: int, unit_seconds: Sequence[float]) -> list[int]:
    """Piece boundaries over the units: only where no more crosses than between two layers (as the
    min_bytes split cuts), the slowest piece as fast as possible."""
    count = len(profile)
    if pieces == 1:
        return [0, count]
    floor = min((profile.crossing_bytes[k] for k in profile.layer_starts if k > 0), default=None)
    allowed = [k for k in range(1, count) if floor is None or profile.crossing_bytes[k] <= floor * 1.01]
    if len(allowed) < pieces - 1:
        raise LayoutError(f"only {len(allowed) + 1} pieces can be cut between layers, {pieces} needed")
    prefix = [0.0]
    for value in unit_seconds:
        prefix.append(prefix[-1] + value)

    def greedy(limit: float) -> list[int] | None:
        bounds, start = [0], 0
        for index, k in enumerate(allowed):
            if prefix[k] - prefix[start] > limit:
                previous = allowed[index - 1] if index else None
                if previous is None or previous <= start or prefix[previous] - prefix[start] > limit:
                    return None
                bounds.append(previous)
                start = previous
        if prefix[count] - prefix[start] > limit:
            if allowed[-1] <= start or prefix[count] - prefix[allowed[-1]] > limit:
                return None
            bounds.append(allowed[-1])
        return bounds + [count] if len(bounds) <= pieces else None

    low, high = max(unit_seconds, default=0.0), prefix[count]
    best = greedy(high)
    for _ in range(60):
        middle = (low + high) / 2
        found = greedy(middle)
        if found is None:
            low = middle
        else:
            high, best = middle, found
    best = best or [0, count]
    # The slowest piece is as fast as it can be with fewer pieces than asked: split the costliest
    # pieces further, each at the allowed cut nearest its middle (in time).
    while len(best) - 1 < pieces:
        spans = sorted(zip(best, best[1:]), key=lambda span: prefix[span[1]] - prefix[span[0]], reverse=True)
        for first, last in spans:
            middle = (prefix[first] + prefix[last]) / 2
            low, high = bisect.bisect_right(allowed, first), bisect.bisect_left(allowed, last)
            if low < high:
                cut = min(allowed[low:high], key=lambda k: abs(prefix[k] - middle))
                bisect.insort(best, cut)
                break
        else:
            raise LayoutError(f"the model cannot be cut into {pieces} pieces")
    return best


class StageCostModel:
    """Prices the pipeline part of a schedule for the simulator, per stage and chunk (the gradient
    reduction and the optimizer step after it are added per stage by :meth:`CostModel.predict`)."""

    def __init__(self, pieces: Sequence[VirtualStage], num_stages: int, p2p_link: Link, recompute: bool) -> None:
        self.pieces, self.num_stages, self.link, self.recompute = pieces, num_stages, p2p_link, recompute

    def _piece(self, stage_id: int, instruction) -> VirtualStage:
        return self.pieces[getattr(instruction, "chunk", 0) * self.num_stages + stage_id]

    def of(self, stage_id: int, instruction) -> float:
        if isinstance(instruction, (Forward, PreCheckpointForward)):
            return self._piece(stage_id, instruction).forward
        if isinstance(instruction, RecomputeForward):
            return self._piece(stage_id, instruction).recompute
        if isinstance(instruction, (Backward, BackwardInput, BackwardWeight)):
            piece = self._piece(stage_id, instruction)
            extra = piece.recompute if self.recompute else 0.0
            if isinstance(instruction, Backward):
                return piece.backward + extra
            half = piece.split / 2
            return half + extra if isinstance(instruction, BackwardInput) else half
        if isinstance(instruction, (Exchange, *P2P_TYPES)):
            return p2p_seconds(self._piece(stage_id, instruction).send_bytes, self.link)
        return 0.0


def _in_flight_peak(instructions, weights: dict[int, int]) -> int:
    """The largest sum of ``weights[chunk]`` over microbatches forwarded and not yet fully backwarded."""
    live, peak, current = set(), 0, 0
    weight_split = any(isinstance(i, BackwardWeight) for i in instructions)
    for instruction in instructions:
        key = (getattr(instruction, "chunk", 0), getattr(instruction, "microbatch", None))
        if isinstance(instruction, (Forward, PreCheckpointForward)) and key not in live:
            live.add(key)
            current += weights.get(key[0], 0)
        elif (isinstance(instruction, BackwardWeight) or (isinstance(instruction, Backward) and not weight_split)) \
                and key in live:
            live.discard(key)
            current -= weights.get(key[0], 0)
        peak = max(peak, current)
    return peak


def _prefix(values: Sequence[float]) -> list[float]:
    return [0, *itertools.accumulate(values)]


@dataclass(frozen=True)
class _UnitTable:
    """One profile's per-unit costs at one microbatch, as prefix sums: any piece is priced in O(1)."""

    forward: list[float]  # prefix sums of compute seconds (calibrated, no CPU sharing)
    ops: list[float]  # prefix sums of the operations run
    tp_forward: list[float]  # prefix sums of the tensor-parallel collectives' seconds, latency left out ...
    tp_backward: list[float]
    tp_forward_hops: list[float]  # ... and of their hops, each paying the link's latency
    tp_backward_hops: list[float]
    params: list[float]
    saved: list[float]
    kept: list[float]  # prefix sums of what crosses each layer start (what recomputation keeps)
    layer_saved: list[tuple[int, int]]  # (layer start, saved bytes up to the next layer start)
    cuts_at: list[float]  # per-unit seconds used to place piece boundaries
    crossing: tuple[int, ...]
    # GraphProfile.received_saved_bytes; a profile without them: its crossing (its saves count what a stage receives)
    received_saved: tuple[int, ...]
    layer_starts: tuple[int, ...]
    loss_forward: float
    loss_backward: float
    output_bytes: int
    dtype_bytes: int
    shared: tuple[tuple[int, tuple[int, ...]], ...]  # GraphProfile.shared_params

    @property
    def count(self) -> int:
        return len(self.crossing) - 1


def _tied_in(shared, bounds: Sequence[int], index: int) -> int:
    """Elements of shared (tied) parameters that piece ``index`` (of the pieces starting at ``bounds``) reads
    and another piece reads too: each holder's copy has its gradient summed with the others' after the
    backward."""
    first, last = bounds[index], bounds[index + 1]
    tied = 0
    for numel, readers in shared:
        pieces = {bisect.bisect_right(bounds, unit) - 1 for unit in readers}
        if len(pieces) > 1 and any(first <= unit < last for unit in readers):
            tied += numel
    return tied


def _shared_in(shared, first: int, last: int) -> int:
    """Elements of shared (tied) parameters that units ``first .. last - 1`` read after an earlier piece did:
    the piece keeps its own copy (merak sums the copies' gradients)."""
    return sum(numel for numel, readers in shared
               if readers[0] < first and any(first <= unit < last for unit in readers))


def in_flight_counts(schedule: str, num_stages: int, num_microbatches: int, chunks: int) -> list[int]:
    """Per stage, the most microbatch pieces whose forward ran and backward has not (closed form):
    1F1B holds ``min(S - s, M)``, zero-bubble ``min(S, M)`` (a weight gradient waits), GPipe all ``M``,
    interleaving ``2 (S - s - 1) + (v - 1) S + 1``."""
    if schedule == "gpipe":
        return [num_microbatches * chunks] * num_stages
    if schedule == "zb_h1":
        return [min(num_stages, num_microbatches)] * num_stages
    if chunks > 1:
        return [min(2 * (num_stages - s - 1) + (chunks - 1) * num_stages + 1, num_microbatches * chunks)
                for s in range(num_stages)]
    return [min(num_stages - s, num_microbatches) for s in range(num_stages)]


class CostModel:
    """Predicts :class:`Prediction` for layouts of one model on one cluster.

    Args:
        profiles: ``(tp, sequence_parallel) -> GraphProfile`` (at any microbatch; scaled here).
        cluster: the devices and links.
        dtype: the compute dtype's name (``float32``, ``bfloat16``, ``float16``).
        calibration: what timing the model here found (:mod:`merak.autoplan.calibrate`): a scale of the
            compute estimates, the optimizer's time per parameter, how processes sharing the cores slow
            each other and how long a collective waits for them (default: nothing measured, the device
            rates and links alone).
        sharding: the run's capture, split and partition options: layouts are priced as the run will cut
            the model into stages (:func:`merak.shard.plan.stage_unit_bounds`). None, or a split method that
            reads the graph itself: the cuts that balance the calibrated costs best.
    """

    def __init__(self, profiles, cluster: Cluster, dtype: str = "float32", *,
                 calibration: Calibration = Calibration(), sharding: ShardingOptions | None = None) -> None:
        self.profiles, self.dtype, self.calibration, self.sharding = profiles, dtype, calibration, sharding
        # Whose nominal rates a run's partitioner weighs the units with (merak.shard.costs).
        self.device_type = cluster.device_type
        if calibration.all_reduce_s is not None and calibration.processes > 1:
            # A collective among processes that share the cores waits for each to be scheduled: the
            # latency of a hop is what the measured all-reduce took per ring step.
            hop = calibration.all_reduce_s / (2 * (calibration.processes - 1)) * 1e6
            link = cluster.intra_node
            cluster = dataclasses.replace(cluster, intra_node=dataclasses.replace(
                link, latency_us=max(link.latency_us, hop)))
        self.cluster = cluster
        self.reduction_links = _reduction_links(calibration, cluster.intra_node)
        self._tables: dict[tuple[int, bool, int], _UnitTable] = {}
        self._bounds: dict[tuple, list[int]] = {}
        self._simulations: dict[tuple, tuple[list[float], tuple | None]] = {}

    @functools.cached_property
    def _split_seconds_per_op(self) -> float:
        """What splitting the backward adds per operation (zero-bubble schedules): the calibration's factor
        applied to the whole model's backward where it was timed, spread evenly over the model's operations
        (the split walks autograd's graph in Python: a stage of many small operations pays far more than its
        share of the compute, a stage of one large product hardly anything)."""
        calibration = self.calibration
        if calibration.split_backward_factor <= 1.0:
            return 0.0
        table = self._table(Layout(dp=1, tp=1, pp=1, micro_batch_size=calibration.split_backward_micro_batch,
                                   num_microbatches=1))
        backward = table.forward[-1] * BACKWARD_FLOPS_FACTOR + table.loss_backward
        return (calibration.split_backward_factor - 1.0) * backward / table.ops[-1] if table.ops[-1] > 0 else 0.0

    def _table(self, layout: Layout) -> _UnitTable:
        key = (layout.tp, layout.sequence_parallel, layout.micro_batch_size)
        if key in self._tables:
            return self._tables[key]
        profile = self.profiles(layout.tp, layout.sequence_parallel).scaled(layout.micro_batch_size)
        rates = device_rates(self.cluster, self.dtype)
        tp_link, _, _ = _group_links(self.cluster, 1, layout.tp, 1)
        tp_hop = self._tp_hop_seconds(layout.tp)
        size_factor = self.calibration.size_factor(layout.micro_batch_size)
        forward = [self.calibration.seconds(rates, f, b, o) * size_factor
                   for f, b, o in zip(profile.flops, profile.bytes_moved, profile.ops)]
        # The latency is priced per layout (how many processes the collectives wait for), the rest here.
        moving = dataclasses.replace(tp_link, latency_us=0.0)
        tp_forward = [all_reduce_seconds(r, layout.tp, moving) + gather_seconds(g, layout.tp, moving)
                      for r, g in zip(profile.forward_all_reduce, profile.forward_gather)]
        tp_backward = [all_reduce_seconds(r, layout.tp, moving) + gather_seconds(g, layout.tp, moving)
                       for r, g in zip(profile.backward_all_reduce, profile.backward_gather)]
        tp_forward_hops = [_hops(r, g, layout.tp) for r, g in zip(_calls(profile, "forward_all_reduce"),
                                                                   _calls(profile, "forward_gather"))]
        tp_backward_hops = [_hops(r, g, layout.tp) for r, g in zip(_calls(profile, "backward_all_reduce"),
                                                                    _calls(profile, "backward_gather"))]
        starts = [k for k in profile.layer_starts if 0 < k < len(profile)]
        kept = [profile.crossing_bytes[k] if k in set(starts) else 0 for k in range(len(profile))]
        edges = [*starts, len(profile)]
        layer_saved = [(a, sum(profile.saved_bytes[a:b])) for a, b in zip(edges, edges[1:])]
        table = _UnitTable(
            forward=_prefix(forward), ops=_prefix(profile.ops),
            tp_forward=_prefix(tp_forward), tp_backward=_prefix(tp_backward),
            tp_forward_hops=_prefix(tp_forward_hops), tp_backward_hops=_prefix(tp_backward_hops),
            params=_prefix(profile.params), saved=_prefix(profile.saved_bytes), kept=_prefix(kept),
            layer_saved=layer_saved,
            cuts_at=[f * (1 + BACKWARD_FLOPS_FACTOR) + a + b + (ha + hb) * tp_hop
                     for f, a, b, ha, hb in zip(forward, tp_forward, tp_backward, tp_forward_hops, tp_backward_hops)],
            crossing=tuple(profile.crossing_bytes),
            received_saved=tuple(profile.received_saved_bytes) or tuple(profile.crossing_bytes),
            layer_starts=tuple(starts),
            loss_forward=self.calibration.seconds(rates, 0, LOSS_PASSES_FORWARD * profile.output_bytes, LOSS_OPS)
            * size_factor,
            loss_backward=self.calibration.seconds(rates, 0, LOSS_PASSES_BACKWARD * profile.output_bytes, LOSS_OPS)
            * size_factor,
            output_bytes=profile.output_bytes, dtype_bytes=profile.dtype_bytes, shared=profile.shared_params)
        self._tables[key] = table
        return table

    def _piece_bounds(self, layout: Layout, table: _UnitTable, exact: bool = True) -> list[int]:
        """Where the pieces start: where a run with the sharding options cuts (its split and partition,
        priced by the same nominal rates at the layout's microbatch), else the cuts balancing the
        calibrated costs best. ``exact=False`` (ranking many layouts first): the run's cuts only for a
        model of at most :data:`QUICK_RUNTIME_CUTS_MOST_UNITS` units (finding them for a thousand units
        and as many microbatches takes a fraction of a second per layout)."""
        count = layout.pp * layout.chunks
        runtime = self.sharding is not None and self.sharding.split_method == "min_bytes" \
            and (exact or table.count <= QUICK_RUNTIME_CUTS_MOST_UNITS)
        key = (layout.tp, layout.sequence_parallel, layout.micro_batch_size, count,
               layout.num_microbatches if runtime else None)
        if key not in self._bounds:
            profile = self.profiles(layout.tp, layout.sequence_parallel)
            if count == 1:
                self._bounds[key] = [0, len(profile)]
            elif runtime:
                self._bounds[key] = self._runtime_bounds(profile.scaled(layout.micro_batch_size), count,
                                                         layout.num_microbatches)
            else:
                self._bounds[key] = _cuts(profile, count, table.cuts_at)
        return self._bounds[key]

    def _runtime_bounds(self, profile: GraphProfile, count: int, num_microbatches: int) -> list[int]:
        rates = nominal_rates(self.device_type)
        forward = [rates.seconds(f, b, o) for f, b, o in zip(profile.flops, profile.bytes_moved, profile.ops)]
        try:
            return stage_unit_bounds(self.sharding, unit_forward_s=forward,
                                     loss_s=loss_seconds(rates, profile.output_bytes),
                                     cut_bytes=profile.crossing_bytes, unit_params=profile.params,
                                     unit_flops=profile.flops, num_stages=count, num_microbatches=num_microbatches)
        except (ShardingError, PartitionError) as error:
            raise LayoutError(str(error)) from None

    @staticmethod
    def _busy(layout: Layout, stage_work: Sequence[float], devices_per_node: int) -> float:
        """The processes of a node busy on average: every tensor and data replica, and the pipeline stages
        in proportion to their work over the step (M microbatches through stages of work ``w_s`` take about
        ``sum(w) + (M - 1) max(w)``: a single microbatch keeps one stage busy at a time)."""
        busiest, total, microbatches = max(stage_work), sum(stage_work), layout.num_microbatches
        busy_stages = total * microbatches / (total + (microbatches - 1) * busiest) if busiest > 0 else layout.pp
        return max(1.0, layout.dp * layout.tp * busy_stages * _on_a_node(layout, devices_per_node))

    @staticmethod
    def _stage_busy(layout: Layout, stage_work: Sequence[float], devices_per_node: int) -> list[float]:
        """Per pipeline stage, the processes of a node running while it computes: its own replicas, and each
        other stage for the share of the step it overlaps with this one (its work over the step's span, past
        the first of the M microbatches: one microbatch alone passes the stages one after another). A stage
        that is busy all along (the slowest) is thus running beside every other stage's work, while the
        slowest shares its cores with the others only when they compute. Stages of equal work give
        :meth:`_busy` for each."""
        busiest, total, microbatches = max(stage_work), sum(stage_work), layout.num_microbatches
        span = total + (microbatches - 1) * busiest
        return _running_beside(layout, devices_per_node, [(total - own) * (microbatches - 1) / span
                                                          if busiest > 0 else layout.pp - 1 for own in stage_work])

    def _share(self, busy: float) -> float:
        """Each process's share of its device: on a CPU node the ``busy`` processes share the cores."""
        if self.cluster.cores_per_node is None:
            return 1.0
        measured = self.calibration.slowdown(busy, self.cluster.cores_per_node)
        return 1 / measured if measured is not None else self.cluster.compute_share(busy)

    def _tp_hop_seconds(self, tp: int, busy: float | None = None) -> float:
        """A ring step's latency in a tensor-parallel group of ``tp`` with ``busy`` processes of the node
        running (None: every one). On this machine's node as the calibration timed a small all-reduce in such
        groups, their processes computing between collectives: with every process busy, and with the group
        alone, in proportion to the processes running in between. Else the link's (from the small
        all-reduce among all processes where timed), scaled by :meth:`_latency_scale`."""
        here = self.cluster.cores_per_node is not None
        crowded = self.calibration.hop_seconds(tp) if here else None
        if crowded is None:
            crowded = _group_links(self.cluster, 1, tp, 1)[0].latency_us * 1e-6
        if busy is None:
            return crowded
        lone = self.calibration.lone_hop_seconds(tp) if here else None
        if lone is None:
            return crowded * self._latency_scale(busy)
        share = min(1.0, max(0.0, (busy - tp) / (self.calibration.processes - tp)))
        return lone + (crowded - lone) * share

    def _latency_scale(self, busy: float) -> float:
        """How the measured hop latency (every process of the calibration taking part) scales when ``busy``
        processes run at once: a message waits for its receiver to be scheduled, which takes about as
        long as the others' time slices (gloo's small collectives among 2, 4 and 8 of 8 processes took
        about 0.3, 0.75 and 1.3 ms per hop here: in proportion to the processes taking part)."""
        processes = self.calibration.processes
        if self.calibration.all_reduce_s is None or processes < 2:
            return 1.0
        return min(1.0, max(2.0, busy) / processes)

    def pieces(self, layout: Layout) -> list[VirtualStage]:
        """The layout's model pieces (pp x chunks), each with its per-microbatch costs."""
        return self._pieces(layout)[0]

    def _pieces(self, layout: Layout, exact: bool = True) -> tuple[list[VirtualStage], float, float]:
        """The pieces, how much slower than alone each process computes (CPU processes sharing cores;
        gloo's copies and reductions of large transfers share them too), and how the latency of a message
        between them scales (:meth:`_latency_scale`)."""
        table = self._table(layout)
        bounds = self._piece_bounds(layout, table, exact)
        work = [0.0] * layout.pp
        for index, (first, last) in enumerate(itertools.pairwise(bounds)):
            work[index % layout.pp] += (table.forward[last] - table.forward[first]) * (1 + BACKWARD_FLOPS_FACTOR)
        work[(len(bounds) - 2) % layout.pp] += table.loss_forward + table.loss_backward
        busy = self._busy(layout, work, self.cluster.devices_per_node)
        # Each stage computes, and waits for its collectives' hops, beside the processes running meanwhile:
        # first as their compute says; on a CPU node again as the pieces priced so say (a stage slowed by its
        # collectives or by the split backward's walk of the graph runs beside the others for longer), for
        # the layouts priced exactly as the schedule simulated with those pieces overlaps the stages (a
        # zero-bubble stage's weight gradients run beside the previous stage's backward even for one
        # microbatch).
        per_node = self.cluster.devices_per_node
        pieces = self._priced_pieces(layout, table, bounds, self._stage_busy(layout, work, per_node))
        if self.cluster.cores_per_node is not None:
            beside = self._simulated_stage_busy(layout, pieces) if exact and layout.pp > 1 \
                else self._stage_busy(layout, _stage_work(pieces, layout), per_node)
            pieces = self._priced_pieces(layout, table, bounds, beside)
        return pieces, 1 / self._share(busy), self._latency_scale(busy)

    def _simulated_stage_busy(self, layout: Layout, pieces: Sequence[VirtualStage]) -> list[float]:
        """:meth:`_stage_busy` from the schedule simulated with ``pieces``: each stage's own replicas, and each
        other stage for the share of this one's compute during which it computes too."""
        pp, chunks = layout.pp, layout.chunks
        model = StageCostModel(pieces, pp, _group_links(self.cluster, layout.dp, layout.tp, pp)[2], layout.recompute)

        def overlaps(length: int) -> list[float]:  # own, beside, own, beside, ... by stage
            timeline = simulate(_lists(layout.schedule, pp, chunks, length), model).timeline
            return [seconds for stage in compute_overlaps(timeline, pp) for seconds in stage]

        flat = _along_the_step(layout, overlaps)
        return _running_beside(layout, self.cluster.devices_per_node,
                               [beside / own if own > 0 else 0.0 for own, beside in zip(flat[0::2], flat[1::2])])

    def _priced_pieces(self, layout: Layout, table: _UnitTable, bounds: Sequence[int],
                       stage_busy: Sequence[float]) -> list[VirtualStage]:
        """The pieces between ``bounds``, each stage's slowed and its hops waited as ``stage_busy`` (the
        processes running while it computes) says."""
        spans = list(itertools.pairwise(bounds))
        count = len(spans)
        stage_slowdown = [1 / self._share(b) for b in stage_busy]
        stage_latency = [self._tp_hop_seconds(layout.tp, b) for b in stage_busy]
        pieces = []
        for index, (first, last) in enumerate(spans):
            is_last = index == count - 1
            stage = index % layout.pp
            piece_slowdown, tp_latency = stage_slowdown[stage], stage_latency[stage]
            compute = (table.forward[last] - table.forward[first]) * piece_slowdown
            tp_f = table.tp_forward[last] - table.tp_forward[first] \
                + (table.tp_forward_hops[last] - table.tp_forward_hops[first]) * tp_latency
            tp_b = table.tp_backward[last] - table.tp_backward[first] \
                + (table.tp_backward_hops[last] - table.tp_backward_hops[first]) * tp_latency
            kept = table.kept[last] - table.kept[first + 1] + (table.crossing[first] if first > 0 else 0)
            largest = max((saved for start, saved in table.layer_saved if first <= start < last),
                          default=round(table.saved[last] - table.saved[first]))
            loss_saved = table.output_bytes if is_last else 0
            # A stage keeps what it receives until its backward, saved by its operations or not.
            received = max(0, table.crossing[first] - table.received_saved[first]) if first > 0 else 0
            backward = compute * BACKWARD_FLOPS_FACTOR + (table.loss_backward * piece_slowdown if is_last else 0.0)
            # A piece fed the model's inputs (the first, or one after pieces without units) needs no input
            # gradient: its backward runs whole whatever the schedule.
            split = backward + ((table.ops[last] - table.ops[first]) * self._split_seconds_per_op * piece_slowdown
                                if first > 0 else 0.0)
            pieces.append(VirtualStage(
                forward=compute + tp_f + (table.loss_forward * piece_slowdown if is_last else 0.0),
                backward=backward + tp_b, split_backward=split + tp_b,
                recompute=compute + tp_f,
                send_bytes=0 if is_last else table.crossing[last],
                params=round(table.params[last] - table.params[first]) + _shared_in(table.shared, first, last),
                saved=round(table.saved[last] - table.saved[first]) + received + loss_saved,
                kept=round(kept) + loss_saved, largest_layer=largest, tp_seconds=tp_f + tp_b,
                tied=_tied_in(table.shared, bounds, index)))
        return pieces

    def _load_seconds(self, layout: Layout, slowdown: float) -> float:
        """Loading the step's microbatches on the first stage before it computes (the trainer reads and
        collates them in the training process on CPU), as the calibration timed one alone, slowed as the
        processes' compute is. The last stage loads its own while the first stage's forwards reach it (with
        one stage, the same load)."""
        return layout.num_microbatches * self.calibration.load_seconds(layout.micro_batch_size) * slowdown

    def _sync_seconds(self, layout: Layout) -> float:
        """The scalars every step reduces over all processes (the loss, the gradient norm): as the
        calibration timed them among as many processes, else each a small all-reduce over the slowest link
        the processes span."""
        if layout.world_size == 1:
            return 0.0
        calibration = self.calibration
        if calibration.step_scalars_s is not None and calibration.processes == layout.world_size:
            return calibration.step_scalars_s
        link = self.cluster.inter_node if layout.world_size > self.cluster.devices_per_node else self.cluster.intra_node
        return STEP_SCALAR_REDUCTIONS * all_reduce_seconds(SCALAR_BYTES, layout.world_size, link)

    @staticmethod
    def _tied_seconds(layout: Layout, pieces: Sequence[VirtualStage], precision: Precision,
                      link: Link) -> list[float]:
        """Per stage, summing the gradients of its tied weights with the other stage holding them (the first
        and last stage of a model whose head reuses its embedding): an all-reduce between the two over
        ``link`` (the pipeline's, as :meth:`_reduction_link` prices a pair), after the backward."""
        return [all_reduce_seconds(sum(pieces[c * layout.pp + s].tied for c in range(layout.chunks))
                                   * precision.gradient, 2, link) for s in range(layout.pp)]

    def _reduction_link(self, size: int, link: Link, slowdown: float, active: float) -> Link:
        """The link a reduction of gradients among ``size`` processes over ``link`` runs at, while ``active``
        processes of the node reduce at once. Within a node whose reductions were timed: as the timed size
        nearest ``size`` took, faster in proportion when fewer processes than were timed crowd the cores.
        Else ``link`` slowed as the processes' compute is."""
        if not self.reduction_links or link != self.cluster.intra_node:
            return _slowed(link, slowdown)
        timed = self.reduction_links[min(self.reduction_links, key=lambda timed_size: (abs(timed_size - size),
                                                                                          timed_size))]
        cores = self.cluster.cores_per_node or 1
        return _slowed(timed, max(1.0, active / cores) / max(1.0, self.calibration.processes / cores))

    def _data_parallel_seconds(self, layout: Layout, parameters: int, precision: Precision, link: Link) -> float:
        """A stage's data-parallel traffic after its backward: the all-reduce of its gradients, or with ZeRO
        their reduce-scatter and the all-gather of the updated weights. Gradients travel in float32 whenever
        the optimizer keeps float32 copies (mixed precision, ZeRO: the copies are reduced). Gloo reduces and
        scatters by a whole all-reduce, so on CPU processes ZeRO moves half as much again as no ZeRO."""
        dp = layout.dp
        if dp == 1:
            return 0.0
        gradient_bytes = parameters * (precision.master or precision.gradient)
        if layout.zero_stage == 0:
            return all_reduce_seconds(gradient_bytes, dp, link)
        timed = self._zero_step_difference(layout, gradient_bytes)
        if timed is not None:
            return max(0.0, all_reduce_seconds(gradient_bytes, dp, link) + timed)
        scatter = all_reduce_seconds if self.device_type == "cpu" else gather_seconds
        return scatter(gradient_bytes, dp, link) + gather_seconds(parameters * precision.weight, dp, link)

    def _zero_step_difference(self, layout: Layout, gradient_bytes: float) -> float | None:
        """What ZeRO adds to the end of a step of ``gradient_bytes`` of gradients over the end without it (the
        whole update included, see :meth:`_optimizer_seconds`): as the calibration timed it in groups of the
        size nearest ``layout.dp``, in proportion to the bytes, when it ran as many processes as the layout
        (every group ends its step at once); None: not timed so. ZeRO-2 scatters the same gradients during
        the backward, one bucket at a time as gloo's collectives block: priced as ZeRO-1."""
        calibration = self.calibration
        if not self._zero_timed(layout):
            return None
        timed = dict(calibration.zero_step_differences)
        nearest = min(timed, key=lambda size: (abs(size - layout.dp), size))
        return timed[nearest] * gradient_bytes / calibration.gradient_all_reduce_bytes

    def _zero_timed(self, layout: Layout) -> bool:
        """Whether the calibration timed ZeRO's step end among as many processes as ``layout`` has."""
        calibration = self.calibration
        return bool(calibration.zero_step_differences) and calibration.gradient_all_reduce_bytes > 0 \
            and calibration.processes == layout.world_size

    def _stepped_parameters(self, layout: Layout, parameters: float) -> float:
        """The parameters one process of a stage of ``parameters`` updates: with ZeRO its share, unless the
        calibration timed ZeRO's whole end against the plain one (:meth:`_zero_step_difference`)."""
        return parameters / layout.dp if layout.zero_stage and not self._zero_timed(layout) else parameters

    def _optimizer_seconds(self, layout: Layout, parameters: float, slowdown: float, crowd: float) -> float:
        """The clip and optimizer step of a stage whose processes each update ``parameters``
        (:meth:`_stepped_parameters`).

        When the calibration ran as many processes as ``layout`` and timed them all stepping at once (every
        process ends its step at about the same time, streaming its state through the memory and the cores
        they share), the stage steps at the rate the calibration's processes stepped theirs together, among
        ``crowd``: how many parameters the node's processes step meanwhile (:func:`stepping_crowds`), never
        faster than one process alone. Not timed together: as one process alone took, or the device's
        memory bandwidth says, slowed as the processes' compute is."""
        calibration = self.calibration
        if calibration.concurrent_optimizer_seconds_per_parameter is not None \
                and calibration.processes == layout.world_size:
            if not parameters:
                return 0.0
            alone = parameters * (calibration.optimizer_seconds_per_parameter or 0.0)
            return max(alone, crowd * calibration.concurrent_optimizer_seconds_per_parameter / calibration.processes)
        if calibration.optimizer_seconds_per_parameter is not None:
            return parameters * calibration.optimizer_seconds_per_parameter * slowdown
        return parameters * ADAM_BYTES_PER_PARAMETER / (self.cluster.accelerator.memory_bandwidth_gbs * 1e9) * slowdown

    def _state_bytes(self, layout: Layout, params: int, precision: Precision) -> int:
        dp = layout.dp
        sharded_optimizer = (precision.master + precision.optimizer) / (dp if layout.zero_stage >= 1 else 1)
        gradient = precision.gradient / (dp if layout.zero_stage >= 2 else 1)
        return round(params * (precision.weight + gradient + sharded_optimizer))

    def _activation_bytes(self, layout: Layout, pieces: Sequence[VirtualStage], stage: int, lists,
                          counts: Sequence[int]) -> int:
        """Peak activations on ``stage``: exact from its instruction list when given, else from ``counts``
        (:func:`in_flight_counts`)."""
        mine = {c: pieces[c * layout.pp + stage] for c in range(layout.chunks)}
        weights = {c: p.kept if layout.recompute else p.saved for c, p in mine.items()}
        held = _in_flight_peak(lists[stage], weights) if lists is not None else counts[stage] * max(weights.values())
        return held + (max(p.largest_layer for p in mine.values()) if layout.recompute else 0)

    def _simulated(self, layout: Layout, pieces: Sequence[VirtualStage], p2p_link: Link):
        """:func:`simulated_pipeline`, shared by layouts whose pipelines cost the same (ZeRO stages differ
        only after the pipeline)."""
        key = (layout.schedule, layout.pp, layout.chunks, layout.num_microbatches, layout.recompute, p2p_link,
               tuple((p.forward, p.backward, p.split, p.recompute, p.send_bytes) for p in pieces))
        if key not in self._simulations:
            model = StageCostModel(pieces, layout.pp, p2p_link, layout.recompute)
            self._simulations[key] = simulated_pipeline(layout, model)
        return self._simulations[key]

    def predict(self, layout: Layout, *, simulate_schedule: bool = True) -> Prediction:
        """The layout's step time and memory per pipeline stage (raises LayoutError if it cannot run).

        ``simulate_schedule``: run the real instruction lists through the simulator (exact bubbles and
        activations in flight); False: closed forms, for ranking many layouts quickly.
        """
        pieces, slowdown, latency_scale = self._pieces(layout, exact=simulate_schedule)
        precision = Precision.of(self._table(layout).dtype_bytes)
        _, dp_link, pp_link = _group_links(self.cluster, layout.dp, layout.tp, layout.pp)
        # Every data-parallel group reduces at about the same time, and every replica's first and last stage
        # pair sums its tied weights.
        on_a_node = _on_a_node(layout, self.cluster.devices_per_node)
        dp_link = self._reduction_link(layout.dp, dp_link, slowdown, layout.world_size * on_a_node)
        tied_link = self._reduction_link(2, pp_link, slowdown, 2 * layout.dp * layout.tp * on_a_node)
        pp_link = _slowed(pp_link, slowdown)
        pp, chunks = layout.pp, layout.chunks
        stage_params = [sum(pieces[c * pp + s].params for c in range(chunks)) for s in range(pp)]
        dp_seconds = [self._data_parallel_seconds(layout, p, precision, dp_link) for p in stage_params]
        tied_seconds = self._tied_seconds(layout, pieces, precision, tied_link)
        sync = self._sync_seconds(layout)
        load = self._load_seconds(layout, slowdown)
        lists = None
        # Without a simulation, stage 0 ends last and the last stage first, as in every schedule here.
        ends = [float(pp - stage) for stage in range(pp)]
        if simulate_schedule:
            ends, lists = self._simulated(layout, pieces, pp_link)
        stepped = [self._stepped_parameters(layout, p) for p in stage_params]
        crowds = stepping_crowds(stepped, ends, layout.dp * layout.tp * on_a_node)
        optimizer_seconds = [self._optimizer_seconds(layout, p, slowdown, crowd) for p, crowd in zip(stepped, crowds)]
        if simulate_schedule:
            # Each stage reduces its gradients and steps once its last backward is done.
            step = max(end + tied + dp + step_s for end, tied, dp, step_s
                       in zip(ends, tied_seconds, dp_seconds, optimizer_seconds)) + sync + load
        counts = in_flight_counts(layout.schedule, pp, layout.num_microbatches, chunks)
        memory = tuple(self._state_bytes(layout, stage_params[s], precision)
                       + self._activation_bytes(layout, pieces, s, lists, counts) for s in range(pp))
        if lists is None:
            step = quick_step_seconds(pieces, layout, dp_seconds, optimizer_seconds, pp_link) + max(tied_seconds) \
                + sync + load
        per_microbatch = _stage_work(pieces, layout)
        busiest = max(range(pp), key=per_microbatch.__getitem__)
        work = per_microbatch[busiest] * layout.num_microbatches
        mine = [pieces[c * pp + busiest] for c in range(chunks)]
        breakdown = {
            "compute_s": work,
            "bubble_s": max(0.0, step - work - max(tied_seconds) - max(dp_seconds) - max(optimizer_seconds) - sync
                            - load),
            "tied_comm_s": max(tied_seconds),
            "tp_comm_s": sum(p.tp_seconds for p in mine) * layout.num_microbatches,
            "recompute_s": sum(p.recompute for p in mine) * layout.num_microbatches if layout.recompute else 0.0,
            "dp_comm_s": max(dp_seconds), "optimizer_s": max(optimizer_seconds), "sync_s": sync, "load_s": load}
        return Prediction(layout=layout, step_s=step, stage_memory=memory, breakdown=breakdown,
                          simulated=simulate_schedule)


@functools.lru_cache(maxsize=256)
def _lists(schedule: str, pp: int, chunks: int, microbatches: int) -> tuple[tuple, ...]:
    return tuple(tuple(build_schedule(name=schedule, stage_id=s, num_stages=pp, num_microbatches=microbatches,
                                      num_chunks=chunks)) for s in range(pp))


def _stage_ends(lists, model: StageCostModel) -> list[float]:
    ends = [0.0] * len(lists)
    for event in simulate(lists, model).timeline:
        ends[event.stage] = max(ends[event.stage], event.end)
    return ends


def stepping_crowds(stepped: Sequence[float], ends: Sequence[float], processes_per_stage: float) -> list[float]:
    """Per pipeline stage, the parameters a node's processes step while it steps its own ``stepped[stage]``,
    when the stages finish their last instruction at ``ends`` and each has ``processes_per_stage`` processes
    on the node: the processes share the cores, each as long as it has work, so a stage is done once every
    process has stepped as much as it (or all of its own, if less). A process whose stage finished earlier
    has only its step left; one still computing (or a replica of this stage) is busy all along. A deep
    pipeline's stages hold a fraction of the model each: the GPT toy's embedding stage ends last and steps
    nearly alone; the BERT toy's last stage (on two stages all of its parameters) ends first and steps beside
    the first stage's backward."""
    return [processes_per_stage * sum(min(mine, theirs) if ends[other] <= ends[stage] and other != stage
                                      else mine for other, theirs in enumerate(stepped))
            for stage, mine in enumerate(stepped)]


def _on_a_node(layout: Layout, devices_per_node: int) -> float:
    """The share of the layout's processes that one node holds."""
    return min(layout.world_size, devices_per_node) / layout.world_size


def _running_beside(layout: Layout, devices_per_node: int, others: Sequence[float]) -> list[float]:
    """Per pipeline stage, the processes of a node running while it computes: its own replicas, and as many
    again for each other stage computing meanwhile (``others``: their count, in shares of the stage's
    compute time)."""
    return [max(1.0, layout.dp * layout.tp * _on_a_node(layout, devices_per_node) * (1 + beside)) for beside in others]


def _short_length(pp: int, chunks: int) -> int:
    """How many microbatches a long step is simulated at: whole groups of ``pp`` microbatches, past the
    warm-up (interleaving warms up over about two groups)."""
    return max(pp * (2 if chunks > 1 else 1), SIMULATED_MICROBATCHES) // pp * pp


def _along_the_step(layout: Layout, measure: Callable[[int], list[float]]) -> list[float]:
    """``measure(num_microbatches)`` of the layout's schedule. Past the warm-up (at most pp microbatches)
    every schedule here repeats the same pattern per group of ``pp`` microbatches, so what a step adds up
    grows linearly with M: a long step is measured at two short lengths and extended along that line."""
    pp, microbatches = layout.pp, layout.num_microbatches
    short = _short_length(pp, layout.chunks)
    if microbatches <= short + pp:
        return measure(microbatches)
    grow = (microbatches - short) / pp
    return [a + (b - a) * grow for a, b in zip(measure(short), measure(short + pp))]


def simulated_pipeline(layout: Layout, model: StageCostModel) -> tuple[list[float], tuple | None]:
    """When each stage finishes its last instruction (:func:`_along_the_step`), and the instruction lists
    whose activations in flight are those of the layout (a long step's: those of the shorter length
    simulated, which hold as many microbatches in flight; none for GPipe, which keeps every microbatch in
    flight)."""
    pp, chunks, microbatches = layout.pp, layout.chunks, layout.num_microbatches
    ends = _along_the_step(layout, lambda length: _stage_ends(_lists(layout.schedule, pp, chunks, length), model))
    short = _short_length(pp, chunks)
    if microbatches <= short + pp:
        return ends, _lists(layout.schedule, pp, chunks, microbatches)
    return ends, None if layout.schedule == "gpipe" else _lists(layout.schedule, pp, chunks, short)


def _computing(timeline, num_stages: int) -> list[list[tuple[float, float]]]:
    """Per stage, the intervals of a simulated timeline during which it computes, merged and in order."""
    spans: list[list[tuple[float, float]]] = [[] for _ in range(num_stages)]
    for event in sorted(timeline, key=lambda e: e.start):
        if not isinstance(event.instruction, COMPUTE_TYPES) or event.end <= event.start:
            continue
        mine = spans[event.stage]
        if mine and event.start <= mine[-1][1]:
            mine[-1] = (mine[-1][0], max(mine[-1][1], event.end))
        else:
            mine.append((event.start, event.end))
    return spans


def _overlapping(first: Sequence[tuple[float, float]], second: Sequence[tuple[float, float]]) -> float:
    """How long two ordered lists of disjoint intervals overlap."""
    total, i, j = 0.0, 0, 0
    while i < len(first) and j < len(second):
        total += max(0.0, min(first[i][1], second[j][1]) - max(first[i][0], second[j][0]))
        if first[i][1] < second[j][1]:
            i += 1
        else:
            j += 1
    return total


def compute_overlaps(timeline, num_stages: int) -> list[tuple[float, float]]:
    """Per stage of a simulated timeline, how long it computes, and how long the other stages compute while
    it does (each one's overlap with it, summed: from nothing, when it computes alone, to ``num_stages - 1``
    times its own, when all of them compute all along)."""
    spans = _computing(timeline, num_stages)
    return [(sum(end - start for start, end in mine),
             sum(_overlapping(mine, other) for index, other in enumerate(spans) if index != stage))
            for stage, mine in enumerate(spans)]


def _work(piece: VirtualStage, layout: Layout) -> float:
    """A piece's seconds per microbatch under ``layout``'s schedule (its backward split by zero-bubble ones)."""
    backward = piece.split if layout.schedule in SPLIT_BACKWARD_SCHEDULES else piece.backward
    return piece.forward + backward + (piece.recompute if layout.recompute else 0.0)


def _stage_work(pieces: Sequence[VirtualStage], layout: Layout) -> list[float]:
    """Per pipeline stage, the seconds per microbatch of its pieces (:func:`_work`)."""
    return [sum(_work(pieces[c * layout.pp + s], layout) for c in range(layout.chunks)) for s in range(layout.pp)]


def quick_step_seconds(pieces: Sequence[VirtualStage], layout: Layout, dp_seconds: Sequence[float],
                       optimizer_seconds: Sequence[float], p2p_link: Link) -> float:
    """The schedule simulator's result in closed form, for ranking many candidates before simulating the
    best: M times the busiest stage, plus the fill and drain of the other stages (shortened by
    interleaving, about a third with the zero-bubble split), plus the transfers, reduction and step."""
    pp, chunks, microbatches = layout.pp, layout.chunks, layout.num_microbatches
    work = _stage_work(pieces, layout)
    fill = (pp - 1) * (sum(work) / pp) / chunks
    if layout.schedule == "zb_h1":
        fill /= 3
    transfers = 2 * (pp * chunks - 1) * max((p2p_seconds(p.send_bytes, p2p_link) for p in pieces), default=0.0)
    return microbatches * max(work) + fill + transfers + max(dp_seconds) + max(optimizer_seconds)
