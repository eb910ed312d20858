"""Predicting a layout's step time and memory per device from a graph profile and a cluster.

Pure pricing of a cluster description; nothing here measures the machine. Compute: each unit of the
captured graph (:mod:`merak.autoplan.profile`) takes ``flops / F + bytes / B + ops * c`` at the
accelerator's rates (:class:`merak.shard.costs.MachineRates`); the backward twice the forward,
recomputation a forward more; on a CPU node, busy processes beyond its cores share them
(``cores / busy`` each). Selective recomputation reruns a unit less the FLOPs of the operators its
policy saves. Communication: tensor-parallel collectives from their bytes in the graph, pipeline
transfers from what crosses each stage boundary, the data-parallel reduction (and ZeRO's gathers and
reduce-scatters) from the stage's parameters, each over the link its group crosses. Pipeline: the
stages' costs run through the schedule simulator (:func:`merak.pipeline.simulate.simulate`) with
the real instruction lists; :func:`quick_step_seconds` is its closed form for ranking many layouts
first. Memory: the stage's model state (ZeRO divides what it shards by dp; ZeRO 2 and 3 hold a reduce
bucket of full gradients, ZeRO 3 two gathered parts) plus what autograd saves per microbatch times the
microbatches in flight, or with recomputation the checkpointed inputs (and, selective, what its policy
keeps) plus one layer being recomputed.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from merak.autoplan.cluster import Cluster, Link
from merak.autoplan.layout import RECOMPUTE_SELECTIVE, Layout
from merak.autoplan.profile import GraphProfile
from merak.core.partition import PartitionError
from merak.distributed.topology import RankGrid
from merak.pipeline.instructions import (
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
from merak.shard.plan import stage_unit_bounds
from merak.shard.settings import ShardingSettings
from merak.shard.split import ShardingError

BACKWARD_FLOPS_FACTOR = 2.0  # a backward does twice a forward's matrix work
ADAM_BYTES_PER_PARAMETER = 28  # read weight, gradient, two moments; write weight and moments (fp32)
STEP_SCALAR_REDUCTIONS = 2  # per step, over every process: the loss (for the log) and the gradient norm
SCALAR_BYTES = 8
SIMULATED_MICROBATCHES = 8  # a longer step is simulated at about this many and extended linearly
OVERLAP_BUCKET_BYTES = 25 * 2**20  # trainer.grad_bucket_mb's default: the last bucket cannot overlap
QUICK_RUNTIME_CUTS_MOST_UNITS = 256  # larger models are ranked on the planner's own cuts first (_piece_bounds)
ZERO_BUCKET_ELEMENTS = 500_000_000  # trainer.zero_reduce_bucket_size's default: full gradients held before a scatter
ZERO3_GATHERED_PARTS = 2  # a part's parameters gathered while the next one is prefetched


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
    largest_layer: int  # what the largest layer saves beyond what recomputation kept: live while it is recomputed
    tp_seconds: float  # of forward + backward, included in forward/backward
    tied: int = 0  # elements of parameters another piece reads too (tied weights): their gradients are summed
    # ZeRO on the critical path of each microbatch, included in forward/backward: ZeRO 3's all-gathers of the
    # piece's parameters before its forward and again before its backward (what prefetching cannot hide), and
    # ZeRO 2 and 3's reduce-scatter of its gradients after every backward.
    gather_forward: float = 0.0
    gather_backward: float = 0.0
    scatter: float = 0.0
    # ZeRO 3 with a split backward: the weight-gradient pass gathers every part again, one after another, before
    # it runs (merak.optim.sharded_params), all of it on the critical path; priced on BackwardWeight only.
    gather_weight_pass: float = 0.0
    parts: tuple[int, ...] = ()  # parameters of each part (a layer; the units before the first, after the last)

    @property
    def zero_seconds(self) -> float:
        """ZeRO's per-microbatch communication in forward + backward."""
        return self.gather_forward + self.gather_backward + self.scatter


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
    """One device's rates when it has its compute to itself. A simulated GPU's instruction takes its FLOPs at
    the simulated rate and nothing else (merak.energy.hooks.SimulatedCompute); its memory bandwidth is the
    CPU's, which runs the optimizer step."""
    accelerator = cluster.accelerator
    if cluster.simulated_gpu is not None:
        return MachineRates(flops_per_s=accelerator.flops_per_s(dtype), bytes_per_s=math.inf, seconds_per_op=0.0)
    return MachineRates(flops_per_s=accelerator.flops_per_s(dtype),
                        bytes_per_s=accelerator.memory_bandwidth_gbs * 1e9,
                        seconds_per_op=accelerator.seconds_per_op)


