"""From an unmodified model to pipeline stages: capture, shard, measure, partition.

``plan_pipeline`` is the whole automatic path; it allocates nothing for a
model built on the meta device (shapes and FLOPs are measured on meta
tensors), so every rank can plan a giant model and then materialize only its
own stage (``PipelinePlan.stage_parameters``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from merak.pipeline.stage import StageModule
from merak.shard import partition as part
from merak.shard.autopipe import autopipe_boundaries
from merak.shard.build import shard_modules
from merak.shard.graph import GraphUnits
from merak.shard.split import ShardingError, split_units
from merak.trace.capture import capture
from merak.trace.simplify import simplify_captured
from merak.tensor_parallel.comm import simulated_groups
from merak.trace.meta import buffers_on_meta, has_meta_parameters

logger = logging.getLogger(__name__)

PARTITION_METHODS = ("uniform", "uniform_floor", "parameters", "custom", "autopipe")
AUTOPIPE_COSTS = ("flops", "time")
BYTES_PER_TRAINED_PARAM = 16  # fp32 weight + gradient + two Adam moments


@dataclass(frozen=True)
class ShardingOptions:
    """How to capture, shard and partition (MerakArguments names).

    ``split_points`` are the layer_split cut points: the user's
    ``custom_split_points`` or the recipe's defaults.
    """

    trace_method: str = "fx"
    split_method: str = "farthest_min_deps"
    shard_count: int | None = None
    split_points: tuple[str, ...] = ()
    partition_method: str = "uniform"
    custom_partition: tuple[int, ...] | None = None
    leaf_modules: tuple = ()
    input_names: tuple[str, ...] | None = None
    backward_flops_factor: float = 2.0
    autopipe_costs: str = "flops"  # or "time": measured forward seconds per shard (real weights only)


@dataclass
class ShardReport:
    """What one shard holds and computes."""

    modules: list[str]
    num_parameters: int
    forward_flops: int
    outputs: dict[str, str]  # crossing value -> "float32[4, 128, 64]" (or a Python value's repr)
    output_bytes: int = 0  # of the tensors in ``outputs``
    forward_seconds: float | None = None


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

    @property
    def num_stages(self) -> int:
        return len(self.boundaries) - 1

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
        """Modules, parameters, FLOPs, boundary values and memory estimate of one stage."""
        first, last = self.boundaries[stage_id], self.boundaries[stage_id + 1]
        reports = self.reports[first:last]
        params = sum(p.numel() for p in self.stage_parameters(stage_id))
        outputs = reports[-1].outputs
        activation = reports[-1].output_bytes
        in_flight = self.num_stages - stage_id  # 1F1B keeps up to this many microbatches' boundaries alive
        modules = [name for r in reports for name in r.modules]
        return {"stage": stage_id, "shards": [first, last], "modules": list(dict.fromkeys(modules)),
                "num_parameters": params, "forward_flops": sum(r.forward_flops for r in reports),
                "sends": outputs if stage_id < self.num_stages - 1 else {},
                "send_bytes": activation if stage_id < self.num_stages - 1 else 0,
                "estimated_memory_bytes": params * BYTES_PER_TRAINED_PARAM + activation * in_flight}

    def to_json(self) -> dict:
        """The plan as plain data (``partition.json``)."""
        return {"trace_method": self.trace_method, "split_method": self.split_method,
                "partition_method": self.partition_method, "num_shards": len(self.shards),
                "boundaries": self.boundaries, "notes": self.notes,
                "stages": [self.stage_summary(s) for s in range(self.num_stages)],
                "shards": [vars(r) for r in self.reports]}


def _display_name(scope: tuple[str, ...]) -> str:
    """The name that says what a unit belongs to: its numbered block (transformer.h.3,
    bert.encoder.layer.0) when it is in one, else its second-level module (transformer.wte)."""
    numbered = [name for name in scope if name.rsplit(".", 1)[-1].isdigit()]
    return numbered[0] if numbered else scope[min(1, len(scope) - 1)]


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}[{', '.join(str(d) for d in value.shape)}]"
    return repr(value)[:60]


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


def _measure(shards: Sequence[nn.Module], units: GraphUnits, cuts: Sequence[int],
             example_inputs: Mapping[str, torch.Tensor], timed: bool = False) -> list[ShardReport]:
    """Run the shards once in sequence (no grad) to count FLOPs and describe boundaries.

    A model with meta parameters runs entirely on meta tensors (nothing allocated).
    """
    module = units.captured.module
    on_meta = has_meta_parameters(module)
    buffers = {} if on_meta else {name: b.clone() for name, b in module.named_buffers()}
    bounds = [0, *cuts, len(units)]
    reports = []
    payload = dict(example_inputs)
    # Tensor-parallel collectives only keep their shapes here: ranks measure independently.
    with torch.no_grad(), simulated_groups(), (buffers_on_meta(module) if on_meta else contextlib.nullcontext()):
        for index, shard in enumerate(shards):
            seconds = _forward_seconds(shard, payload) if timed else None
            with FlopCounterMode(display=False) as counter:
                payload = shard(payload)
            scope = [_display_name(u.scope) for u in units.units[bounds[index]:bounds[index + 1]] if u.scope]
            sent = payload if isinstance(payload, dict) and index < len(shards) - 1 else {}
            reports.append(ShardReport(
                modules=list(dict.fromkeys(scope)),
                num_parameters=sum(p.numel() for p in {id(p): p for p in shard.parameters()}.values()),
                forward_flops=int(counter.get_total_flops()), forward_seconds=seconds,
                outputs={k: _describe(v) for k, v in sent.items()},
                output_bytes=sum(v.numel() * v.element_size() for v in sent.values() if isinstance(v, torch.Tensor))))
    # Measuring ran the model once in training mode; undo buffer updates (e.g. batch-norm statistics).
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            if name in buffers:
                buffer.copy_(buffers[name])
    return reports


def _partition(options: ShardingOptions, reports: list[ShardReport], num_stages: int,
               num_microbatches: int) -> list[int]:
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
        if options.autopipe_costs == "time":
            forward = [float(r.forward_seconds) for r in reports]
        else:
            forward = [float(r.forward_flops) for r in reports]
        backward = [f * options.backward_flops_factor for f in forward]
        return autopipe_boundaries(forward, backward, num_stages, num_microbatches)
    raise part.PartitionError(f"partition_method={method!r} is unknown; choose one of "
                              f"{', '.join(PARTITION_METHODS)}")


def plan_pipeline(model: nn.Module, example_inputs: Mapping[str, torch.Tensor], *, num_stages: int,
                  num_microbatches: int, options: ShardingOptions = ShardingOptions()) -> PipelinePlan:
    """Capture ``model``, cut it into shards and partition the shards into ``num_stages`` stages.

    Raises:
        merak.trace.capture.TraceError: the model cannot be captured.
        merak.shard.split.ShardingError / merak.shard.partition.PartitionError: impossible splits.
    """
    if has_meta_parameters(model):  # a weightless model is captured and measured on meta inputs
        example_inputs = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in example_inputs.items()}
    captured = capture(model, example_inputs, method=options.trace_method, input_names=options.input_names,
                       leaf_modules=options.leaf_modules)
    simplify_captured(captured.module)
    units = GraphUnits(captured)
    if not len(units):
        raise ShardingError(f"the captured graph of {type(model).__name__} has no operations to shard")
    shard_count = options.shard_count or default_shard_count(model)
    cuts = split_units(units, method=options.split_method, shard_count=shard_count,
                       split_points=options.split_points, module_names=[n for n, _ in model.named_modules()])
    shards = shard_modules(units, cuts)
    inputs = {name: example_inputs[name] for name in captured.input_names}
    timed = options.partition_method == "autopipe" and options.autopipe_costs == "time"
    if timed and has_meta_parameters(model):
        raise part.PartitionError("autopipe_costs=time needs real weights; a model on the meta device is "
                                  "partitioned by FLOPs (autopipe_costs=flops)")
    if options.autopipe_costs not in AUTOPIPE_COSTS:
        raise part.PartitionError(f"autopipe_costs={options.autopipe_costs!r}; choose one of "
                                  f"{', '.join(AUTOPIPE_COSTS)}")
    reports = _measure(shards, units, cuts, inputs, timed=timed)
    boundaries = _partition(options, reports, num_stages, num_microbatches)
    logger.info("%d shards (%s, %s), stage boundaries %s (%s)", len(shards), captured.method,
                options.split_method, boundaries, options.partition_method)
    return PipelinePlan(shards=shards, reports=reports, boundaries=boundaries, trace_method=captured.method,
                        split_method=options.split_method, partition_method=options.partition_method,
                        notes=list(captured.notes))
