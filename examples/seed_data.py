"""Which data the example scripts train on: the recipe config overrides for their data arguments.

Text models (gpt, bert, t5) read ``--data-files`` (default: the recipe's offline text); the
original command lines also pass ``--data_path``, an image folder that text models do not use.
Image models (vit, swin, wide_resnet) read ``--data_path``: the ImageNet folder of the original
examples, ``<data_path>/train`` (and ``<data_path>/val``) or ``<data_path>`` itself in the
ImageFolder layout (``<folder>/<class>/<image>``). Without such a folder they train on the
recipe's offline synthetic images, with a warning that names the folder.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)

IMAGE_RECIPES = ("vit", "swin", "wide_resnet")


@dataclass(frozen=True)
class ImageFolders:
    """The ImageFolder-layout folders found under ``--data_path`` (``eval`` may be None)."""

    train: str
    eval: str | None
    num_classes: int


def _class_count(folder: str) -> int:
    """Number of class subfolders (ImageFolder's rule: every subfolder is a class)."""
    return sum(1 for entry in os.scandir(folder) if entry.is_dir())


def _is_image_folder(folder: str) -> bool:
    """Whether ``folder`` has the ImageFolder layout: it exists and holds class subfolders."""
    return os.path.isdir(folder) and _class_count(folder) > 0


def find_image_folders(data_path: str) -> ImageFolders | None:
    """The train (and validation) folders under ``data_path``, or None when there are none.

    ``<data_path>/train`` comes first: an ImageNet folder holds ``train/`` and ``val/``, which the
    ImageFolder rule alone would take for two classes.
    """
    root = os.path.abspath(os.path.expanduser(data_path))
    train = os.path.join(root, "train")
    if _is_image_folder(train):
        val = os.path.join(root, "val")
        return ImageFolders(train=train, eval=val if _is_image_folder(val) else None,
                            num_classes=_class_count(train))
    if _is_image_folder(root):
        return ImageFolders(train=root, eval=None, num_classes=_class_count(root))
    return None


def text_overrides(data_files, text_column: str, cache_dir: str | None, data_path: str | None) -> list[str]:
    """Config overrides of a text recipe for the example's data arguments."""
    if data_path:
        # The original command lines pass the image folder to every example; text models ignore it.
        logger.info("--data_path %s is for image models; the text example does not read it", data_path)
    overrides = []
    if data_files:
        overrides += ["data=files", f"data.files=[{','.join(os.path.abspath(f) for f in data_files)}]",
                      f"data.text_column={text_column}"]
    if cache_dir:
        overrides.append(f"data.cache_dir={os.path.abspath(cache_dir)}")
    return overrides


def image_overrides(data_path: str | None) -> tuple[list[str], ImageFolders | None]:
    """Config overrides of an image recipe for ``--data_path``, and the folders it reads (None:
    the recipe's synthetic images)."""
    if not data_path:
        logger.info("no --data_path: training on the recipe's synthetic images")
        return [], None
    folders = find_image_folders(data_path)
    if folders is None:
        # Every process decides alike; one of them says so.
        level = logging.WARNING if os.environ.get("RANK", "0") == "0" else logging.DEBUG
        logger.log(level, "--data_path %s is not an image folder (ImageFolder layout <folder>/<class>/<image>, "
                   "or <folder>/train/<class>/<image>): training on the recipe's synthetic images instead",
                   data_path)
        return [], None
    # The classifier gets one output per class of the folder, as the original examples sized it.
    logger.info("training on %s (%d classes)", folders.train, folders.num_classes)
    return ["data=folder", f"data.path={folders.train}", f"model.num_classes={folders.num_classes}"], folders
