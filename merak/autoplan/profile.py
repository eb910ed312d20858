"""What a model costs per unit of its captured graph, at one tensor-parallel degree.

The model is built on the meta device (no weights: a 175 B model costs nothing), split for tensor rank
0 as a worker splits it (collectives simulated), captured and run once on meta tensors. Per unit: what
:mod:`merak.shard.costs` measures for the partitioner (matrix FLOPs, bytes moved, operations,
parameters), the bytes autograd saves for backward, what selective recomputation's ``matmuls`` policy
keeps and the FLOPs it spares the recomputation, and the bytes and count of the tensor-parallel
collectives in forward and backward; per cut between units, the bytes that cross it. Everything but
parameters and operation counts grows linearly with the microbatch (:meth:`GraphProfile.scaled`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import re
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode

from merak.autoplan.attention import ATTENTION_TARGETS, attention_on
from merak.compat.flops import flop_counter
from merak.core.group_registry import simulated_groups
from merak.pipeline.selective import SHAPED_FACTORIES, matmuls_saves, output_unused_by_backward
from merak.session.assemble import build_model, default_input_names
from merak.shard.costs import measure_units
from merak.shard.graph import GraphUnits, _params_of_node
from merak.tensor_parallel.options import TensorParallelSplit, split_model, tensor_parallel_state_kept
from merak.trace.capture import capture
from merak.trace.meta import buffers_on_meta
from merak.trace.simplify import simplify_captured

logger = logging.getLogger(__name__)

# merak's tensor-parallel collectives (merak.tensor_parallel.comm) as graph nodes: what each moves, forward and back.
_ALL_REDUCE, _GATHER = "all_reduce", "gather"
_COLLECTIVES = {
    "copy_to_tp": (None, _ALL_REDUCE),
    "reduce_from_tp": (_ALL_REDUCE, None),
    "scatter_to_sequence": (None, _GATHER),
    "gather_from_sequence": (_GATHER, _GATHER),
    "reduce_scatter_sequence": (_GATHER, _GATHER),
    "gather_to_replicated": (_GATHER, None),
}
_LINEARS = ("column_linear", "row_linear")
_LAYER_INDEX = re.compile(r"\.\d+$")


@dataclass(frozen=True)
class GraphProfile:
    """Per-unit costs of one rank's model at ``micro_batch_size``: ``crossing_bytes[k]`` crosses a cut before
    unit ``k``; ``layer_starts`` are where a repeated layer (``...h.3``) begins (checkpoints, cheapest cuts)."""

    micro_batch_size: int
    tp: int
    sequence_parallel: bool
    dtype_bytes: int
    flops: tuple[int, ...]
    bytes_moved: tuple[int, ...]
    ops: tuple[int, ...]
    params: tuple[int, ...]
    saved_bytes: tuple[int, ...]
    forward_all_reduce: tuple[int, ...]
    forward_gather: tuple[int, ...]
    backward_all_reduce: tuple[int, ...]
    backward_gather: tuple[int, ...]
    crossing_bytes: tuple[int, ...]
    layer_starts: tuple[int, ...]
    output_bytes: int  # the logits a loss reads (its forward and backward read them again)
    # Parameters read by several units (tied embeddings): (elements, the units reading it); a later stage
    # reading one keeps a copy. ``params`` counts each at its first use.
    shared_params: tuple[tuple[int, tuple[int, ...]], ...] = ()
    weight_bytes: tuple[int, ...] = ()  # the part of ``bytes_moved`` read from weights and buffers
    # Per unit, the collectives making up each byte count above, each paying the ring's latency (empty: one
    # per unit that moves bytes).
    forward_all_reduce_calls: tuple[int, ...] = ()
    forward_gather_calls: tuple[int, ...] = ()
    backward_all_reduce_calls: tuple[int, ...] = ()
    backward_gather_calls: tuple[int, ...] = ()
    # Per cut, the part of ``crossing_bytes`` first saved at or after it: a stage keeps all it receives.
    received_saved_bytes: tuple[int, ...] = ()
    # Per unit, what selective recomputation's "matmuls" policy keeps of it besides the checkpointed inputs
    # (the outputs of the operators it saves, saved by autograd or not), and those operators' FLOPs, which the
    # backward does not recompute (:class:`_MatmulsPolicyRecorder`).
    selective_kept_bytes: tuple[int, ...] = ()
    selective_saved_flops: tuple[int, ...] = ()
    # Per field, the part that does not grow with the microbatch (:func:`with_fixed_parts`).
    fixed: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def __len__(self) -> int:
        return len(self.flops)

    def scaled(self, micro_batch_size: int) -> GraphProfile:
        """The profile at another microbatch size (parameters, operation counts and the weights read do not
        change)."""
        factor = micro_batch_size / self.micro_batch_size
        fixed = dict(self.fixed)
        fixed.setdefault("bytes_moved", self.weight_bytes)

        def grow(name: str) -> tuple[int, ...]:
            values = getattr(self, name)
            constant = fixed.get(name) or (0,) * len(values)
            return tuple(c + round((v - c) * factor) for v, c in zip(values, constant))

        return dataclasses.replace(
            self, micro_batch_size=micro_batch_size, **{name: grow(name) for name in SCALED_FIELDS},
            output_bytes=round(self.output_bytes * factor))

    def with_fixed_parts(self, larger: GraphProfile) -> GraphProfile:
        """This profile, knowing what does not grow with the microbatch from ``larger`` (the same graph
        captured at twice the microbatch); unchanged when the two graphs' units differ."""
        if len(larger) != len(self) or larger.micro_batch_size != 2 * self.micro_batch_size:
            return self
        fixed = []
        for name in SCALED_FIELDS:
            small, large = getattr(self, name), getattr(larger, name)
            fixed.append((name, tuple(min(max(2 * a - b, 0), a) for a, b in zip(small, large))))
        return dataclasses.replace(self, fixed=tuple(fixed))

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> GraphProfile:
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
        values["shared_params"] = tuple((numel, tuple(units)) for numel, units in values.get("shared_params", ()))
        values["fixed"] = tuple((name, tuple(parts)) for name, parts in values.get("fixed", ()))
        return cls(**values)


