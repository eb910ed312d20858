"""From an unmodified model to pipeline stages: capture, shard, measure, partition.

``plan_pipeline`` is the whole automatic path; it allocates nothing for a
model built on the meta device (shapes and FLOPs are measured on meta
tensors), so every rank can plan a giant model and then materialize only its
own stage (``PipelinePlan.stage_parameters``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from merak.core import partition as part
from merak.core.group_registry import simulated_groups
from merak.pipeline.stage import StageModule
from merak.shard.autopipe import autopipe_boundaries, balance_other_stages, cheapen_boundaries, simulate_1f1b
from merak.shard.build import shard_modules
from merak.shard.costs import MachineRates, UnitCosts, calibrate, measure_units, nominal_rates
from merak.shard.graph import GraphUnits
from merak.shard.settings import AUTOPIPE_COSTS, PARTITION_METHODS, ShardingSettings
from merak.shard.split import ShardingError, min_bytes, split_units
from merak.trace import reuse
from merak.trace.capture import capture
from merak.trace.meta import has_meta_parameters
from merak.trace.simplify import simplify_captured

logger = logging.getLogger(__name__)

BYTES_PER_TRAINED_PARAM = 16  # fp32 weight + gradient + two Adam moments


# Backward FLOPs per forward FLOP of a shard (the weight and the input gradients): what autopipe assumes
# when it weighs FLOPs or measured forward times.
BACKWARD_FLOPS_FACTOR = 2.0


def needs_calibration(sharding: ShardingSettings, machine_rates: MachineRates | None = None) -> bool:
    """Whether planning with ``sharding`` measures the machine's rates (``autopipe_costs=calibrated`` and
    no rates given)."""
    return sharding.autopipe_costs == "calibrated" and machine_rates is None


@dataclass
class ShardReport:
    """What one shard holds and computes."""

    modules: list[str]
    num_parameters: int
    forward_flops: int
    outputs: dict[str, str]  # crossing value -> "float32[4, 128, 64]" (or a Python value's repr)
    output_bytes: int = 0  # of the tensors in ``outputs``
    activation_bytes: int = 0  # of every tensor its forward makes (an upper bound of what backward keeps)
    estimated_forward_s: float | None = None  # per microbatch, from the machine rates
    estimated_backward_s: float | None = None
    forward_seconds: float | None = None  # measured (autopipe_costs=time)


@dataclass
class PipelinePlan:
    """Shards, their measurements and the stage boundaries over them."""

    shards: list[nn.Module]
    reports: list[ShardReport]
    boundaries: list[int]
    trace_method: str
    split_method: str
    partition_method: str
    notes: list[str] = field(default_factory=list)
    num_microbatches: int = 1
    shard_starts: list[int] = field(default_factory=list)  # the unit where each shard starts, and the count

    @property
    def stage_units(self) -> list[int]:
        """The unit of the captured graph where each stage starts, and the unit count."""
        return [self.shard_starts[b] for b in self.boundaries]

    @property
    def num_stages(self) -> int:
        return len(self.boundaries) - 1

    @property
    def forward_flops(self) -> int:
        """Forward FLOPs of one microbatch through the whole model, as captured (before any
        tensor-parallel slicing): the same whatever the layout."""
        return sum(r.forward_flops for r in self.reports)

    def stage(self, stage_id: int) -> StageModule:
        """The module of stage ``stage_id``: its shards applied in order."""
        first = self.boundaries[stage_id]
        return StageModule(self.shards[first:self.boundaries[stage_id + 1]], first_part=first)

    def stages(self) -> list[StageModule]:
        return [self.stage(s) for s in range(self.num_stages)]

    def stage_parameters(self, stage_id: int) -> list[nn.Parameter]:
        """Parameters stage ``stage_id`` reads (tied ones included), each once."""
        return list({id(p): p for p in self.stage(stage_id).parameters()}.values())

    def stage_summary(self, stage_id: int) -> dict:
        """Modules, parameters, FLOPs, predicted time, boundary values and memory estimate of one stage.

        Memory: 16 bytes per parameter (fp32 weight, gradient, two Adam moments) plus the tensors its
        forward makes for each microbatch in flight (1F1B holds up to ``num_stages - stage_id``).
        """
        first, last = self.boundaries[stage_id], self.boundaries[stage_id + 1]
        reports = self.reports[first:last]
        params = sum(p.numel() for p in self.stage_parameters(stage_id))
        is_last = stage_id == self.num_stages - 1
        activation = sum(r.activation_bytes for r in reports)
        in_flight = min(self.num_stages - stage_id, self.num_microbatches)
        modules = [name for r in reports for name in r.modules]
        summary = {"stage": stage_id, "shards": [first, last], "modules": list(dict.fromkeys(modules)),
                   "num_parameters": params, "forward_flops": sum(r.forward_flops for r in reports),
                   "sends": {} if is_last else reports[-1].outputs,
                   "send_bytes": 0 if is_last else reports[-1].output_bytes,
                   "activation_bytes": activation,
                   "estimated_memory_bytes": params * BYTES_PER_TRAINED_PARAM + activation * in_flight}
        if all(r.estimated_forward_s is not None for r in reports):
            summary["predicted_forward_s"] = sum(r.estimated_forward_s for r in reports)
            summary["predicted_backward_s"] = sum(r.estimated_backward_s for r in reports)
        return summary

    def predicted_step_seconds(self) -> float | None:
        """The 1F1B step time the estimated costs predict (communication not counted), or None."""
        stages = [self.stage_summary(s) for s in range(self.num_stages)]
        if any("predicted_forward_s" not in stage for stage in stages):
            return None
        return simulate_1f1b([s["predicted_forward_s"] for s in stages],
                             [s["predicted_backward_s"] for s in stages], self.num_microbatches)

    def to_json(self) -> dict:
        """The plan as plain data (``partition.json``)."""
        return {"trace_method": self.trace_method, "split_method": self.split_method,
                "partition_method": self.partition_method, "num_shards": len(self.shards),
                "boundaries": self.boundaries, "notes": self.notes, "num_microbatches": self.num_microbatches,
                "predicted_step_s": self.predicted_step_seconds(),
                "stages": [self.stage_summary(s) for s in range(self.num_stages)],
                "shards": [vars(r) for r in self.reports]}


def _display_name(scope: tuple[str, ...]) -> str:
    """The name that says what a unit belongs to: its numbered block (transformer.h.3,
    bert.encoder.layer.0) when it is in one, else its second-level module (transformer.wte)."""
    numbered = [name for name in scope if name.rsplit(".", 1)[-1].isdigit()]
    return numbered[0] if numbered else scope[min(1, len(scope) - 1)]


def default_shard_count(model: nn.Module) -> int:
    """About two shards per layer (as the original): from the model config's layer count, else 16."""
    config = getattr(model, "config", None)
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return 2 * value
    return 16


