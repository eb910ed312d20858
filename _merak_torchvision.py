"""Make ``import torchvision`` work when its compiled operators cannot load, in any import order.

The only torchvision wheel that matches a CPU-only torch 2.13 is a CUDA build, whose ``_C``
extension links CUDA libraries that a CPU torch does not have. torchvision then fails at import
with ``operator torchvision::nms does not exist`` -- and so do transformers models, timm and peft,
which import it. Declaring the ``nms``/``qnms`` operator schemas (with a plain-PyTorch CPU kernel
for ``nms``) before torchvision's first import is enough for models and transforms to work.

Where the extension loads (a matching torchvision, CPU or CUDA), nothing is changed: the check
loads the real library first and only falls back when the operating system refuses it.

This module lives outside the ``merak`` package so that it can run at interpreter start without
importing merak or torch: installing merak puts ``merak-torchvision.pth`` into site-packages, which
calls :func:`install_import_hook`. The hook only watches for torchvision's import and declares the
operators just before torchvision's own code runs, so programs that never import torchvision do
not pay for importing torch. ``import merak`` applies the same fix directly
(``merak.compat.torchvision_ops``), which covers a source checkout used without installing.
"""

from __future__ import annotations

# Only modules that the interpreter has loaded before site-packages' .pth files run: this module is
# imported by every Python start-up of the environment (logging and importlib.abc cost ~100 ms).
import os
import sys

_applied = False
_library = None  # the torch.library.Library holding the operators; dropping it would unregister them


def _extension_path(locations) -> str | None:
    """The path of torchvision's compiled extension in the package folders ``locations``."""
    for folder in locations or ():
        for name in sorted(os.listdir(folder)):
            if name.startswith("_C") and name.endswith((".so", ".pyd")):
                return os.path.join(folder, name)
    return None


def nms_reference(boxes, scores, iou_threshold: float):
    """Greedy non-maximum suppression in plain PyTorch (boxes as x1, y1, x2, y2).

    Returns the indices of the kept boxes, highest score first, like ``torchvision.ops.nms``.
    """
    import torch

    if boxes.numel() == 0:
        return torch.empty(0, dtype=torch.int64, device=boxes.device)
    x1, y1, x2, y2 = boxes.unbind(1)
    areas = (x2 - x1) * (y2 - y1)
    order = scores.argsort(descending=True)
    suppressed = torch.zeros(len(order), dtype=torch.bool, device=boxes.device)
    keep = []
    for position, index in enumerate(order.tolist()):
        if suppressed[position]:
            continue
        keep.append(index)
        rest = order[position + 1 :]
        width = (torch.minimum(x2[index], x2[rest]) - torch.maximum(x1[index], x1[rest])).clamp(min=0)
        height = (torch.minimum(y2[index], y2[rest]) - torch.maximum(y1[index], y1[rest])).clamp(min=0)
        overlap = width * height
        iou = overlap / (areas[index] + areas[rest] - overlap)
        suppressed[position + 1 :] |= iou > iou_threshold
    return torch.tensor(keep, dtype=torch.int64, device=boxes.device)


def _declare_operators(locations) -> bool:
    """Declare nms/qnms unless torchvision's extension (in ``locations``) loads; True if declared."""
    global _applied, _library
    if _applied:
        return True
    path = _extension_path(locations)
    if path is None:
        return False
    try:
        import torch
    except ImportError:  # no torch: torchvision fails on its own, with its own message
        return False
    try:
        torch.ops.load_library(path)
        return False
    except OSError as error:
        import logging

        logging.getLogger("merak.compat.torchvision_ops").debug(
            "torchvision extension unavailable (%s); using CPU fallbacks", error)
    if hasattr(torch.ops.torchvision, "nms"):  # declared by someone else already
        return False
    library = torch.library.Library("torchvision", "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor")
    library.impl("nms", nms_reference, "CPU")
    _library = library
    _applied = True
    return True


def ensure_torchvision_importable() -> bool:
    """Declare torchvision's core operators now if its compiled extension cannot load.

    Does nothing once torchvision is imported. Returns True when the fallback operators are installed.
    """
    if _applied or "torchvision" in sys.modules:
        return _applied
    import importlib.util

    remove_import_hook()  # the lookup below must not come back here
    spec = importlib.util.find_spec("torchvision")
    return spec is not None and _declare_operators(spec.submodule_search_locations)


class _DeclareFirstLoader:
    """torchvision's own loader, preceded by :func:`_declare_operators` when the module executes.

    An import loader by protocol (create_module, exec_module), not by base class: see the imports.
    """

    def __init__(self, loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        # Once running, torchvision should see its own loader, as if this hook had never been there.
        module.__loader__ = module.__spec__.loader = self._loader
        remove_import_hook()
        _declare_operators(module.__spec__.submodule_search_locations)
        self._loader.exec_module(module)

    def __getattr__(self, name):
        # Probes such as importlib.resources ask the spec's loader for more than create/exec.
        if name == "_loader":  # not set yet (a copy being made): no endless recursion
            raise AttributeError(name)
        return getattr(self._loader, name)


class _TorchvisionImportHook:
    """A meta path finder that finds torchvision with the finders after it and wraps its loader.

    Nothing runs when a library only asks whether torchvision is installed (transformers and
    datasets call ``importlib.util.find_spec`` at import): the operators are declared, and torch
    imported, only when torchvision itself is executed.
    """

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchvision" or self not in sys.meta_path:
            return None
        for finder in sys.meta_path[sys.meta_path.index(self) + 1 :]:
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(fullname, path, target) if find_spec is not None else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _DeclareFirstLoader(spec.loader)
                return spec
        return None


_hook = _TorchvisionImportHook()


def install_import_hook() -> None:
    """Declare the operators right before torchvision is first imported (called at interpreter start)."""
    if "torchvision" not in sys.modules and _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)


def remove_import_hook() -> None:
    """Stop watching for torchvision's import."""
    if _hook in sys.meta_path:
        sys.meta_path.remove(_hook)