def _slowed(link: Link, slowdown: float) -> Link:
    """``link`` with its bandwidth divided by ``slowdown`` (the latency is measured as it is)."""
    return link if slowdown == 1.0 else dataclasses.replace(link, bandwidth_gbs=link.bandwidth_gbs / slowdown)


def _hops(all_reduces: int, gathers: int, size: int) -> int:
    """Ring steps of ``all_reduces`` all-reduces and ``gathers`` all-gathers over ``size`` ranks."""
    return 2 * (size - 1) * all_reduces + (size - 1) * gathers


def _calls(profile: GraphProfile, field: str) -> tuple[int, ...]:
    """How many collectives make up ``field``'s bytes per unit (without the counts: one per unit moving bytes)."""
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
def group_links(cluster: Cluster, dp: int, tp: int, pp: int) -> tuple[Link, Link, Link]:
    """The links of rank 0's tensor, data and pipeline groups (the slowest hop decides a ring)."""
    grid = RankGrid(dp=dp, tp=tp, pp=pp)
    return tuple(cluster.link_for(grid.axis_groups(axis)[0]) for axis in ("tp", "dp", "pp"))


def _cuts(profile: GraphProfile, pieces: int, unit_seconds: Sequence[float]) -> list[int]:
    """Piece boundaries over the units, only where no more crosses than between two layers (as the min_bytes
    split cuts), the slowest piece as fast as possible."""
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


@dataclass(frozen=True)
class _ZeroTraffic:
    """ZeRO 2 or 3 of one layout: its stage, dp, the data-parallel link, bytes per parameter gathered (the
    model's dtype) and reduce-scattered (float32 whenever the optimizer keeps float32 copies), and how a
    reduce-scatter is priced (gloo's takes a whole all-reduce)."""

    stage: int
    dp: int
    link: Link
    weight_bytes: int
    gradient_bytes: int
    scatter: Callable[[float, int, Link], float]


def _zero_seconds(zero: _ZeroTraffic, params: int, parts: Sequence[int], forward_s: float,
                  backward_s: float) -> tuple[float, float, float, float]:
    """ZeRO's communication inside one microbatch's passes over a piece of ``params`` parameters in ``parts``:
    (all-gather before the forward, all-gather before the backward, reduce-scatter after the backward, the
    whole piece's gathers before a split backward's weight-gradient pass).

    ZeRO 3 gathers each part's parameters over dp before its forward and again before its backward (a
    recomputation reuses the backward's), the next part prefetched while one computes: what a pass of
    ``forward_s`` or ``backward_s`` cannot hide stays on its critical path, and at least the first part's
    gather. ZeRO 2 and 3 reduce-scatter the gradients after every backward, waiting for it."""
    if params == 0:
        return 0.0, 0.0, 0.0, 0.0
    reduce_s = zero.scatter(params * zero.gradient_bytes, zero.dp, zero.link)
    if zero.stage < 3:
        return 0.0, 0.0, reduce_s, 0.0
    gathers = [gather_seconds(p * zero.weight_bytes, zero.dp, zero.link) for p in parts if p] or [0.0]
    total = sum(gathers)
    return max(total - forward_s, gathers[0]), max(total - backward_s, gathers[-1]), reduce_s, total


def _parts(table: _UnitTable, first: int, last: int) -> tuple[int, ...]:
    """Parameters of each part of units ``first .. last - 1``: cut at every layer start."""
    inside = table.starts[bisect.bisect_right(table.starts, first):bisect.bisect_left(table.starts, last)]
    edges = [first, *inside, last]
    return tuple(round(table.params[b] - table.params[a]) for a, b in itertools.pairwise(edges))


