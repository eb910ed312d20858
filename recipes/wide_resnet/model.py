"""Model factory: a plain torchvision Wide ResNet built from a config (random init, no download).

``model.torchvision_name`` names a torchvision builder (``wide_resnet50_2``), called with
``weights=None``; when it is null the model is torchvision's ``ResNet`` class with
``Bottleneck`` blocks, ``model.layers`` blocks per stage and ``model.width_per_group``
(128 = twice the ResNet width, what makes it "wide").
"""

from __future__ import annotations

from torch import nn

import merak  # noqa: F401  (before torchvision: makes the CUDA-built wheel importable on CPU)


def build_model(model_cfg) -> nn.Module:
    """The Wide ResNet described by ``model_cfg`` (conf/model/*.yaml)."""
    import torchvision
    from torchvision.models.resnet import Bottleneck, ResNet

    if model_cfg.get("torchvision_name"):
        return torchvision.models.get_model(model_cfg.torchvision_name, weights=None,
                                            num_classes=model_cfg.num_classes)
    return ResNet(Bottleneck, list(model_cfg.layers), num_classes=model_cfg.num_classes,
                  width_per_group=model_cfg.width_per_group)
