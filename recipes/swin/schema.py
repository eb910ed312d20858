"""Every key of the swin recipe's ``model`` and ``data`` config groups, with its type, default and range
(merak checks each value against them before ``check_layout`` and ``check_data`` run)."""

from __future__ import annotations

from dataclasses import dataclass

from merak.core.fields import positive_finite, setting
from recipes.schema import dropout_probability, positive_int, positive_items
from recipes.vision.schema import HfOrTimmModel, ImageData

POSITIVE_INTEGERS = "must be a list of positive integers"


@dataclass(frozen=True)
class SwinModel(HfOrTimmModel):
    """A Swin Transformer (``conf/model/*.yaml``): stages of window-attention blocks, each stage
    halving the token grid and doubling the width."""

    patch_size: int = positive_int(2, "side of the square patches, in pixels (image_size must divide by it)")
    embed_dim: int = positive_int(32, "width of the first stage (doubles at every stage)")
    depths: list[int] = setting(help="blocks per stage", check=positive_items, requirement=POSITIVE_INTEGERS,
                                factory=lambda: [1, 1, 2])
    num_heads: list[int] = setting(help="attention heads per stage (each stage's width must divide by them)",
                                   check=positive_items, requirement=POSITIVE_INTEGERS,
                                   factory=lambda: [2, 4, 8])
    window_size: int = positive_int(4, "side of the attention windows, in tokens")
    mlp_ratio: float = setting(2.0, "width of each block's MLP / the block's width", check=positive_finite,
                               requirement="must be a finite number > 0")
    drop_path: float = dropout_probability("stochastic depth: probability of skipping a block (the deepest)")


# The shared image data (recipes/vision/data.py).
SwinData = ImageData