class StageCostModel:
    """Prices each instruction of a schedule for the simulator, per stage and chunk; ``recompute``: whether the
    backward recomputes (each piece's ``recompute`` seconds, full or selective)."""

    def __init__(self, pieces: Sequence[VirtualStage], num_stages: int, p2p_link: Link, recompute: bool) -> None:
        self.pieces, self.num_stages, self.link, self.recompute = pieces, num_stages, p2p_link, recompute

    def piece(self, stage_id: int, instruction) -> VirtualStage:
        return self.pieces[getattr(instruction, "chunk", 0) * self.num_stages + stage_id]

    def of(self, stage_id: int, instruction) -> float:
        if isinstance(instruction, (Forward, PreCheckpointForward)):
            return self.piece(stage_id, instruction).forward
        if isinstance(instruction, RecomputeForward):
            return self.piece(stage_id, instruction).recompute
        if isinstance(instruction, (Backward, BackwardInput, BackwardWeight)):
            piece = self.piece(stage_id, instruction)
            extra = piece.recompute if self.recompute else 0.0
            if isinstance(instruction, Backward):
                return piece.backward + extra
            # The input-gradient pass needs the gathered weights; the weight-gradient pass makes the gradients
            # that are reduce-scattered.
            half = (piece.backward - piece.gather_backward - piece.scatter) / 2
            if isinstance(instruction, BackwardInput):
                return half + piece.gather_backward + extra
            return half + piece.scatter + piece.gather_weight_pass
        if isinstance(instruction, (Exchange, *P2P_TYPES)):
            return p2p_seconds(self.piece(stage_id, instruction).send_bytes, self.link)
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

    forward: list[float]  # prefix sums of compute seconds (no CPU sharing)
    tp_forward: list[float]  # prefix sums of the tensor-parallel collectives' seconds, latency left out ...
    tp_backward: list[float]
    tp_forward_hops: list[float]  # ... and of their hops, each paying the link's latency
    tp_backward_hops: list[float]
    params: list[float]
    saved: list[float]
    kept: list[float]  # prefix sums of what crosses each layer start (what recomputation keeps)
    layer_saved: list[tuple[int, int]]  # (layer start, saved bytes up to the next layer start)
    selective_forward: list[float]  # prefix sums of compute seconds a selective recomputation reruns
    selective_kept: list[float]  # prefix sums of what the selective policy keeps besides the inputs
    layer_selective_live: list[tuple[int, int]]  # (layer start, saved bytes beyond those it keeps)
    starts: tuple[int, ...]  # layer starts inside the model (where a part begins)
    cuts_at: list[float]  # per-unit seconds used to place piece boundaries
    crossing: tuple[int, ...]
    received_saved: tuple[int, ...]  # GraphProfile.received_saved_bytes (a profile without them: its crossing)
    loss_forward: float
    loss_backward: float
    output_bytes: int
    dtype_bytes: int
    shared: tuple[tuple[int, tuple[int, ...]], ...]  # GraphProfile.shared_params

    @property
    def count(self) -> int:
        return len(self.crossing) - 1


def _tied_in(shared, bounds: Sequence[int], index: int) -> int:
    """Elements of tied parameters that piece ``index`` reads and another piece too (their gradients summed)."""
    first, last = bounds[index], bounds[index + 1]
    tied = 0
    for numel, readers in shared:
        pieces = {bisect.bisect_right(bounds, unit) - 1 for unit in readers}
        if len(pieces) > 1 and any(first <= unit < last for unit in readers):
            tied += numel
    return tied


def _shared_in(shared, first: int, last: int) -> int:
    """Elements of tied parameters that units ``first .. last - 1`` read after an earlier piece: a copy kept."""
    return sum(numel for numel, readers in shared
               if readers[0] < first and any(first <= unit < last for unit in readers))


