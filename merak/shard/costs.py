"""What each unit of a captured graph costs, and what each value weighs.

One run of the captured graph (on meta or fake tensors: no kernel runs, so a
giant model costs nothing) records per unit the matrix FLOPs
(``torch.utils.flop_counter``), the bytes its operations read and write, and
how many operations it launches, and per value the bytes of its tensors (what
a stage boundary before it would send).

A unit's forward time is estimated as ``flops / F + bytes / B + ops * c``
(matrix work, memory traffic, per-operation host overhead), its backward as
``backward_factor`` times that: a softmax over a 50 k vocabulary, an embedding
lookup or a loss, which a FLOP count calls free, weigh what they cost, and a
tiny model whose time is mostly Python overhead is balanced by its operation
counts. ``F``, ``B`` and ``c`` (:class:`MachineRates`) are nominal rates of the
device kind (:func:`nominal_rates`; the same plan on every run, so a resumed
run cuts the model as the first did) or come from a short timed run on the
machine (:func:`calibrate`, ``autopipe_costs=calibrated``).
"""

from __future__ import annotations

import contextlib
import logging
import operator
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from merak.compat.flops import flop_counter
from merak.core.group_registry import simulated_groups
from merak.shard.graph import GraphUnits
from merak.trace.meta import buffers_on_meta, has_meta_parameters

logger = logging.getLogger(__name__)

# Operations that return a view or metadata: no kernel runs, no memory moves.
_VIEW_NAMES = {"view", "reshape", "_reshape_alias", "_unsafe_view", "transpose", "permute", "expand", "unsqueeze",
               "squeeze", "flatten", "unflatten", "split", "split_with_sizes", "chunk", "t", "getitem", "size",
               "dim", "contiguous", "narrow", "select", "slice", "unbind", "detach", "alias", "view_as",
               "expand_as", "as_strided", "numel", "stride", "sym_size"}
# A cross-entropy loss reads the logits a few times (max, exp-sum, gather) and writes a gradient as large.
LOSS_PASSES_FORWARD = 3
LOSS_PASSES_BACKWARD = 3
LOSS_OPS = 8


@dataclass(frozen=True)
class MachineRates:
    """How fast the machine does matrix work, memory traffic and operation launches."""

    flops_per_s: float
    bytes_per_s: float
    seconds_per_op: float

    def seconds(self, flops: float, bytes_moved: float, ops: float) -> float:
        return flops / self.flops_per_s + bytes_moved / self.bytes_per_s + ops * self.seconds_per_op


# Nominal rates per device kind: one core of the 2-core test machine (AMD EPYC, measured with calibrate(),
# medians of several runs) and an H100 (dense bf16 matrix work and HBM3 as reached in practice, with the
# host's launch overhead per operation). Modelling choices, not promises: only their ratios move a plan.
NOMINAL_RATES = {
    "cpu": MachineRates(flops_per_s=4.5e10, bytes_per_s=1.5e10, seconds_per_op=2e-6),
    "cuda": MachineRates(flops_per_s=6e14, bytes_per_s=2.5e12, seconds_per_op=8e-6),
}


def nominal_rates(device: torch.device | str = "cpu") -> MachineRates:
    """The :data:`NOMINAL_RATES` of ``device``'s kind (CPU rates for any kind not listed)."""
    return NOMINAL_RATES.get(torch.device(device).type, NOMINAL_RATES["cpu"])


def _best_of(function, repeats: int, synchronize) -> float:
    best = float("inf")
    for _ in range(repeats):
        synchronize()
        started = time.perf_counter()
        function()
        synchronize()
        best = min(best, time.perf_counter() - started)
    return best


