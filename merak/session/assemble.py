"""Build the model and the pipeline stages of one worker.

Three ways to get stages, chosen by ``trace_method``:

- ``'fx'`` / ``'dynamo'``: capture the unmodified model, shard and partition it
  automatically (merak.shard.plan);
- ``None`` with hand-made stages: the caller's ``build_stages(model, pp)``;
- ``None`` with one stage: the whole model, called with the microbatch's inputs.

Models too large to build on every worker (``init_device='meta'``, or
``'auto'`` above ``META_THRESHOLD_PARAMS``) are built on the meta device,
planned without weights, and only this worker's stage is materialized.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from merak.distributed import groups
from merak.pipeline.stage import StageModule
from merak.shard.costs import MachineRates, calibrate, whole_model_flops
from merak.shard.plan import PipelinePlan, needs_calibration, plan_pipeline
from merak.shard.settings import ShardingSettings
from merak.tensor_parallel.options import TensorParallelSplit, split_model
from merak.tensor_parallel.overlap import SubPipelinedStage, batch_size, halve
from merak.tensor_parallel.plan import ResolvedPlan
from merak.trace import reuse
from merak.trace.capture import forward_parameter_names
from merak.trace.meta import InitFn, default_init, materialize, parameters_on_meta

logger = logging.getLogger(__name__)

# Above this many parameters (4 GB in fp32) 'auto' builds on the meta device. The rule depends on the
# model only, never on the layout, so every layout of a model initializes it the same way.
META_THRESHOLD_PARAMS = 1_000_000_000


@dataclass
class Assembled:
    """A worker's model (possibly mostly on meta), all stages, and the plan when one was made."""

    model: nn.Module
    stages: list[nn.Module]
    plan: PipelinePlan | None
    on_meta: bool
    tp_plan: ResolvedPlan | None = None
    # Forward FLOPs of one microbatch through the whole unsliced model (tp > 1: counted before slicing).
    forward_flops: int | None = None


class CallModel(nn.Module):
    """The whole model as one stage: ``model(**inputs)`` with the named microbatch fields."""

    def __init__(self, model: nn.Module, input_names: Sequence[str]) -> None:
        super().__init__()
        self.model = model
        self.input_names = list(input_names)

    def forward(self, batch):
        return self.model(**{name: batch[name] for name in self.input_names})


def build_model(build: Callable[[], nn.Module], *, seed: int, init_device: str) -> tuple[nn.Module, bool]:
    """Build the model with ``seed``; returns (model, on_meta).

    ``'auto'`` first builds on meta (no memory) to count parameters, then
    rebuilds for real when the model is small enough.
    """
    if init_device in ("auto", "meta"):
        torch.manual_seed(seed)
        with parameters_on_meta():
            model = build()
        count = sum(p.numel() for p in model.parameters())
        if init_device == "meta" or count > META_THRESHOLD_PARAMS:
            logger.info("built %s on the meta device (%s parameters)", type(model).__name__, f"{count:,}")
            return model, True
        del model
    torch.manual_seed(seed)
    return build(), False


def default_input_names(model: nn.Module, example: Mapping[str, torch.Tensor]) -> list[str]:
    """The microbatch fields the model's forward accepts, labels excluded (the loss is merak's)."""
    accepted = set(forward_parameter_names(model))
    names = [k for k in example if k in accepted and k not in ("labels", "label")]
    if not names:
        raise ValueError(f"none of the microbatch fields {sorted(example)} is an argument of "
                         f"{type(model).__name__}.forward; set input_names")
    return names


def shared_machine_rates(device: torch.device, dtype: torch.dtype) -> MachineRates:
    """Machine rates (``merak.shard.costs.calibrate``) that every rank agrees on: measured by rank 0
    and sent to the others, so that all ranks cut the model alike."""
    if not dist.is_initialized():
        return calibrate(device, dtype)
    return groups.broadcast_object(calibrate(device, dtype) if dist.get_rank() == 0 else None)