COLLECTIVE_FIELDS = ("forward_all_reduce", "forward_gather", "backward_all_reduce", "backward_gather")

# What grows with the microbatch (less any fixed part); parameters and operation counts do not.
SCALED_FIELDS = ("flops", "bytes_moved", "saved_bytes", "forward_all_reduce", "forward_gather", "backward_all_reduce",
                 "backward_gather", "crossing_bytes", "received_saved_bytes", "selective_kept_bytes",
                 "selective_saved_flops")


def _collective_name(node: fx.Node) -> str | None:
    if node.op != "call_function":
        return None
    name = getattr(node.target, "__name__", str(node.target))
    base = name.split(".")[0]
    return base if base in _COLLECTIVES or base in _LINEARS else None


def _tensor_bytes(value) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _argument(node: fx.Node, index: int, name: str):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


class _SavedBytesRecorder(fx.Interpreter):
    """Runs the graph with autograd on, filing what autograd saves under the unit computing it,
    and the bytes of every tensor-parallel collective."""

    def __init__(self, module: fx.GraphModule, units: GraphUnits, tp: int, device_type: str,
                 attention: str = "auto") -> None:
        super().__init__(module)
        self.units, self.tp, self.device_type, self.attention = units, tp, device_type, attention
        count = len(units)
        self.saved = [0] * count
        self.comm = {key: [0] * count for key in COLLECTIVE_FIELDS}
        self.calls = {key: [0] * count for key in COLLECTIVE_FIELDS}
        self._unit: int | None = None
        self._seen: set[int] = set()
        self._parameters = {id(p) for p in module.parameters()}
        self._keep_alive: list[torch.Tensor] = []  # ids stay unique while the run lasts
        self._made_in: dict[int, int] = {}  # a node's output storage -> the unit computing it (-1: an input)
        self._late: list[tuple[int, int, int]] = []  # (made in, first saved in, bytes) of a later unit's saves

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        base = tensor if tensor._base is None else tensor._base
        if self._unit is not None and id(base) not in self._parameters and id(base) not in self._seen:
            self._seen.add(id(base))
            self._keep_alive.append(base)
            self.saved[self._unit] += _tensor_bytes(base)
            made_in = self._made_in.get(id(base), self._unit)
            if made_in < self._unit:
                self._late.append((made_in, self._unit, _tensor_bytes(base)))
        return tensor

    def received_saved(self) -> list[int]:
        """``bytes[k]``: what crosses a cut before unit ``k`` and is first saved at or after it (index 0 unused):
        a stage starting at ``k`` keeps what it receives, so these saves are its received inputs."""
        delta = [0] * (len(self.saved) + 2)
        for made_in, saved_in, nbytes in self._late:
            delta[max(made_in + 1, 1)] += nbytes
            delta[saved_in + 1] -= nbytes
        return list(itertools.accumulate(delta[:len(self.saved) + 1]))

    def _note_outputs(self, node: fx.Node, result) -> None:
        made_in = -1 if node.op == "placeholder" else self.units.unit_of.get(node)
        if made_in is None:  # constants and buffers: every stage holds its own
            return
        for value in pytree.tree_leaves(result):
            if isinstance(value, torch.Tensor):
                base = value if value._base is None else value._base
                self._keep_alive.append(base)
                self._made_in.setdefault(id(base), made_in)

    def _add(self, key: str, nbytes: int, calls: int = 1) -> None:
        self.comm[key][self._unit] += nbytes
        self.calls[key][self._unit] += calls

    def _linear_traffic(self, name: str, node: fx.Node, result) -> None:
        """The collectives inside merak's fused tensor-parallel linears (merak.tensor_parallel.linear_ops)."""
        if name == "column_linear":
            x = self.env[node.args[0]]
            mode = _argument(node, 5, "input_comm")
            if mode == "gather":  # sequence parallel: gather the input, reduce-scatter its gradient
                full = _tensor_bytes(x) * self.tp
                self._add("forward_gather", full)
                self._add("backward_gather", 2 * full, calls=2)  # the input is gathered again for the weight
                # gradient, and its gradient reduce-scattered
            elif mode != "none":
                self._add("backward_all_reduce", _tensor_bytes(x))
        else:  # row_linear
            sequence_dim = _argument(node, 5, "sequence_dim")
            if sequence_dim is not None and sequence_dim >= 0:
                full = _tensor_bytes(result) * self.tp
                self._add("forward_gather", full)
                self._add("backward_gather", full)
            else:
                self._add("forward_all_reduce", _tensor_bytes(result))

    def call_function(self, target, args, kwargs):
        if target in ATTENTION_TARGETS:  # as the run's device computes it, not as meta does
            return attention_on(self.device_type, *args, kernel=self.attention, **kwargs)
        return super().call_function(target, args, kwargs)

    def run_node(self, node: fx.Node):
        self._unit = self.units.unit_of.get(node)
        result = super().run_node(node)
        self._note_outputs(node, result)
        name = _collective_name(node)
        if name is None or self._unit is None or self.tp == 1:
            return result
        if name in _LINEARS:
            self._linear_traffic(name, node, result)
            return result
        forward, backward = _COLLECTIVES[name]
        source = self.env.get(node.args[0]) if node.args and isinstance(node.args[0], fx.Node) else None
        size = max(_tensor_bytes(result), _tensor_bytes(source))
        if forward:
            self._add(f"forward_{forward}", size)
        if backward:
            self._add(f"backward_{backward}", size)
        return result


