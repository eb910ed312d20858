"""Every key of the vit recipe's ``model`` and ``data`` config groups, with its type, default and range
(merak checks each value against them before ``check_layout`` and ``check_data`` run)."""

from __future__ import annotations

from dataclasses import dataclass

from recipes.schema import positive_int
from recipes.vision.schema import HfOrTimmModel, ImageData


@dataclass(frozen=True)
class VitModel(HfOrTimmModel):
    """A Vision Transformer (``conf/model/*.yaml``)."""

    patch_size: int = positive_int(8, "side of the square patches, in pixels (image_size must divide by it)")
    hidden_size: int = positive_int(64, "width of the hidden state")
    num_layers: int = positive_int(4, "encoder blocks")
    num_heads: int = positive_int(4, "attention heads (hidden_size must divide by them)")
    intermediate_size: int = positive_int(128, "width of each block's MLP")


# The shared image data (recipes/vision/data.py).
VitData = ImageData
