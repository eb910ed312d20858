"""Every key of the wide_resnet recipe's ``model`` and ``data`` config groups, with its type, default and
range (merak checks each value against them before ``check_layout`` and ``check_data`` run)."""

from __future__ import annotations

from dataclasses import dataclass

from merak.core.fields import setting
from recipes.schema import positive_int, positive_items
from recipes.vision.schema import ImageData, ImageModel


@dataclass(frozen=True)
class WideResnetModel(ImageModel):
    """A torchvision ResNet of Bottleneck blocks (``conf/model/*.yaml``): a named torchvision builder, or
    ``layers`` and ``width_per_group``."""

    source: str = setting("torchvision", "torchvision (the only library)")
    torchvision_name: str | None = setting(None, "a torchvision builder (wide_resnet50_2); null: ResNet(Bottleneck, "
                                                 "layers, width_per_group)")
    layers: list[int] | None = setting(help="torchvision_name=null: Bottleneck blocks in each of the 4 stages",
                                       check=positive_items, requirement="must be positive block counts, "
                                                                         "e.g. [3, 4, 6, 3]",
                                       factory=lambda: [1, 1, 1, 1])
    width_per_group: int | None = positive_int(128, "torchvision_name=null: the bottleneck width per group "
                                                    "(64: the plain ResNet; 128: twice as wide)")


# The shared image data (recipes/vision/data.py).
WideResnetData = ImageData
