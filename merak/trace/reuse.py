"""One capture per model per run: the graph a process captured is reused for the same model built again.

A run captures its model more than once. The launcher captures it to check the pipeline plan before
any worker starts, and then every worker builds the same model (same recipe, same config) and
captures it again: with ``n`` workers sharing a machine's cores, that is ``n + 1`` captures of one
graph, the largest share of a run's start-up. Inside :func:`captures_reused` (the runner enters it
where a worker will rebuild the launcher's capture: workers it forks, or the worker it is itself under
torchrun or srun), a capture is remembered; a later capture of a model with the same fingerprint
rebuilds the remembered graph around the new model's own parameters instead of tracing it again.
Workers forked inside the block inherit what the launcher remembered; spawned workers (CUDA) start
with nothing remembered and capture as before.

The fingerprint is conservative: the module tree (classes, training flags, every plain attribute,
hooks), every parameter and buffer (name, shape, dtype, device, requires_grad, tying), the example
inputs' shapes and dtypes, and the capture options. A model holding something it cannot describe
(a large tensor that is not a parameter or buffer) is simply captured again. Nothing is remembered
outside the block, so separate runs in one process never share graphs.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import functools
import hashlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch import fx, nn
from torch._library.custom_ops import CustomOpDef

logger = logging.getLogger(__name__)

_remembered: dict[str, _Template] | None = None
_counted: dict[str, object] = {}  # counted_once_for's values, kept as long as _remembered

_DEPTH = 4  # how deep plain attributes are described (a config object's fields are two levels down)
_TENSOR_VALUES = 4096  # tensor attributes up to this size are described by value; larger ones are opaque
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size,
          torch.memory_format, enum.Enum)
_MODULE_TENSORS = ("_parameters", "_buffers", "_modules")  # described by name, shape and tying instead


class _Opaque(Exception):
    """The model holds something the fingerprint cannot describe; it is captured anew."""


def active() -> bool:
    """Whether captures are being remembered (inside :func:`captures_reused`)."""
    return _remembered is not None


@contextlib.contextmanager
def captures_reused() -> Iterator[None]:
    """Within this block, a model captured once is rebuilt from its first graph when captured again.
    A block inside another shares the outer one's graphs (a run's trials are part of the run)."""
    global _remembered
    if _remembered is not None:
        yield
        return
    _remembered = {}
    try:
        yield
    finally:
        _remembered = None
        _counted.clear()


@dataclasses.dataclass
class _Template:
    """A captured graph detached from the model it was captured from.

    ``attributes`` maps each attribute the graph reads to ``("model", qualified name)`` (looked up
    on the model being captured) or ``("own", value)`` (a constant the capture made).
    """

    graph: fx.Graph
    attributes: dict[str, tuple[str, object]]
    training: bool
    fields: dict[str, object]  # what the caller keeps with the graph (never modified)


class _Describer:
    """Plain descriptions of attribute values; ``modules`` names the model's own modules (each is
    described on its own, so a reference to one is its name)."""

    def __init__(self, modules: Mapping[int, str]) -> None:
        self.modules = modules
        # An object many modules hold (a Hugging Face config) is described once; the traversal is the
        # same for the same model, so the first description stands for the later ones.
        self.described: dict[tuple[int, int], object] = {}

    def __call__(self, value, path: str, depth: int = _DEPTH, seen: frozenset[int] = frozenset()):
        if isinstance(value, _PLAIN):
            return repr(value)
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path)
        if id(value) in self.modules:
            return ("module", self.modules[id(value)])
        if id(value) in seen:
            return "<cycle>"
        if (id(value), depth) not in self.described:
            self.described[id(value), depth] = self._compound(value, path, depth, seen)
        return self.described[id(value), depth]

    def _compound(self, value, path: str, depth: int, seen: frozenset[int]):
        if depth == 0:
            raise _Opaque(f"{path}: a {type(value).__qualname__} nested too deep")
        seen = seen | {id(value)}

        def describe(inner, at: str):
            return self(inner, f"{path}{at}", depth - 1, seen)

        if isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            return ("op", str(value))
        if isinstance(value, CustomOpDef):
            return ("op", value._qualname)
        if isinstance(value, functools.partial):
            return ("partial", describe(value.func, ".func"), describe(value.args, ".args"),
                    describe(value.keywords, ".keywords"))
        if callable(value) and hasattr(value, "__qualname__") and not isinstance(value, nn.Module):
            # A closure or a function with defaults is described by what it holds too (each held object
            # itself: descriptions are remembered by id, so nothing made here may be described).
            cells = getattr(value, "__closure__", None) or ()
            return ("callable", getattr(value, "__module__", None), value.__qualname__,
                    [describe(cell.cell_contents, f".__closure__[{i}]") for i, cell in enumerate(cells)],
                    describe(getattr(value, "__defaults__", None), ".__defaults__"))
        if isinstance(value, (list, tuple, set, frozenset)):
            items = [describe(v, f"[{i}]") for i, v in enumerate(value)]
            return (type(value).__name__, sorted(map(repr, items)) if isinstance(value, (set, frozenset)) else items)
        if isinstance(value, Mapping):
            return ("mapping", sorted((repr(k), describe(v, f"[{k!r}]")) for k, v in value.items()))
        if hasattr(value, "__dict__"):
            return (type(value).__module__, type(value).__qualname__,
                    sorted((k, describe(v, f".{k}")) for k, v in vars(value).items()))
        text = repr(value)
        if " at 0x" in text:
            raise _Opaque(f"{path}: a {type(value).__qualname__} without a stable description")
        return (type(value).__qualname__, text)

    @staticmethod
    def _tensor(value: torch.Tensor, path: str):
        if value.device.type == "meta":
            return ("tensor", tuple(value.shape), str(value.dtype), "meta")
        if value.numel() > _TENSOR_VALUES:
            raise _Opaque(f"{path}: a {tuple(value.shape)} tensor that is neither parameter nor buffer")
        data = value.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()
        return ("tensor", tuple(value.shape), str(value.dtype), hashlib.sha256(data).hexdigest())

    def module_state(self, module: nn.Module, name: str) -> list:
        state = []
        for attribute, value in sorted(vars(module).items()):
            if attribute in _MODULE_TENSORS:
                continue
            path = f"{name or '<model>'}.{attribute}"
            if "hooks" in attribute and isinstance(value, Mapping):  # hook ids are process-wide counters
                state.append((attribute, [self(hook, path) for hook in value.values()]))
            else:
                state.append((attribute, self(value, path)))
        return state


def fingerprint(model: nn.Module, examples: Mapping[str, torch.Tensor], options: Sequence) -> str | None:
    """A digest of everything the capture of ``model`` on ``examples`` with ``options`` depends on;
    None when the model holds something it cannot describe (that model is not reused)."""
    parts: list = [repr(options), torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                   sorted((name, tuple(v.shape), str(v.dtype), v.device.type) for name, v in examples.items())]
    modules = dict(model.named_modules(remove_duplicate=False))
    describe = _Describer({id(module): name for name, module in reversed(modules.items())})
    try:
        for name, module in modules.items():
            parts.append((name, type(module).__module__, type(module).__qualname__, module.training,
                          describe.module_state(module, name)))
    except _Opaque as opaque:
        logger.debug("%s is captured anew, not reused: %s", type(model).__name__, opaque)
        return None
    first_name: dict[int, str] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        tied_to = first_name.setdefault(id(tensor), name)
        parts.append((name, tied_to, tuple(tensor.shape), str(tensor.dtype), tensor.device.type,
                      tensor.requires_grad))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def counted_once(what: str, model: nn.Module, examples: Mapping[str, torch.Tensor], count: Callable[[], object]):
    """``count()`` (a number that depends only on ``model`` and ``examples``, such as its FLOPs), taken
    once per run: later models with the same fingerprint get the remembered value."""
    return counted_once_for(fingerprint(model, examples, (what,)) if _remembered is not None else None, count)


def counted_once_for(key: str | None, count: Callable[[], object]):
    """``count()``, taken once per run for ``key`` (None: counted every time)."""
    if _remembered is None or key is None:
        return count()
    if key not in _counted:
        _counted[key] = count()
    return _counted[key]


def _attribute(root: nn.Module, target: str):
    return functools.reduce(getattr, target.split("."), root)


def _owned_by(model: nn.Module) -> dict[int, str]:
    names = {}
    for named in (model.named_modules(remove_duplicate=False), model.named_parameters(remove_duplicate=False),
                  model.named_buffers(remove_duplicate=False)):
        for name, value in named:
            names.setdefault(id(value), name)
    return names


def remember(key: str | None, model: nn.Module, module: fx.GraphModule, fields: Mapping[str, object]) -> None:
    """Keep ``module``'s graph (captured from ``model``) for later captures with the same ``key``."""
    if _remembered is None or key is None:
        return
    owned = _owned_by(model)
    attributes = {}
    for node in module.graph.nodes:
        if node.op in ("get_attr", "call_module") and node.target not in attributes:
            value = _attribute(module, node.target)
            attributes[node.target] = ("model", owned[id(value)]) if id(value) in owned else ("own", value)
    _remembered[key] = _Template(copy.deepcopy(module.graph), attributes, module.training, dict(fields))


def recall(key: str | None, model: nn.Module) -> tuple[fx.GraphModule, dict] | None:
    """The remembered graph for ``key``, rebuilt around ``model``'s parameters (and fresh copies of the
    capture's own constants), with the fields remembered with it; None if nothing was remembered."""
    template = _remembered.get(key) if _remembered is not None and key is not None else None
    if template is None:
        return None
    copies: dict[int, object] = {}
    root = {}
    for target, (kind, value) in template.attributes.items():
        if kind == "model":
            root[target] = _attribute(model, value)
        else:  # the same constant read under two names stays one object
            if id(value) not in copies:
                copies[id(value)] = copy.deepcopy(value)
            root[target] = copies[id(value)]
    module = fx.GraphModule(root, copy.deepcopy(template.graph), type(model).__name__)
    module.train(template.training)
    return module, dict(template.fields)