def _forward_seconds(shard: nn.Module, payload, repeats: int = 3) -> float:
    """Fastest of a few forward runs of one shard (the minimum is the least noisy estimate)."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        shard(payload)
        best = min(best, time.perf_counter() - started)
    return best


def _time_shards(shards: Sequence[nn.Module], module: nn.Module, example_inputs: Mapping[str, torch.Tensor]
                 ) -> list[float]:
    """Measured forward seconds of each shard (real weights), run in sequence without gradients;
    buffer updates (batch-norm statistics) are undone afterwards."""
    buffers = {name: b.clone() for name, b in module.named_buffers()}
    seconds = []
    payload = dict(example_inputs)
    with torch.no_grad(), simulated_groups():
        for shard in shards:
            seconds.append(_forward_seconds(shard, payload))
            payload = shard(payload)
        for name, buffer in module.named_buffers():
            buffer.copy_(buffers[name])
    return seconds


def _reports(shards: Sequence[nn.Module], units: GraphUnits, cuts: Sequence[int], costs: UnitCosts,
             rates: MachineRates | None) -> list[ShardReport]:
    """What each shard holds, computes and sends, from the per-unit measurements."""
    input_names = dict(zip(units.placeholders, units.captured.input_names))
    bounds = [0, *cuts, len(units)]
    estimates = shard_estimates(costs.forward_seconds(rates), bounds, costs.loss_seconds(rates)) \
        if rates is not None else None
    reports = []
    for index, shard in enumerate(shards):
        start, stop = bounds[index], bounds[index + 1]
        scope = [_display_name(u.scope) for u in units.units[start:stop] if u.scope]
        sent = units.crossing_values(stop) if stop < len(units) else []
        report = ShardReport(
            modules=list(dict.fromkeys(scope)),
            num_parameters=sum(p.numel() for p in {id(p): p for p in shard.parameters()}.values()),
            forward_flops=sum(costs.flops[start:stop]),
            outputs={input_names.get(v, v.name): costs.descriptions.get(v, "?") for v in sent},
            output_bytes=sum(costs.value_bytes.get(v, 0) for v in sent),
            activation_bytes=sum(costs.made_bytes[start:stop]))
        if estimates is not None:
            report.estimated_forward_s, report.estimated_backward_s = estimates[index]
        reports.append(report)
    return reports


def shard_estimates(unit_forward_s: Sequence[float], bounds: Sequence[int],
                    loss_s: tuple[float, float]) -> list[tuple[float, float]]:
    """Each shard's estimated (forward, backward) seconds per microbatch, shard ``i`` holding units
    ``bounds[i] .. bounds[i+1] - 1``; the loss runs on the last shard after its forward."""
    estimates = []
    for start, stop in zip(bounds, bounds[1:]):
        forward = sum(unit_forward_s[start:stop])
        estimates.append((forward, forward * BACKWARD_FLOPS_FACTOR))
    forward, backward = estimates[-1]
    estimates[-1] = (forward + loss_s[0], backward + loss_s[1])
    return estimates


def partition_shards(options: ShardingSettings, reports: list[ShardReport], num_stages: int,
                     num_microbatches: int) -> list[int]:
    """Stage boundaries over the shards (``options.partition_method``), as :func:`plan_pipeline` makes them."""
    method, count = options.partition_method, len(reports)
    if num_stages > count:
        raise part.PartitionError(
            f"only {count} shards for pp={num_stages} stages: raise shard_count, use split_method=layer_split "
            "with more split points, or lower parallel.pp")
    if method == "uniform":
        return part.uniform_boundaries(count, num_stages)
    if method == "uniform_floor":
        return part.uniform_floor_boundaries(count, num_stages)
    if method == "parameters":
        return part.parameter_boundaries([r.num_parameters for r in reports], num_stages)
    if method == "custom":
        if options.custom_partition is None:
            raise part.PartitionError("partition_method=custom needs custom_partition (pp+1 shard boundaries)")
        return part.check_custom_boundaries(list(options.custom_partition), count, num_stages)
    if method == "autopipe":
        if num_stages == 1:
            return [0, count]
        if options.autopipe_costs in ("estimate", "calibrated"):
            forward = [float(r.estimated_forward_s) for r in reports]
            backward = [float(r.estimated_backward_s) for r in reports]
        else:
            if options.autopipe_costs == "time":
                forward = [float(r.forward_seconds) for r in reports]
            else:
                forward = [float(r.forward_flops) for r in reports]
            backward = [f * BACKWARD_FLOPS_FACTOR for f in forward]
        boundaries = autopipe_boundaries(forward, backward, num_stages, num_microbatches)
        boundaries = balance_other_stages(forward, backward, boundaries, num_microbatches)
        return cheapen_boundaries(forward, backward, [r.output_bytes for r in reports], boundaries,
                                  num_microbatches)
    raise part.PartitionError(f"partition_method={method!r} is unknown; choose one of "
                              f"{', '.join(PARTITION_METHODS)}")


def plan_pipeline(model: nn.Module, example_inputs: Mapping[str, torch.Tensor], *, num_stages: int,
                  num_microbatches: int, sharding: ShardingSettings = ShardingSettings(),
                  input_names: Sequence[str] | None = None, machine_rates: MachineRates | None = None,
                  device_type: str | None = None) -> PipelinePlan:
    """Capture ``model``, cut it into shards and partition the shards into ``num_stages`` stages.

    ``sharding`` is the sharding section of the config (its ``custom_split_points`` and ``leaf_modules``
    already holding the recipe's defaults, see RecipeSpec.sharding). Estimated costs are priced on
    ``machine_rates``, else on the nominal rates of ``device_type`` (None: the CPU's), or with
    ``autopipe_costs=calibrated`` on rates measured here.

    Raises:
        merak.trace.capture.TraceError: the model cannot be captured.
        merak.shard.split.ShardingError / merak.core.partition.PartitionError: impossible splits.
    """
    if has_meta_parameters(model):  # a weightless model is captured and measured on meta inputs
        example_inputs = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in example_inputs.items()}
    captured = capture(model, example_inputs, method=sharding.trace_method, input_names=input_names,
                       leaf_modules=tuple(sharding.leaf_modules or ()))
    simplify_captured(captured.module)
    units = GraphUnits(captured)
    if not len(units):
        raise ShardingError(f"the captured graph of {type(model).__name__} has no operations to shard")
    timed = sharding.partition_method == "autopipe" and sharding.autopipe_costs == "time"
    if timed and has_meta_parameters(model):
        raise part.PartitionError("autopipe_costs=time needs real weights; a model on the meta device is "
                                  "partitioned by estimated costs (autopipe_costs=estimate)")
    if sharding.autopipe_costs not in AUTOPIPE_COSTS:
        raise part.PartitionError(f"autopipe_costs={sharding.autopipe_costs!r}; choose one of "
                                  f"{', '.join(AUTOPIPE_COSTS)}")
    inputs = {name: example_inputs[name] for name in captured.input_names}
    costs = _unit_costs(units, inputs)
    rates = machine_rates
    if rates is None:
        rates = calibrate() if needs_calibration(sharding) else nominal_rates(device_type or "cpu")
    unit_seconds = unit_step_seconds(costs.forward_seconds(rates), costs.loss_seconds(rates))
    shard_count = sharding.shard_count or default_shard_count(model)
    cuts = split_units(units, method=sharding.split_method, shard_count=shard_count,
                       split_points=tuple(sharding.custom_split_points or ()),
                       module_names=[n for n, _ in model.named_modules()],
                       unit_costs=unit_seconds, cut_bytes=units.crossing_bytes(costs.value_bytes),
                       num_stages=num_stages)
    shards = shard_modules(units, cuts)
    reports = _reports(shards, units, cuts, costs, rates)
    if timed:
        for report, seconds in zip(reports, _time_shards(shards, captured.module, inputs)):
            report.forward_seconds = seconds
    boundaries = partition_shards(sharding, reports, num_stages, num_microbatches)
    logger.info("%d shards (%s, %s), stage boundaries %s (%s)", len(shards), captured.method,
                sharding.split_method, boundaries, sharding.partition_method)
    return PipelinePlan(shards=shards, reports=reports, boundaries=boundaries, trace_method=captured.method,
                        split_method=sharding.split_method, partition_method=sharding.partition_method,
                        notes=list(captured.notes), num_microbatches=num_microbatches,
                        shard_starts=[0, *cuts, len(units)])


def _unit_costs(units: GraphUnits, inputs: Mapping[str, torch.Tensor]) -> UnitCosts:
    """measure_units, once per captured model in a run (merak.trace.reuse): a graph rebuilt from the run's
    first capture, simplified alike, has the same nodes by name."""
    captured = units.captured

    def measure() -> UnitCosts:
        costs = measure_units(units, inputs)
        return replace(costs, value_bytes={node.name: v for node, v in costs.value_bytes.items()},
                       descriptions={node.name: d for node, d in costs.descriptions.items()})

    named = reuse.counted_once_for(captured.key and f"unit costs of {captured.key}", measure)
    nodes = {node.name: node for node in captured.module.graph.nodes}
    if not named.value_bytes.keys() <= nodes.keys() or len(named.flops) != len(units):  # not the same graph
        return measure_units(units, inputs)
    return replace(named, flops=list(named.flops), bytes_moved=list(named.bytes_moved), ops=list(named.ops),
                   made_bytes=list(named.made_bytes), weight_bytes=list(named.weight_bytes),
                   value_bytes={nodes[name]: v for name, v in named.value_bytes.items()},
                   descriptions={nodes[name]: d for name, d in named.descriptions.items()})


def unit_step_seconds(unit_forward_s: Sequence[float], loss_s: tuple[float, float]) -> list[float]:
    """Each unit's estimated forward + backward seconds (the loss's on the last unit): what min_bytes balances."""
    seconds = [f * (1 + BACKWARD_FLOPS_FACTOR) for f in unit_forward_s]
    seconds[-1] += sum(loss_s)
    return seconds


def stage_unit_bounds(options: ShardingSettings, *, unit_forward_s: Sequence[float], loss_s: tuple[float, float],
                      cut_bytes: Sequence[int], unit_params: Sequence[int], unit_flops: Sequence[int],
                      num_stages: int, num_microbatches: int) -> list[int]:
    """The units where :func:`plan_pipeline`'s stages start (and the unit count), from per-unit numbers alone:
    what a run with ``options`` cuts, for a planner pricing it without capturing the model again.

    Only ``split_method=min_bytes`` (the default) needs nothing but these numbers; the other split methods
    read the graph itself (ValueError). ``autopipe_costs=time`` is priced as ``estimate`` (nothing is timed).

    Raises:
        ShardingError / PartitionError: the model cannot be cut into ``num_stages`` stages.
    """
    if options.split_method != "min_bytes":
        raise ValueError(f"split_method={options.split_method!r} reads the captured graph; only min_bytes cuts "
                         "from per-unit numbers")
    count = len(unit_forward_s)
    cuts = min_bytes(unit_step_seconds(unit_forward_s, loss_s), cut_bytes, num_stages)
    bounds = [0, *cuts, count]
    estimates = shard_estimates(unit_forward_s, bounds, loss_s)
    reports = [ShardReport(modules=[], num_parameters=sum(unit_params[start:stop]),
                           forward_flops=sum(unit_flops[start:stop]), outputs={},
                           output_bytes=cut_bytes[stop] if stop < count else 0,
                           estimated_forward_s=forward, estimated_backward_s=backward)
               for (start, stop), (forward, backward) in zip(zip(bounds, bounds[1:]), estimates)]
    if options.autopipe_costs == "time":
        options = replace(options, autopipe_costs="estimate")
    boundaries = partition_shards(options, reports, num_stages, num_microbatches)
    return [bounds[b] for b in boundaries]