def in_flight_counts(schedule: str, num_stages: int, num_microbatches: int, chunks: int) -> list[int]:
    """Per stage, the most microbatch pieces forwarded and not yet backwarded: 1F1B ``min(S - s, M)``,
    zero-bubble ``min(S, M)``, GPipe ``M``, interleaving ``2 (S - s - 1) + (v - 1) S + 1``."""
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
        cluster: the devices and links; dtype: the compute dtype's name.
        sharding: the run's sharding section, so that layouts are cut into stages as the run
            cuts them (:func:`merak.shard.plan.stage_unit_bounds`); None: the cuts balancing the costs best.
        overlap_grad_reduce: the run's ``trainer.overlap_grad_reduce``: data-parallel buckets start during the
            last backward (:meth:`_data_parallel_seconds`).
        zero_bucket_elements: the run's ``trainer.zero_reduce_bucket_size``: the full gradients ZeRO 2 and 3
            hold before reduce-scattering them.
    """

    def __init__(self, profiles, cluster: Cluster, dtype: str = "float32", *,
                 sharding: ShardingSettings | None = None, overlap_grad_reduce: bool = True,
                 zero_bucket_elements: int = ZERO_BUCKET_ELEMENTS) -> None:
        self.profiles, self.cluster, self.dtype, self.sharding = profiles, cluster, dtype, sharding
        self.overlap_grad_reduce = overlap_grad_reduce
        self.zero_bucket_elements = zero_bucket_elements
        # Whose nominal rates a run's partitioner weighs the units with (merak.shard.costs).
        self.device_type = cluster.device_type
        self._tables: dict[tuple[int, bool, int], _UnitTable] = {}
        self._bounds: dict[tuple, list[int]] = {}
        self._simulations: dict[tuple, tuple[list[float], tuple | None]] = {}

    def _table(self, layout: Layout) -> _UnitTable:
        key = (layout.tp, layout.sequence_parallel, layout.micro_batch_size)
        if key in self._tables:
            return self._tables[key]
        profile = self.profiles(layout.tp, layout.sequence_parallel).scaled(layout.micro_batch_size)
        rates = device_rates(self.cluster, self.dtype)
        tp_link, _, _ = group_links(self.cluster, 1, layout.tp, 1)
        tp_hop = tp_link.latency_us * 1e-6
        forward = [rates.seconds(f, b, o) for f, b, o in zip(profile.flops, profile.bytes_moved, profile.ops)]
        # The latency is priced per collective (hops), the rest here.
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
        # A profile without the selective policy's numbers prices selective recomputation as full recomputation.
        selective_kept = profile.selective_kept_bytes or (0,) * len(profile)
        saved_flops = profile.selective_saved_flops or (0,) * len(profile)
        # Selective recomputation ("matmuls") reruns what its policy does not save. Priced by operator kind: the
        # operators it saves (matrix products, fused attention) are those the FLOPs are counted for, so a unit
        # reruns less the FLOPs of the ones it saved there; their memory traffic and launches stay priced (a
        # small overestimate on a GPU, where products are bound by their FLOPs).
        selective_forward = [max(0.0, seconds - rates.seconds(f, 0, 0)) for seconds, f in zip(forward, saved_flops)]
        layer_live = [(a, max(0, sum(profile.saved_bytes[a:b]) - sum(selective_kept[a:b])))
                      for a, b in zip(edges, edges[1:])]
        table = _UnitTable(
            forward=_prefix(forward),
            tp_forward=_prefix(tp_forward), tp_backward=_prefix(tp_backward),
            tp_forward_hops=_prefix(tp_forward_hops), tp_backward_hops=_prefix(tp_backward_hops),
            params=_prefix(profile.params), saved=_prefix(profile.saved_bytes), kept=_prefix(kept),
            layer_saved=layer_saved, selective_forward=_prefix(selective_forward),
            selective_kept=_prefix(selective_kept), layer_selective_live=layer_live, starts=tuple(starts),
            cuts_at=[f * (1 + BACKWARD_FLOPS_FACTOR) + a + b + (ha + hb) * tp_hop
                     for f, a, b, ha, hb in zip(forward, tp_forward, tp_backward, tp_forward_hops, tp_backward_hops)],
            crossing=tuple(profile.crossing_bytes),
            received_saved=tuple(profile.received_saved_bytes) or tuple(profile.crossing_bytes),
            loss_forward=rates.seconds(0, LOSS_PASSES_FORWARD * profile.output_bytes, LOSS_OPS),
            loss_backward=rates.seconds(0, LOSS_PASSES_BACKWARD * profile.output_bytes, LOSS_OPS),
            output_bytes=profile.output_bytes, dtype_bytes=profile.dtype_bytes, shared=profile.shared_params)
        self._tables[key] = table
        return table

    def _piece_bounds(self, layout: Layout, table: _UnitTable, exact: bool = True) -> list[int]:
        """Where the pieces start: where a run with the sharding options cuts, else the cuts balancing the costs
        best; ranking quickly (``exact=False``), the run's cuts up to :data:`QUICK_RUNTIME_CUTS_MOST_UNITS` units."""
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
        """The processes of a node busy on average: every replica, and the pipeline stages in proportion to
        their work over the step (M microbatches through stages of work ``w`` take ``sum(w) + (M - 1) max(w)``)."""
        busiest, total, microbatches = max(stage_work), sum(stage_work), layout.num_microbatches
        busy_stages = total * microbatches / (total + (microbatches - 1) * busiest) if busiest > 0 else layout.pp
        return max(1.0, layout.dp * layout.tp * busy_stages * _on_a_node(layout, devices_per_node))

    def pieces(self, layout: Layout) -> list[VirtualStage]:
        """The layout's model pieces (pp x chunks), each with its per-microbatch costs."""
        return self._pieces(layout)[0]

    def _pieces(self, layout: Layout, exact: bool = True) -> tuple[list[VirtualStage], float]:
        """The pieces, and how much slower than alone each process computes (busy CPU processes share the cores)."""
        table = self._table(layout)
        bounds = self._piece_bounds(layout, table, exact)
        slowdown = 1.0
        # Simulated GPUs sleep out their compute: only real CPU work shares the cores.
        if self.cluster.cores_per_node is not None and self.cluster.simulated_gpu is None:
            work = [0.0] * layout.pp
            for index, (first, last) in enumerate(itertools.pairwise(bounds)):
                work[index % layout.pp] += (table.forward[last] - table.forward[first]) * (1 + BACKWARD_FLOPS_FACTOR)
            work[(len(bounds) - 2) % layout.pp] += table.loss_forward + table.loss_backward
            slowdown = max(1.0, self._busy(layout, work, self.cluster.devices_per_node) / self.cluster.cores_per_node)
        tp_latency = group_links(self.cluster, 1, layout.tp, 1)[0].latency_us * 1e-6
        selective = layout.recompute == RECOMPUTE_SELECTIVE
        zero = self._zero_links(layout, table, slowdown)
        spans = list(itertools.pairwise(bounds))
        pieces = []
        for index, (first, last) in enumerate(spans):
            is_last = index == len(spans) - 1
            compute = (table.forward[last] - table.forward[first]) * slowdown
            tp_f = table.tp_forward[last] - table.tp_forward[first] \
                + (table.tp_forward_hops[last] - table.tp_forward_hops[first]) * tp_latency
            tp_b = table.tp_backward[last] - table.tp_backward[first] \
                + (table.tp_backward_hops[last] - table.tp_backward_hops[first]) * tp_latency
            kept = table.kept[last] - table.kept[first + 1] + (table.crossing[first] if first > 0 else 0)
            if selective:
                # The forward's tensor-parallel collectives live inside merak's parallel linears, whose outputs the
                # policy saves: they do not run again.
                recompute = (table.selective_forward[last] - table.selective_forward[first]) * slowdown
                kept += table.selective_kept[last] - table.selective_kept[first]
                largest = max((live for start, live in table.layer_selective_live if first <= start < last),
                              default=round(max(0.0, table.saved[last] - table.saved[first]
                                                - (table.selective_kept[last] - table.selective_kept[first]))))
            else:
                recompute = compute + tp_f
                largest = max((saved for start, saved in table.layer_saved if first <= start < last),
                              default=round(table.saved[last] - table.saved[first]))
            loss_saved = table.output_bytes if is_last else 0
            # A stage keeps what it receives until its backward, saved by its operations or not.
            received = max(0, table.crossing[first] - table.received_saved[first]) if first > 0 else 0
            backward = compute * BACKWARD_FLOPS_FACTOR + (table.loss_backward * slowdown if is_last else 0.0)
            forward = compute + tp_f + (table.loss_forward * slowdown if is_last else 0.0)
            params = round(table.params[last] - table.params[first]) + _shared_in(table.shared, first, last)
            parts = _parts(table, first, last) if layout.zero_stage == 3 else ()
            gather_forward, gather_backward, scatter, gather_whole = \
                _zero_seconds(zero, params, parts, forward, backward + tp_b) if zero is not None else (0.0,) * 4
            pieces.append(VirtualStage(
                forward=forward + gather_forward, backward=backward + tp_b + gather_backward + scatter,
                recompute=recompute, send_bytes=0 if is_last else table.crossing[last], params=params,
                saved=round(table.saved[last] - table.saved[first]) + received + loss_saved,
                kept=round(kept) + loss_saved, largest_layer=largest, tp_seconds=tp_f + tp_b,
                tied=_tied_in(table.shared, bounds, index), gather_forward=gather_forward,
                gather_backward=gather_backward, scatter=scatter, gather_weight_pass=gather_whole, parts=parts))
        return pieces, slowdown

    def _zero_links(self, layout: Layout, table: _UnitTable, slowdown: float) -> _ZeroTraffic | None:
        """What ZeRO 2 and 3 move in every microbatch, and over which link (None: nothing, ZeRO 0 and 1)."""
        if layout.dp == 1 or layout.zero_stage < 2:
            return None
        precision = Precision.of(table.dtype_bytes)
        link = _slowed(group_links(self.cluster, layout.dp, layout.tp, layout.pp)[1], slowdown)
        return _ZeroTraffic(stage=layout.zero_stage, dp=layout.dp, link=link, weight_bytes=precision.weight,
                            gradient_bytes=precision.master or precision.gradient,
                            scatter=all_reduce_seconds if self.device_type == "cpu" else gather_seconds)

    def _sync_seconds(self, layout: Layout) -> float:
        """The loss and gradient norm every step reduces over all processes: small all-reduces over the slowest link."""
        if layout.world_size == 1:
            return 0.0
        link = self.cluster.inter_node if layout.world_size > self.cluster.devices_per_node else self.cluster.intra_node
        return STEP_SCALAR_REDUCTIONS * all_reduce_seconds(SCALAR_BYTES, layout.world_size, link)

    @staticmethod
    def _tied_seconds(layout: Layout, pieces: Sequence[VirtualStage], precision: Precision,
                      link: Link) -> list[float]:
        """Per stage, the all-reduce of its tied weights' gradients with the other holder, after the backward."""
        return [all_reduce_seconds(sum(pieces[c * layout.pp + s].tied for c in range(layout.chunks))
                                   * precision.gradient, 2, link) for s in range(layout.pp)]

    def _data_parallel_seconds(self, layout: Layout, parameters: int, precision: Precision, link: Link,
                               backward_s: float = 0.0, tied: int = 0) -> float:
        """A stage's data-parallel traffic on the step's critical path after its backward: its gradients'
        all-reduce, or with ZeRO 1 their reduce-scatter and the updated weights' all-gather (gradients in float32
        when the optimizer keeps float32 copies; gloo reduce-scatters by a whole all-reduce). ZeRO 2 and 3
        reduce-scatter during every backward (:meth:`_zero_seconds`): ZeRO 2 only gathers the updated weights
        here, ZeRO 3 nothing (its weights are gathered before each part runs).

        With ``overlap_grad_reduce`` (ZeRO 0 and 1) the buckets of all but the tied weights start during the
        stage's last weight-gradient pass of ``backward_s`` seconds, as their gradients become final: what
        that pass cannot hide stays, and at least the last bucket's share (about one bucket per
        ``OVERLAP_BUCKET_BYTES``); the tied weights' part and ZeRO's all-gather stay whole."""
        dp = layout.dp
        if dp == 1:
            return 0.0
        gradient_bytes = parameters * (precision.master or precision.gradient)
        if layout.zero_stage >= 2:
            return gather_seconds(parameters * precision.weight, dp, link) if layout.zero_stage == 2 else 0.0
        if layout.zero_stage == 0:
            reduce, gather = all_reduce_seconds(gradient_bytes, dp, link), 0.0
        else:
            scatter = all_reduce_seconds if self.device_type == "cpu" else gather_seconds
            reduce = scatter(gradient_bytes, dp, link)
            gather = gather_seconds(parameters * precision.weight, dp, link)
        if not self.overlap_grad_reduce or parameters == 0:
            return reduce + gather
        overlapped = reduce * (parameters - min(tied, parameters)) / parameters
        buckets = max(1.0, (parameters - tied) * (precision.master or precision.gradient) / OVERLAP_BUCKET_BYTES)
        exposed = max(overlapped - backward_s, overlapped / buckets)
        return reduce - overlapped + exposed + gather

    def _optimizer_seconds(self, parameters: float, slowdown: float) -> float:
        """Adam's step over ``parameters``: its state streamed through memory, slowed as the compute is."""
        return parameters * ADAM_BYTES_PER_PARAMETER / (self.cluster.accelerator.memory_bandwidth_gbs * 1e9) * slowdown

    def _state_bytes(self, layout: Layout, mine: Sequence[VirtualStage], precision: Precision) -> int:
        """A stage's model state over its pieces ``mine``. ZeRO 1 shards the master weights and optimizer state
        over dp; ZeRO 2 the gradients too, each rank summing its piece in float32, while about one reduce
        bucket of full gradients (of the piece being backwarded) waits for its reduce-scatter; ZeRO 3 also the
        weights, gathering two parts at a time in the model's dtype (the one running, the next prefetched; a
        zero-bubble weight-gradient pass gathers its whole piece)."""
        dp, stage = layout.dp, layout.zero_stage if layout.dp > 1 else 0
        params = sum(p.params for p in mine)
        sharded_optimizer = (precision.master + precision.optimizer) / (dp if stage >= 1 else 1)
        if stage < 2:
            return round(params * (precision.weight + precision.gradient + sharded_optimizer))
        piece = (precision.master or precision.gradient) / dp  # float32 sums (the run's master gradients)
        bucket = min(self.zero_bucket_elements, max(p.params for p in mine)) * precision.gradient
        if stage == 2:
            return round(params * (precision.weight + piece + sharded_optimizer) + bucket)
        parts = sorted((part for p in mine for part in p.parts), reverse=True)
        gathered = sum(parts[:ZERO3_GATHERED_PARTS])
        if layout.schedule == "zb_h1":
            gathered = max(gathered, max(p.params for p in mine))
        return round(params * (precision.weight / dp + piece + sharded_optimizer) + bucket
                     + gathered * precision.weight)

    def _activation_bytes(self, layout: Layout, pieces: Sequence[VirtualStage], stage: int, lists,
                          counts: Sequence[int]) -> int:
        """Peak activations on ``stage``: from its instruction list when given, else from ``counts``."""
        mine = {c: pieces[c * layout.pp + stage] for c in range(layout.chunks)}
        weights = {c: p.kept if layout.recomputes else p.saved for c, p in mine.items()}
        held = _in_flight_peak(lists[stage], weights) if lists is not None else counts[stage] * max(weights.values())
        return held + (max(p.largest_layer for p in mine.values()) if layout.recomputes else 0)

    def _simulated(self, layout: Layout, pieces: Sequence[VirtualStage], p2p_link: Link):
        """:func:`simulated_pipeline`, shared by layouts whose pipelines cost the same (ZeRO stages differ after it)."""
        key = (layout.schedule, layout.pp, layout.chunks, layout.num_microbatches, layout.recomputes, p2p_link,
               tuple((p.forward, p.backward, p.recompute, p.send_bytes, p.gather_backward, p.scatter) for p in pieces))
        if key not in self._simulations:
            model = StageCostModel(pieces, layout.pp, p2p_link, layout.recomputes)
            self._simulations[key] = simulated_pipeline(layout, model)
        return self._simulations[key]

    def predict(self, layout: Layout, *, simulate_schedule: bool = True) -> Prediction:
        """The layout's step time and memory per pipeline stage (LayoutError if it cannot run); with
        ``simulate_schedule`` from the real instruction lists, else closed forms (ranking many quickly)."""
        pieces, slowdown = self._pieces(layout, exact=simulate_schedule)
        precision = Precision.of(self._table(layout).dtype_bytes)
        _, dp_link, pp_link = group_links(self.cluster, layout.dp, layout.tp, layout.pp)
        # Processes sharing the cores share gloo's copies and sums too.
        dp_link, pp_link = _slowed(dp_link, slowdown), _slowed(pp_link, slowdown)
        pp, chunks = layout.pp, layout.chunks
        stage_params = [sum(pieces[c * pp + s].params for c in range(chunks)) for s in range(pp)]
        # Each stage's last weight-gradient pass (of every chunk): what overlapped buckets hide behind.
        last_backward = [sum(pieces[c * pp + s].backward for c in range(chunks)) for s in range(pp)]
        stage_tied = [sum(pieces[c * pp + s].tied for c in range(chunks)) for s in range(pp)]
        dp_seconds = [self._data_parallel_seconds(layout, p, precision, dp_link, backward, tied)
                      for p, backward, tied in zip(stage_params, last_backward, stage_tied)]
        tied_seconds = self._tied_seconds(layout, pieces, precision, pp_link)
        sync = self._sync_seconds(layout)
        # With ZeRO each process updates its share of the stage's parameters.
        optimizer_seconds = [self._optimizer_seconds(p / layout.dp if layout.zero_stage else p, slowdown)
                             for p in stage_params]
        lists = None
        if simulate_schedule:
            # Each stage reduces its gradients and steps once its last backward is done.
            ends, lists = self._simulated(layout, pieces, pp_link)
            step = max(end + tied + dp + step_s for end, tied, dp, step_s
                       in zip(ends, tied_seconds, dp_seconds, optimizer_seconds)) + sync
        counts = in_flight_counts(layout.schedule, pp, layout.num_microbatches, chunks)
        memory = tuple(self._state_bytes(layout, [pieces[c * pp + s] for c in range(chunks)], precision)
                       + self._activation_bytes(layout, pieces, s, lists, counts) for s in range(pp))
        if lists is None:
            step = quick_step_seconds(pieces, layout, dp_seconds, optimizer_seconds, pp_link) + max(tied_seconds) \
                + sync
        per_microbatch = _stage_work(pieces, layout)
        busiest = max(range(pp), key=per_microbatch.__getitem__)
        work = per_microbatch[busiest] * layout.num_microbatches
        mine = [pieces[c * pp + busiest] for c in range(chunks)]
        breakdown = {
            "compute_s": work,
            "bubble_s": max(0.0, step - work - max(tied_seconds) - max(dp_seconds) - max(optimizer_seconds) - sync),
            "tied_comm_s": max(tied_seconds),
            "tp_comm_s": sum(p.tp_seconds for p in mine) * layout.num_microbatches,
            "recompute_s": sum(p.recompute for p in mine) * layout.num_microbatches if layout.recomputes else 0.0,
            "zero_comm_s": sum(p.zero_seconds for p in mine) * layout.num_microbatches,
            "dp_comm_s": max(dp_seconds), "optimizer_s": max(optimizer_seconds), "sync_s": sync}
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


