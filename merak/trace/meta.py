"""Giant models on one worker: build without weights, materialize one stage.

``parameters_on_meta()`` builds a model whose parameters live on the meta
device (no memory) while buffers stay real (they are small and often computed
in ``__init__``, e.g. position ids). The model can then be captured, sharded
and partitioned; each rank calls ``materialize`` for the parameters of its own
stage only.

Initialization does not depend on the layout: every module is initialized
with a generator seeded from ``(seed, module name)``, children before parents
(the order of ``nn.Module.apply`` and Hugging Face's ``init_weights``). A
stage therefore gets exactly the values the single-process model gets from
the same path, whatever the number of stages.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from merak.core.slices import TensorSlice, mark_partial, sequence_partial, slices_of

InitFn = Callable[[nn.Module, nn.Module], None]  # (model, module) -> None, initializes module's parameters


# Factories whose large results go straight to meta while a model is built (filling a 2.4 GB
# weight with zeros only to move it to meta would dominate the build time of a giant model).
_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn, torch.randint}
LARGE_TENSOR_ELEMENTS = 1 << 20


def _requested_numel(func, args, kwargs) -> int:
    """Elements a factory call asks for: its size tuple, or the dimensions passed one by one."""
    size = kwargs.get("size")
    if size is None:
        size = next((a for a in args if isinstance(a, (tuple, list, torch.Size))), None)
    if size is None and func not in (torch.full, torch.randint):  # torch.zeros(3, 4)
        size = [a for a in args if isinstance(a, int)]
    return math.prod(size) if size else 0


class _LargeTensorsOnMeta(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _FACTORIES and kwargs.get("device") is None and \
                _requested_numel(func, args, kwargs) > LARGE_TENSOR_ELEMENTS:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


@contextlib.contextmanager
def parameters_on_meta():
    """Within this block, every parameter a module registers is moved to the meta device.

    Buffers stay real: they are small and often computed in ``__init__``
    (position ids, relative position indices) where meta would lose their values.
    """
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register_on_meta
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small real fills (biases) would each pay a thread-pool start-up
    try:
        with _LargeTensorsOnMeta():
            yield
    finally:
        nn.Module.register_parameter = original
        torch.set_num_threads(threads)


@contextlib.contextmanager
def buffers_on_meta(model: nn.Module):
    """Within this block the model's real buffers are meta tensors (same objects), to run it on meta inputs."""
    swapped = []
    for buffer in {id(b): b for b in model.buffers()}.values():
        if buffer.device.type != "meta":
            holder = buffer.to("meta")
            try:
                torch.utils.swap_tensors(buffer, holder)  # holder now keeps the real data
            except RuntimeError:
                continue  # referenced weakly (e.g. by export's caches): leave it real; most ops mix fine
            swapped.append((buffer, holder))
    try:
        yield
    finally:
        for buffer, holder in swapped:
            torch.utils.swap_tensors(buffer, holder)


def has_meta_parameters(model: nn.Module) -> bool:
    """True when any parameter still lives on the meta device."""
    return any(p.device.type == "meta" for p in model.parameters())


def module_seed(seed: int, name: str) -> int:
    """The generator seed of module ``name``: stable across processes and Python runs."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def default_init(model: nn.Module, module: nn.Module) -> None:
    """Hugging Face models: the model's own ``_init_weights``; others: ``reset_parameters``."""
    hf_init = getattr(model, "_init_weights", None)
    if callable(hf_init):
        hf_init(module)
    elif hasattr(module, "reset_parameters") and any(True for _ in module.parameters(recurse=False)):
        module.reset_parameters()
    elif any(True for _ in module.parameters(recurse=False)):
        raise TypeError(f"{type(module).__name__} has parameters but no reset_parameters(); pass an "
                        "init function (model, module) -> None to initialize it")