def calibrate(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> MachineRates:
    """Measure :class:`MachineRates` on ``device`` with the current thread count (about 0.3 s).

    Each rate is the best of a few runs: a 512 x 1024 x 1024 matrix product, an addition of two
    4 M-element tensors, and a tiny addition (launch overhead).
    """
    device = torch.device(device)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a = torch.randn(512, 1024, device=device, dtype=dtype)
    b = torch.randn(1024, 1024, device=device, dtype=dtype)
    matmul = _best_of(lambda: torch.mm(a, b), 5, synchronize)
    x = torch.randn(4 << 20, device=device, dtype=dtype)
    y = torch.randn(4 << 20, device=device, dtype=dtype)
    add = _best_of(lambda: torch.add(x, y), 5, synchronize)
    tiny = torch.ones(1, device=device, dtype=dtype)
    count = 200
    launch = _best_of(lambda: [torch.add(tiny, tiny) for _ in range(count)], 3, synchronize) / count
    moved = 3 * x.numel() * x.element_size()
    rates = MachineRates(flops_per_s=2 * 512 * 1024 * 1024 / max(matmul, 1e-9),
                         bytes_per_s=moved / max(add - launch, 1e-9), seconds_per_op=launch)
    logger.debug("machine rates on %s: %.3g FLOP/s, %.3g B/s, %.2g s per operation", device,
                 rates.flops_per_s, rates.bytes_per_s, rates.seconds_per_op)
    return rates


def _tensor_bytes(value) -> int:
    return sum(leaf.numel() * leaf.element_size() for leaf in pytree.tree_leaves(value)
               if isinstance(leaf, torch.Tensor))


def describe(value) -> str:
    """``float32[4, 128, 768]`` for a tensor, else a short repr (tensors inside shown the same way)."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}[{', '.join(str(d) for d in value.shape)}]"
    return repr(pytree.tree_map_only(torch.Tensor, describe, value))[:60]


def _operation_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "__name__", str(target))


def launches_kernel(node: fx.Node) -> bool:
    """Whether ``node`` runs work (not a view, a shape query or a getitem)."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return False
    if node.op == "call_module":
        return True
    name = _operation_name(node)
    return name not in _VIEW_NAMES and name.strip("_") not in _VIEW_NAMES


@dataclass
class UnitCosts:
    """Per unit: forward matrix FLOPs, bytes read and written, operations, bytes of the tensors it
    makes; per value: its bytes and a description (``float32[4, 128, 768]``). ``weight_bytes`` is the
    part of ``bytes_moved`` read from weights and buffers: what a larger microbatch does not grow."""

    flops: list[int]
    bytes_moved: list[int]
    ops: list[int]
    made_bytes: list[int]
    value_bytes: dict[fx.Node, int]
    descriptions: dict[fx.Node, str]
    output_bytes: int  # the largest floating-point output tensor (what a loss reads)
    weight_bytes: list[int] = field(default_factory=list)

    def forward_seconds(self, rates: MachineRates) -> list[float]:
        return [rates.seconds(f, b, o) for f, b, o in zip(self.flops, self.bytes_moved, self.ops)]

    def loss_seconds(self, rates: MachineRates) -> tuple[float, float]:
        """Estimated forward and backward time of a loss over the model's output."""
        return loss_seconds(rates, self.output_bytes)


def loss_seconds(rates: MachineRates, output_bytes: float) -> tuple[float, float]:
    """Estimated forward and backward time of a loss reading ``output_bytes`` of logits."""
    return (rates.seconds(0, LOSS_PASSES_FORWARD * output_bytes, LOSS_OPS),
            rates.seconds(0, LOSS_PASSES_BACKWARD * output_bytes, LOSS_OPS))


class _Recorder(fx.Interpreter):
    def __init__(self, module: fx.GraphModule, units: GraphUnits, counter: FlopCounterMode) -> None:
        super().__init__(module)
        self.units, self.counter = units, counter
        count = len(units)
        self.costs = UnitCosts([0] * count, [0] * count, [0] * count, [0] * count, {}, {}, 0, [0] * count)

    def run_node(self, node: fx.Node):
        before = self.counter.get_total_flops()
        result = super().run_node(node)
        size = _tensor_bytes(result)
        self.costs.value_bytes[node] = size
        self.costs.descriptions[node] = describe(result)
        unit = self.units.unit_of.get(node)
        if unit is not None and launches_kernel(node):
            self.costs.flops[unit] += self.counter.get_total_flops() - before
            read = sum(self.costs.value_bytes.get(arg, 0) for arg in node.all_input_nodes
                       if arg.op != "get_attr")
            # A lookup reads the rows it returns, not the whole table.
            weights = 0 if _operation_name(node) == "embedding" else _attribute_bytes(self.module, node)
            read += size if _operation_name(node) == "embedding" else weights
            self.costs.bytes_moved[unit] += read + size
            self.costs.weight_bytes[unit] += weights
            self.costs.made_bytes[unit] += size
            self.costs.ops[unit] += 1
        if node.op == "output":
            floating = [leaf for leaf in pytree.tree_leaves(result)
                        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()]
            self.costs.output_bytes = max((_tensor_bytes(t) for t in floating), default=0)
        return result


def _attribute_bytes(module: fx.GraphModule, node: fx.Node) -> int:
    """Bytes of the weights and buffers ``node`` reads."""
    held = 0
    if node.op == "call_module":
        held = sum(_tensor_bytes(t) for t in module.get_submodule(str(node.target)).state_dict().values())
    return held + sum(_tensor_bytes(operator.attrgetter(str(arg.target))(module))
               for arg in node.all_input_nodes if arg.op == "get_attr")


def measure_units(units: GraphUnits, example_inputs: Mapping[str, torch.Tensor]) -> UnitCosts:
    """Run the captured graph once (no gradients) and record :class:`UnitCosts`.

    Nothing recorded depends on tensor values (FLOPs, bytes, operation counts), so the run uses no real
    kernels: a model with meta parameters runs on meta tensors, a real one on fake tensors (its weights
    untouched; a whole model's forward on the CPU would take a minute for a GPT-2). A graph that fake
    tensors cannot run (a data-dependent shape, say) runs for real, and its buffers (batch-norm
    statistics) are restored afterwards.
    """
    captured = units.captured
    module = captured.module
    inputs = [example_inputs[name] for name in captured.input_names]
    saved = {name: b.clone() for name, b in module.named_buffers() if b.device.type != "meta"}
    try:
        if has_meta_parameters(module):
            with buffers_on_meta(module):
                return _record(module, units, inputs)
        try:
            return _record(module, units, inputs, fake=True)
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as error:
            logger.debug("unit costs not measured on fake tensors (%s); running the graph", error)
            return _record(module, units, inputs)
    finally:
        with torch.no_grad():
            for name, buffer in module.named_buffers():
                if name in saved:
                    buffer.copy_(saved[name])


def _record(module: fx.GraphModule, units: GraphUnits, inputs: list, *, fake: bool = False) -> UnitCosts:
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    with mode, torch.no_grad(), simulated_groups(), flop_counter() as counter:
        if fake:
            inputs = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs]
        recorder = _Recorder(module, units, counter)
        recorder.run(*inputs)
    return recorder.costs


def whole_model_flops(model: torch.nn.Module, inputs: Mapping[str, torch.Tensor]) -> int | None:
    """Forward FLOPs of ``model`` on one microbatch, counted on fake tensors (no kernel runs, no memory).

    Taken before tensor-parallel slicing, it is the model's own number, the same whatever the layout.
    None when the forward cannot run on fake tensors (a data-dependent branch, say)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    counter = flop_counter()
    training = model.training
    model.eval()  # no running statistics or other state updated; the same matrix products
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.no_grad():
            fake = {name: mode.from_tensor(value) if isinstance(value, torch.Tensor) else value
                    for name, value in inputs.items()}
            with counter:
                model(**fake)
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as error:
        logger.debug("model FLOPs not counted on fake tensors: %s", error)
        return None
    finally:
        model.train(training)
    return int(counter.get_total_flops())