_UNSAFE_VIEW = torch.ops.aten._unsafe_view
_READ_NO_VALUES = SHAPED_FACTORIES | {_UNSAFE_VIEW}


class _MatmulsPolicyRecorder(TorchDispatchMode):
    """Per unit, what selective recomputation's ``matmuls`` policy keeps of the forward, decided operator by
    operator as the run decides (:func:`merak.pipeline.selective.matmuls_saves`): the outputs of the operators
    it saves, except an output that no later operator reads of an operator whose backward does not read it
    (a language model head's logits); and the FLOPs of the operators it saves, which the recomputation does
    not run again. The meta run has no storage to compare, so tensors are followed by identity through views.

    What the policy does not see as one matrix product is recomputed: merak's tensor-parallel linears are
    single operators (``merak::column_linear``), and attention with dropout draws random numbers."""

    def __init__(self, current_unit, count: int) -> None:
        super().__init__()
        self._current_unit = current_unit
        self.flops = [0] * count
        self._entries: list[list] = []  # [unit, bytes, droppable, read]
        self._readers: dict[int, list[list]] = {}  # root tensor id -> the entries of its outputs
        self._root: dict[int, int] = {}  # a view's id -> the id of the tensor it views
        self._alive: list[torch.Tensor] = []  # ids stay unique while the run lasts
        self._formulas = flop_counter().flop_registry

    def kept_bytes(self) -> list[int]:
        kept = [0] * len(self.flops)
        for unit, nbytes, droppable, read in self._entries:
            if read or not droppable:
                kept[unit] += nbytes
        return kept

    def _root_of(self, tensor: torch.Tensor) -> int:
        return self._root.get(id(tensor), id(tensor))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        outputs = [leaf for leaf in pytree.tree_leaves(out) if isinstance(leaf, torch.Tensor)]
        packet = getattr(func, "_overloadpacket", None)
        if getattr(func, "is_view", False) or packet is _UNSAFE_VIEW:
            if inputs:
                for tensor in outputs:
                    self._alive.append(tensor)
                    self._root[id(tensor)] = self._root_of(inputs[0])
            return out
        if packet not in _READ_NO_VALUES:
            for tensor in inputs:
                for entry in self._readers.get(self._root_of(tensor), ()):
                    entry[3] = True
        unit = self._current_unit()
        if unit is not None and outputs and matmuls_saves(func, args, kwargs):
            entry = [unit, sum(_tensor_bytes(t) for t in outputs), output_unused_by_backward(func), False]
            self._entries.append(entry)
            for tensor in outputs:
                self._alive.append(tensor)
                self._readers.setdefault(id(tensor), []).append(entry)
            formula = self._formulas.get(packet)
            self.flops[unit] += formula(*args, **kwargs, out_val=out) if formula is not None else 0
        return out