def _post_order(module: nn.Module, prefix: str = "") -> Iterable[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


def _replace_parameters(roots: Iterable[nn.Module], fresh: dict[int, nn.Parameter]) -> None:
    for root in roots:
        for module in root.modules():
            for name, param in module._parameters.items():
                if param is not None and id(param) in fresh:
                    module._parameters[name] = fresh[id(param)]


def materialize(model: nn.Module, parameters: Iterable[nn.Parameter], *, seed: int,
                device: torch.device | str = "cpu", init: InitFn = default_init,
                also_in: Iterable[nn.Module] = ()) -> int:
    """Give the modules owning ``parameters`` real storage on ``device`` and initialize them.

    The new parameters replace the meta ones in ``model`` and in every module of
    ``also_in`` (e.g. the stages cut from it), so tied references stay one
    object. The owning modules and their ancestors are initialized in
    post-order, each under its own seed (see the module docstring). A
    tensor-parallel slice is initialized at its full single-device size and then
    cut, so every tp degree starts from the same weights. Returns the number of
    elements made real.
    """
    wanted = {id(p) for p in parameters}
    owners: set[str] = set()
    for name, module in model.named_modules(remove_duplicate=False):
        if any(id(p) in wanted for p in module.parameters(recurse=False)):
            owners.add(name)
    fresh: dict[int, nn.Parameter] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if name in owners:
            for param in module.parameters(recurse=False):
                if param.device.type == "meta" and id(param) not in fresh:
                    fresh[id(param)] = nn.Parameter(torch.empty_like(param, device=device),
                                                    requires_grad=param.requires_grad)
                    if sequence_partial(param):  # the tp plan's mark lives on the parameter object
                        mark_partial(fresh[id(param)])
    _replace_parameters([model, *also_in], fresh)
    full_size = _FullSizeSlices(model, device)
    with torch.no_grad():
        ancestors = {name.rsplit(".", k)[0] for name in owners for k in range(name.count(".") + 1)} | {""}
        for name, module in _post_order(model):
            if name in owners or name in ancestors:
                with torch.random.fork_rng(devices=[]), full_size.swapped_in(module):
                    torch.manual_seed(module_seed(seed, name))
                    init(model, module)
        full_size.cut()
    return sum(p.numel() for p in fresh.values())


class _FullSizeSlices:
    """Full-size stand-ins for tensor-parallel parameter slices while a model is initialized.

    Initialization functions (``reset_parameters``, Hugging Face's
    ``_init_weights``, which may also reach into children) see the full
    tensors; :meth:`cut` then copies each rank's slice into the real parameter.
    Meta slices get meta stand-ins (nothing allocated).
    """

    def __init__(self, model: nn.Module, device) -> None:
        self.full: dict[int, torch.Tensor] = {}
        self.sliced: list[tuple[nn.Module, str, TensorSlice]] = []
        for module in model.modules():
            for name, spec in slices_of(module).items():
                param = module._parameters.get(name)
                if param is None:
                    continue  # a sliced buffer: buffers are real, sliced when the plan was applied
                self.sliced.append((module, name, spec))
                if id(param) not in self.full:
                    where = "meta" if param.device.type == "meta" else device
                    self.full[id(param)] = torch.empty(spec.full_shape, dtype=param.dtype, device=where)

    @contextlib.contextmanager
    def swapped_in(self, root: nn.Module):
        inside = {id(m) for m in root.modules()} if self.sliced else set()
        saved = []
        for module, name, _ in self.sliced:
            if id(module) in inside:
                param = module._parameters[name]
                saved.append((module, name, param))
                module._parameters[name] = nn.Parameter(self.full[id(param)], requires_grad=param.requires_grad)
        try:
            yield
        finally:
            for module, name, param in saved:
                module._parameters[name] = param

    def cut(self) -> None:
        done = set()
        for module, name, spec in self.sliced:
            param = module._parameters[name]
            if param.device.type != "meta" and id(param) not in done:
                param.copy_(spec.take(self.full[id(param)]))
                done.add(id(param))