def _on_a_node(layout: Layout, devices_per_node: int) -> float:
    """The share of the layout's processes that one node holds."""
    return min(layout.world_size, devices_per_node) / layout.world_size


def _short_length(pp: int, chunks: int) -> int:
    """Microbatches a long step is simulated at: whole groups of ``pp``, past the warm-up (two for interleaving)."""
    return max(pp * (2 if chunks > 1 else 1), SIMULATED_MICROBATCHES) // pp * pp


def along_the_step(layout: Layout, measure: Callable[[int], list[float]]) -> list[float]:
    """``measure(num_microbatches)`` of the layout's schedule: past the warm-up every schedule here repeats
    per group of ``pp`` microbatches, so a long step is measured at two short lengths and extended linearly."""
    pp, microbatches = layout.pp, layout.num_microbatches
    short = _short_length(pp, layout.chunks)
    if microbatches <= short + pp:
        return measure(microbatches)
    grow = (microbatches - short) / pp
    return [a + (b - a) * grow for a, b in zip(measure(short), measure(short + pp))]


def simulated_pipeline(layout: Layout, model: StageCostModel) -> tuple[list[float], tuple | None]:
    """When each stage finishes its last instruction (:func:`along_the_step`), and instruction lists holding
    as many microbatches in flight as the layout's (None for a long GPipe step, which holds them all)."""
    pp, chunks, microbatches = layout.pp, layout.chunks, layout.num_microbatches
    ends = along_the_step(layout, lambda length: _stage_ends(_lists(layout.schedule, pp, chunks, length), model))
    short = _short_length(pp, chunks)
    if microbatches <= short + pp:
        return ends, _lists(layout.schedule, pp, chunks, microbatches)
    return ends, None if layout.schedule == "gpipe" else _lists(layout.schedule, pp, chunks, short)