def _layer_key(scope: tuple[str, ...]) -> str | None:
    """The repeated layer a unit belongs to (``transformer.h.3``), if any."""
    return next((name for name in scope if _LAYER_INDEX.search(name)), None)


def _layer_starts(units: GraphUnits) -> tuple[int, ...]:
    starts, previous = [], None
    for index, unit in enumerate(units.units):
        key = _layer_key(unit.scope)
        if key is not None and key != previous:
            starts.append(index)
        previous = key if key is not None else previous
    return tuple(starts)


def _shared_params(units: GraphUnits) -> tuple[tuple[int, tuple[int, ...]], ...]:
    readers: dict[int, tuple[int, set[int]]] = {}
    for index, unit in enumerate(units.units):
        for node in unit.nodes:
            for param in _params_of_node(node, units.captured.module):
                readers.setdefault(id(param), (param.numel(), set()))[1].add(index)
    return tuple((numel, tuple(sorted(found))) for numel, found in readers.values() if len(found) > 1)


def profile_graph(model: torch.nn.Module, example_inputs: dict[str, torch.Tensor], *, trace_method: str,
                  input_names=None, leaf_modules=(), tp: int = 1, sequence_parallel: bool = False,
                  device_type: str = "cpu", attention: str = "auto") -> GraphProfile:
    """Capture ``model`` (already split for tensor rank 0, weights on meta) and measure it; what autograd saves
    as on ``device_type`` (its attention kernels save different tensors), or with the attention kernel
    ``attention`` names (:data:`merak.autoplan.attention.KERNELS`)."""
    example_inputs = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in example_inputs.items()}
    names = list(input_names or default_input_names(model, example_inputs))
    captured = capture(model, {n: example_inputs[n] for n in names}, method=trace_method, input_names=names,
                       leaf_modules=tuple(leaf_modules))
    simplify_captured(captured.module)
    units = GraphUnits(captured)
    inputs = {name: example_inputs[name] for name in captured.input_names}
    costs = measure_units(units, inputs)
    recorder = _SavedBytesRecorder(captured.module, units, tp, device_type, attention)
    policy = _MatmulsPolicyRecorder(lambda: recorder._unit, len(units))
    with simulated_groups(), buffers_on_meta(captured.module), \
            torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda tensor: tensor), policy:
        recorder.run(*[inputs[name] for name in captured.input_names])
    dtype_bytes = next((p.element_size() for p in model.parameters() if p.is_floating_point()), 4)
    micro_batch = next(v.shape[0] for v in inputs.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return GraphProfile(
        micro_batch_size=int(micro_batch), tp=tp, sequence_parallel=sequence_parallel, dtype_bytes=dtype_bytes,
        flops=tuple(costs.flops), bytes_moved=tuple(costs.bytes_moved), ops=tuple(costs.ops),
        params=tuple(units.unit_params), saved_bytes=tuple(recorder.saved),
        **{key: tuple(values) for key, values in recorder.comm.items()},
        **{f"{key}_calls": tuple(values) for key, values in recorder.calls.items()},
        crossing_bytes=tuple(units.crossing_bytes(costs.value_bytes)), layer_starts=_layer_starts(units),
        received_saved_bytes=tuple(recorder.received_saved()),
        selective_kept_bytes=tuple(policy.kept_bytes()), selective_saved_flops=tuple(policy.flops),
        output_bytes=costs.output_bytes, shared_params=_shared_params(units), weight_bytes=tuple(costs.weight_bytes))


def profile_recipe(spec, settings, *, tp: int, sequence_parallel: bool, micro_batch_size: int = 1,
                   device_type: str = "cpu", attention: str = "auto") -> GraphProfile:
    """The profile of ``spec``'s model as the run builds it at tensor degree ``tp`` for ``device_type`` (its
    attention kernel as ``attention`` says: :func:`profile_graph`), with what does not grow with the microbatch
    from a second capture at twice ``micro_batch_size``."""
    with tensor_parallel_state_kept():
        profile = _profile_at(spec, settings, tp=tp, sequence_parallel=sequence_parallel,
                              micro_batch_size=micro_batch_size, device_type=device_type, attention=attention)
        larger = _profile_at(spec, settings, tp=tp, sequence_parallel=sequence_parallel,
                             micro_batch_size=2 * micro_batch_size, device_type=device_type, attention=attention)
    return profile.with_fixed_parts(larger)


def _profile_at(spec, settings, *, tp: int, sequence_parallel: bool, micro_batch_size: int,
                device_type: str, attention: str = "auto") -> GraphProfile:
    from merak.session.training import example_inputs

    trainer = settings.trainer
    model, _ = build_model(functools.partial(spec.build_model, settings.model_cfg), seed=trainer.batch.seed,
                           init_device="meta")
    model.train()
    tp_settings = dataclasses.replace(trainer.tensor_parallel, sequence_parallel=sequence_parallel,
                                      tp_overlapping_level=0)
    split_model(model, TensorParallelSplit(spec.tensor_parallel_plan(settings.model_cfg), tp, settings=tp_settings))
    dtype = trainer.precision.dtype
    if dtype != torch.float32:
        model.to(dtype)
    at_this_size = trainer.replace(per_device_train_batch_size=micro_batch_size)
    batch_settings = dataclasses.replace(settings, trainer=at_this_size)
    examples = example_inputs(spec, batch_settings, None if spec.example_inputs is not None else
                              spec.prepare_data(settings.data_cfg, settings.model_cfg))
    if dtype != torch.float32:
        examples = {k: v.to(dtype) if v.is_floating_point() else v for k, v in examples.items()}
    sharding = spec.sharding(trainer.sharding)
    return profile_graph(model, examples, trace_method=sharding.trace_method or "fx", tp=tp,
                         input_names=trainer.batch.input_names or spec.input_names, leaf_modules=sharding.leaf_modules,
                         sequence_parallel=sequence_parallel, device_type=device_type, attention=attention)