def assemble(*, build: Callable[[], nn.Module], seed: int, init_device: str, sharding: ShardingSettings,
             num_stages: int, num_microbatches: int, stage_id: int | Sequence[int], device: torch.device,
             example_inputs: Mapping[str, torch.Tensor],
             build_stages: Callable[[nn.Module, int], Sequence[nn.Module]] | None = None,
             init: InitFn = default_init, materialize_stage: bool = True,
             tensor_parallel: TensorParallelSplit = TensorParallelSplit(),
             dtype: torch.dtype = torch.float32, input_names: Sequence[str] | None = None,
             machine_rates: MachineRates | None = None, device_type: str | None = None) -> Assembled:
    """The model and every stage for the worker running ``stage_id``.

    Args:
        build: builds the plain model (called after seeding).
        seed: the run seed (weights are identical on every rank and layout).
        init_device: ``'auto'``, ``'cpu'`` or ``'meta'``.
        sharding: the sharding section (capture, split, partition), the recipe's split points and leaf
            modules already in it (RecipeSpec.sharding); ``trace_method=None`` disables capture.
        stage_id: the piece this worker runs, or several (interleaved schedules: ``s, s + pp, ...``).
        example_inputs: one microbatch-shaped input dict (graphs are specialized to its shapes).
        build_stages: hand-made stages for ``trace_method=None`` and several stages.
        init: initializes one module of a meta-built model.
        materialize_stage: False only for planning (dry run): weights stay on meta.
        tensor_parallel: this worker's tensor-parallel settings; the model is split
            before capture, so graphs and stages have the rank-local shapes.
        dtype: the parameter dtype (fp16/bf16 runs). The model is cast before capture,
            because torch.export writes the dtypes it saw into the graph.
        input_names: the forward arguments fed from the data (None: the model's own that the example has).
        machine_rates / device_type: what estimated shard costs are priced on (merak.shard.plan.plan_pipeline;
            None: the nominal rates of ``device``'s kind).
    """
    model, on_meta = build_model(build, seed=seed, init_device=init_device)
    model.train()
    # Counted before slicing (the stages' own counts would include replicated layers once per tp rank),
    # for the run summary. Planning alone has no use for it, except in a run (a launcher planning for
    # the workers it forks: they find it counted).
    whole_flops = None
    if tensor_parallel.size > 1 and (materialize_stage or reuse.active()):
        whole_flops = reuse.counted_once("forward FLOPs", model, example_inputs,
                                         lambda: whole_model_flops(model, example_inputs))
    tp_plan = split_model(model, tensor_parallel)
    if dtype != torch.float32:
        model.to(dtype)
        example_inputs = {name: value.to(dtype) if value.is_floating_point() else value
                          for name, value in example_inputs.items()}
    sub_pipelined = tensor_parallel.size > 1 and tensor_parallel.settings.tp_overlapping_level == 2
    if sub_pipelined:  # stages run on half microbatches (merak.tensor_parallel.overlap)
        example_inputs = halve(dict(example_inputs), batch_size(example_inputs))[0]
    input_names = list(input_names or default_input_names(model, example_inputs))
    plan = None
    if sharding.trace_method is None:
        if build_stages is not None:
            stages = list(build_stages(model, num_stages))
        elif num_stages == 1:
            stages = [StageModule([CallModel(model, input_names)])]
        else:
            raise ValueError("trace_method=None needs build_stages for more than one pipeline stage")
    else:
        examples = {name: example_inputs[name] for name in input_names}
        if num_stages > 1 and needs_calibration(sharding, machine_rates):
            machine_rates = shared_machine_rates(device, dtype)
        plan = plan_pipeline(model, examples, num_stages=num_stages, num_microbatches=num_microbatches,
                             sharding=sharding, input_names=input_names, machine_rates=machine_rates,
                             device_type=device_type or torch.device(device).type)
        stages = plan.stages()
    if sub_pipelined:
        stages = [SubPipelinedStage(stage) for stage in stages]
    if on_meta and materialize_stage:
        local = (stage_id,) if isinstance(stage_id, int) else tuple(stage_id)
        params = [p for s in local for p in stages[s].parameters()]
        count = materialize(model, params, seed=seed, device=device, init=init, also_in=stages)
        logger.info("materialized stage %s: %s parameters", ",".join(map(str, local)), f"{count:,}")
    if whole_flops is None and plan is not None and tensor_parallel.size == 1:
        whole_flops = plan.forward_flops
    return Assembled(model=model, stages=stages, plan=plan, on_meta=on_meta, tp_plan=tp_plan,
                     forward_flops=whole_flops or None)