def _work(piece: VirtualStage, layout: Layout) -> float:
    """A piece's seconds per microbatch under ``layout``'s schedule (its backward split by zero-bubble ones)."""
    return piece.forward + piece.backward + (piece.recompute if layout.recomputes else 0.0)


def _stage_work(pieces: Sequence[VirtualStage], layout: Layout) -> list[float]:
    """Per pipeline stage, the seconds per microbatch of its pieces (:func:`_work`)."""
    return [sum(_work(pieces[c * layout.pp + s], layout) for c in range(layout.chunks)) for s in range(layout.pp)]


def quick_step_seconds(pieces: Sequence[VirtualStage], layout: Layout, dp_seconds: Sequence[float],
                       optimizer_seconds: Sequence[float], p2p_link: Link) -> float:
    """The simulator's result in closed form, for ranking many candidates: M times the busiest stage, the
    fill and drain (shortened by interleaving and zero-bubble splits), the transfers, reduction and step."""
    pp, chunks, microbatches = layout.pp, layout.chunks, layout.num_microbatches
    work = _stage_work(pieces, layout)
    fill = (pp - 1) * (sum(work) / pp) / chunks
    if layout.schedule == "zb_h1":
        fill /= 3
    transfers = 2 * (pp * chunks - 1) * max((p2p_seconds(p.send_bytes, p2p_link) for p in pieces), default=0.0)
    return microbatches * max(work) + fill + transfers + max(dp_seconds) + max(optimizer_seconds)
