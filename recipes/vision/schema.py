"""The config fields the image-classification recipes (vit, swin, wide_resnet) share: the images and
classes of every model option, the library choice of vit and swin, and the whole ``data`` group
(``recipes/vision/data.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from merak.core.fields import non_negative_finite, setting
from recipes.schema import ModelOption, dropout_probability, positive_int


@dataclass(frozen=True)
class ImageModel(ModelOption):
    """An image classifier's input, output and default pipeline cuts."""

    image_size: int = positive_int(32, "side of the square input images, in pixels")
    num_classes: int = positive_int(10, "classes the model tells apart (must cover data=folder's classes)")
    split_points: list[str] = setting(help="layer_split cut points (trainer.custom_split_points), module globs",
                                      factory=list)


@dataclass(frozen=True)
class HfOrTimmModel(ImageModel):
    """An image transformer built by Hugging Face transformers or by timm (vit, swin)."""

    source: str = setting("hf", "hf: transformers' *ForImageClassification | timm: timm.create_model(timm_name)")
    timm_name: str | None = setting(None, "source=timm: the timm architecture the sizes are applied to")
    dropout: float = dropout_probability()


@dataclass(frozen=True)
class ImageData:
    """Synthetic images (class pattern + noise) or an ImageFolder of real ones (``conf/data/*.yaml``)."""

    source: str = setting("synthetic", "synthetic (offline) | folder")
    path: str | None = setting(None, "source=folder: the ImageFolder root (<path>/<class>/<image>)")
    num_samples: int = positive_int(4096, "source=synthetic: images generated")
    seed: int = setting(0, "source=synthetic: the class patterns and every image's noise")
    noise: float = setting(1.0, "source=synthetic: std of the Gaussian noise over the unit-variance class "
                                "pattern", check=non_negative_finite, requirement="must be a number >= 0")
