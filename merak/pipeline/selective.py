"""Selective activation recomputation: what a checkpointed part keeps, operator by operator.

With ``trainer.activation_checkpointing=selective`` the checkpointed parts of a stage still run under
``torch.utils.checkpoint`` (non-reentrant), but with a policy made by torch's
``create_selective_checkpoint_contexts``: the output of each aten operator of the forward is either
saved (``MUST_SAVE``) or recomputed in the backward (``PREFER_RECOMPUTE``). ``selective_recompute``
names what is saved:

- ``matmuls``: the outputs of matrix products (mm, addmm, bmm, baddbmm; ``linear`` and ``matmul``
  reach the dispatcher as these; with tensor parallelism merak's own linear layers, whose collective is
  then not run again either) and of fused attention (the scaled-dot-product kernels). The cheap
  operators around them (layer norms, activations, residual adds, softmax, masks) are recomputed,
  so the backward runs no matrix product twice (Megatron-LM's and torchtitan's selective policy).
- ``attention``: everything except the attention core. The core starts at a product of two
  activations (``q @ k^T``: neither operand is a parameter) and runs through whatever reads its
  result (scaling, mask, softmax, attention dropout) up to the next matrix product (``p @ v``), whose
  output is saved again; a fused attention kernel is recomputed whole. The ``[b, h, s, s]`` scores
  and probabilities are what is dropped (Megatron-LM's "core attention" recomputation). Elementwise
  operators of a single tensor (scalings, the steps of an activation function) are recomputed too:
  the policy saves operators' outputs, not what autograd would keep, and saving every step of such a
  chain kept more than no recomputation at all (GPT-2's tanh GELU is eight of them).

Whatever the mode, some operators are always recomputed:

- random ones (dropout's ``bernoulli_``; fused attention with dropout): the recomputation must draw
  the same numbers in the same order. Every part reseeds the generator before it runs
  (merak.pipeline.recompute) and the recomputation reruns the part's random operators in their
  order, so the masks are the first run's; a random operator skipped in the recomputation (its
  output cached) would shift the numbers every later one draws;
- views and factories (``empty_like``): they cost nothing, and a factory's output is usually
  filled in place afterwards (dropout's mask);
- in-place operators; and a saved output that a later in-place operator modifies (an in-place ReLU
  after a linear layer) is recomputed instead, since the cached copy would no longer be the value
  the backward needs.

When the checkpointed forward is done (:meth:`SelectiveContexts.finish`), a saved output that no later
operator of the run read, of an operator whose backward does not read it (a language model head's
logits), is let go: the recomputation stops before reaching it. The outputs kept are reported to the
activation meter (``measure_activation_memory``), and the FLOPs of all saved operators are left out of
the recomputation count (what the backward does not run again).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils import checkpoint as torch_checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.weak import WeakIdKeyDictionary

from merak.pipeline import memory, recompute
from merak.pipeline.settings import SELECTIVE_MODES as MODES

_aten = torch.ops.aten
# Matrix products whose outputs the "matmuls" mode saves (overload packets: every overload counts).
MATRIX_PRODUCTS = frozenset({_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm})
# merak's tensor-parallel linear layers (merak.tensor_parallel.linear_ops), by schema name: they reach the
# dispatcher as one operator each, collective included.
TENSOR_PARALLEL_PRODUCTS = frozenset({"merak::column_linear", "merak::row_linear"})
# Fused attention kernels (their dropout makes them random when dropout_p > 0).
FUSED_ATTENTION = frozenset(getattr(_aten, name) for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
    "_efficient_attention_forward") if hasattr(_aten, name))

# Factories that take a tensor only for its shape: their outputs are usually filled in place next
# (dropout's mask is ``empty_like`` then ``bernoulli_``).
SHAPED_FACTORIES = frozenset(getattr(_aten, name) for name in (
    "empty_like", "zeros_like", "ones_like", "full_like", "empty_strided", "new_empty", "new_empty_strided",
    "new_zeros", "new_ones", "new_full") if hasattr(_aten, name))

# Operators that read no values of their tensor arguments besides views (``_unsafe_view``, which
# ``matmul`` applies to its product, is not flagged as a view).
_READ_NO_VALUES = SHAPED_FACTORIES | {_aten._unsafe_view}

# torch's marker for "recompute this entry" in the selective-checkpoint storage: a saved output
# modified in place later is switched to it (None where torch lacks it: torch then reports the
# modification itself in the backward).
_RECOMPUTE_ENTRY = getattr(torch_checkpoint, "_RECOMPUTE", None)


# Operators whose backward reads only their inputs: an output of theirs that no later operator of the
# checkpointed run reads is of no use to the recomputation (a language model head's logits).
_OUTPUT_UNUSED_BY_BACKWARD = MATRIX_PRODUCTS | {_aten.add, _aten.sub, _aten.clone}


class SelectiveContexts:
    """The ``context_fn`` for ``checkpoint(..., use_reentrant=False)`` that saves what ``mode`` names;
    call :meth:`finish` after each checkpointed forward.

    Args:
        mode: ``"matmuls"`` or ``"attention"`` (see the module docstring).

    Raises:
        ValueError: If ``mode`` is not one of :data:`MODES`.
    """

    def __init__(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"selective_recompute={mode!r} is not one of {', '.join(MODES)}")
        self.mode = mode
        self._policy: SelectivePolicy | None = None

    def __call__(self):
        """A fresh policy and storage for one checkpointed run (one per call, as torch expects)."""
        policy = SelectivePolicy(self.mode)
        caching, cached = create_selective_checkpoint_contexts(policy)
        policy.bind(caching)
        self._policy = policy
        return caching, cached

    def finish(self) -> None:
        """After the checkpointed forward: settle what its policy keeps (:meth:`SelectivePolicy.finish`)."""
        policy, self._policy = self._policy, None
        if policy is not None:
            policy.finish()


class _Kept:
    """An output the policy saved: where torch stores it, its tensors and the FLOPs it spares the backward."""

    def __init__(self, entry: tuple[object, int], tensors: list[torch.Tensor], flops: int, droppable: bool) -> None:
        self.entry = entry
        self.tensors = tensors
        self.flops = flops
        self.droppable = droppable
        self.read = False
        self.switched = False  # to recomputation: torch's storage no longer holds it


class SelectivePolicy:
    """The policy of one checkpointed run: called by torch for each aten operator of its forward.

    Args:
        mode: ``"matmuls"`` or ``"attention"`` (see the module docstring).
    """

    def __init__(self, mode: str) -> None:
        self.mode = mode
        # Tensors of the attention core seen so far (weakly held: the policy lives until the backward).
        self._core = WeakIdKeyDictionary()
        # Storage address -> the saved outputs on it, until finish(). Saved outputs stay alive in torch's
        # storage, so an address cannot be reused while it is listed.
        self._kept: dict[int, list[_Kept]] = {}
        self._caching = None

    def bind(self, caching_mode) -> None:
        """Give the policy torch's caching mode (its storage and operator counters)."""
        self._caching = caching_mode

    def __call__(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        output = ctx.op_output
        if not getattr(func, "is_view", False) and getattr(func, "_overloadpacket", None) not in _READ_NO_VALUES:
            self._note_reads(args, kwargs)
        in_core = self.mode == "attention" and self._follow_attention_core(func, args, output)
        if _always_recomputed(func, args, kwargs):
            if _mutates(func):
                self._recompute_modified(func, args, kwargs)
            return CheckpointPolicy.PREFER_RECOMPUTE
        save = _is_saved_product(func) if self.mode == "matmuls" else not (in_core or _unary_pointwise(func, args))
        if not save:
            return CheckpointPolicy.PREFER_RECOMPUTE
        self._remember(func, args, kwargs, output)
        return CheckpointPolicy.MUST_SAVE

    def finish(self) -> None:
        """Once the forward is done: an output that no later operator read, of an operator whose backward
        does not read it, is let go (torch's recomputation stops once it has every tensor the backward
        needs, before reaching that operator); the rest is reported to the activation meter. Neither
        kind is recomputed work."""
        for kept in {id(k): k for ks in self._kept.values() for k in ks if not k.switched}.values():
            recompute.note_saved_flops(kept.flops)
            if kept.droppable and not kept.read and self._can_switch():
                self._switch_to_recompute(kept)
            else:
                memory.note_kept(kept.tensors)
        self._kept.clear()  # the tensors are torch's to hold (or free) from here on

    def _note_reads(self, args, kwargs) -> None:
        for leaf in pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                for kept in self._kept.get(_address(leaf), ()):
                    kept.read = True

    def _remember(self, func, args, kwargs, output) -> None:
        counters = getattr(self._caching, "func_counter", None) if self._caching is not None else None
        index = counters[func] - 1 if counters is not None and func in counters else -1
        tensors = [leaf for leaf in pytree.tree_leaves(output) if isinstance(leaf, torch.Tensor)]
        kept = _Kept((func, index), tensors, recompute.saved_operator_flops(func, args, kwargs, output),
                     droppable=output_unused_by_backward(func) and index >= 0)
        for tensor in tensors:
            self._kept.setdefault(_address(tensor), []).append(kept)

    def _can_switch(self) -> bool:
        return self._caching is not None and _RECOMPUTE_ENTRY is not None

    def _switch_to_recompute(self, kept: _Kept) -> None:
        key, index = kept.entry
        self._caching.storage[key][index] = _RECOMPUTE_ENTRY
        kept.switched = True

    def _recompute_modified(self, func, args, kwargs) -> None:
        """Switch the saved outputs an in-place ``func`` modified to recomputation."""
        for tensor in _written_arguments(func, args, kwargs):
            for kept in self._kept.get(_address(tensor), []):
                if self._can_switch() and kept.entry[1] >= 0:
                    self._switch_to_recompute(kept)
                # else torch reports the modification in the backward

    def _follow_attention_core(self, func, args, output) -> bool:
        """Whether ``func`` belongs to the attention core, marking its outputs that carry the core on."""
        packet = getattr(func, "_overloadpacket", None)
        if packet in FUSED_ATTENTION:
            return True  # recomputed whole; its output is the attention's result, outside the core
        tensors = [leaf for leaf in pytree.tree_leaves(args) if isinstance(leaf, torch.Tensor)]
        reads_core = any(tensor in self._core for tensor in tensors)
        if packet in MATRIX_PRODUCTS:
            if reads_core:
                return False  # p @ v: its output (the attention's result) is saved
            if not _products_of_activations(packet, args):
                return False
        elif not reads_core:
            return False
        for leaf in pytree.tree_leaves(output):
            if isinstance(leaf, torch.Tensor):
                self._core[leaf] = True
        return True


def matmuls_saves(func, args, kwargs) -> bool:
    """Whether the ``matmuls`` policy saves the output of ``func`` called with ``args`` and ``kwargs`` (what
    :class:`SelectivePolicy` decides; the planner prices a selective layout's kept bytes with it)."""
    return not _always_recomputed(func, args, kwargs) and _is_saved_product(func)


def output_unused_by_backward(func) -> bool:
    """Whether ``func``'s backward does not read its output: a saved output of it that no later operator
    reads is let go (:meth:`SelectivePolicy.finish`)."""
    return getattr(func, "_overloadpacket", None) in _OUTPUT_UNUSED_BY_BACKWARD or _tensor_parallel_product(func)


def _tensor_parallel_product(func) -> bool:
    schema = getattr(func, "_schema", None)
    return schema is not None and schema.name in TENSOR_PARALLEL_PRODUCTS


def _address(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _is_saved_product(func) -> bool:
    packet = getattr(func, "_overloadpacket", None)
    return packet in MATRIX_PRODUCTS or packet in FUSED_ATTENTION or _tensor_parallel_product(func)


def _always_recomputed(func, args, kwargs) -> bool:
    """Random, view (``_unsafe_view`` too), factory and in-place operators (and anything that is no aten
    operator)."""
    if not isinstance(func, torch._ops.OpOverload):
        return True
    if torch.Tag.nondeterministic_seeded in func.tags and recompute.operator_draws(func, args, kwargs):
        return True
    if func.is_view or _mutates(func) or func._overloadpacket in _READ_NO_VALUES:
        return True
    return not any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves((args, kwargs)))


def _unary_pointwise(func, args) -> bool:
    """An elementwise operator of one tensor (a scaling, an activation function's steps): recomputing it
    reads one tensor, and saving every step of a chain would keep more than autograd itself does."""
    tensors = [leaf for leaf in pytree.tree_leaves(args) if isinstance(leaf, torch.Tensor)]
    return torch.Tag.pointwise in func.tags and len(tensors) == 1


def _mutates(func) -> bool:
    return isinstance(func, torch._ops.OpOverload) and func._schema.is_mutable


def _written_arguments(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an in-place (or out=) operator writes."""
    written = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = kwargs.get(argument.name, args[index] if index < len(args) else None)
        written.extend(leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor))
    return written


def _products_of_activations(packet, args) -> bool:
    """Whether a matrix product multiplies two activations (attention's ``q @ k^T``) rather than an
    activation by a weight (a linear layer)."""
    operands = args[1:3] if packet in (_aten.addmm, _aten.baddbmm) else args[:2]
    return not any(_is_parameter(operand) for operand in operands)


def _is_parameter(tensor) -> bool:
    """A parameter or a view of one (a linear layer multiplies by ``weight.t()``)."""
    return isinstance(tensor, nn.Parameter) or isinstance(getattr(tensor, "_base", None), nn.Parameter)
