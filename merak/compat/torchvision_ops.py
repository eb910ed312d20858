"""Make ``import torchvision`` work when its compiled operators cannot load.

The only torchvision wheel that matches a CPU-only torch 2.13 is a CUDA build,
whose ``_C`` extension links CUDA libraries that a CPU torch does not have.
torchvision then fails at import with ``operator torchvision::nms does not
exist`` -- and so do transformers, timm and peft, which import it. Declaring
the ``nms``/``qnms`` operator schemas (with a plain-PyTorch CPU kernel for
``nms``) before the first import is enough for models and transforms to work.

Where the extension loads (a matching torchvision, CPU or CUDA), nothing is
changed: the check loads the real library first and only falls back when the
operating system refuses it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

import torch

logger = logging.getLogger(__name__)

_applied = False


def _extension_path() -> str | None:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = spec.submodule_search_locations[0]
    for name in sorted(os.listdir(folder)):
        if name.startswith("_C") and name.endswith((".so", ".pyd")):
            return os.path.join(folder, name)
    return None


def nms_reference(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Greedy non-maximum suppression in plain PyTorch (boxes as x1, y1, x2, y2).

    Returns the indices of the kept boxes, highest score first, like
    ``torchvision.ops.nms``.
    """
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


def ensure_torchvision_importable() -> bool:
    """Declare torchvision's core operators if its compiled extension cannot load.

    Returns True when the fallback operators were installed.
    """
    global _applied
    if _applied or "torchvision" in sys.modules:
        return _applied
    path = _extension_path()
    if path is None:
        return False
    try:
        torch.ops.load_library(path)
        return False
    except OSError as error:
        logger.debug("torchvision extension unavailable (%s); using CPU fallbacks", error)
    library = torch.library.Library("torchvision", "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor")
    library.impl("nms", nms_reference, "CPU")
    # Keep the library object alive: dropping it would unregister the operators.
    ensure_torchvision_importable.library = library
    _applied = True
    return True
