"""Image-classification data for the vision recipes (vit, swin, wide_resnet).

Sources (``data.source``):
  * ``synthetic`` (default, offline): ``data.num_samples`` images of
    ``[3, model.image_size, model.image_size]`` and labels in ``[0, model.num_classes)``,
    generated on the fly and deterministic from ``data.seed``. Every class has
    its own smooth pattern (random 4x4 values, upsampled, unit variance); an image is
    its class pattern plus Gaussian noise of std ``data.noise``, so a model can learn
    the classes and the loss goes down.
  * ``folder``: a folder of real images in the ``torchvision.datasets.ImageFolder``
    layout (``data.path/<class name>/<image>``), resized and center-cropped to
    ``model.image_size`` and normalized with the ImageNet mean and std.

Samples are dicts ``{<image key>: float [3, H, W], "labels": int64 scalar}``. The image key
is the model's forward argument: ``pixel_values`` for Hugging Face models
(``model.source=hf``), ``x`` for timm and torchvision models.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch
import torch.nn.functional as F

import merak  # noqa: F401  (before torchvision: makes the CUDA-built wheel importable on CPU)

SOURCES = ("synthetic", "folder")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
PATTERN_GRID = 4  # class patterns are random PATTERN_GRID x PATTERN_GRID values, upsampled


def _seed(*parts) -> int:
    """A 32-bit seed mixed from ``parts`` (torch's CPU generator keeps only the low 32 bits of a seed)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def input_key(model_cfg) -> str:
    """The model's forward argument for the images: ``pixel_values`` (Hugging Face) or ``x``."""
    return "pixel_values" if model_cfg.get("source", "hf") == "hf" else "x"


def example_inputs(model_cfg, micro_batch_size: int) -> dict[str, torch.Tensor]:
    """A microbatch-shaped input for graph capture: ``[micro_batch_size, 3, H, W]`` images."""
    size = int(model_cfg.image_size)
    return {input_key(model_cfg): torch.zeros(micro_batch_size, 3, size, size)}


def _folder_problems(path) -> list[str]:
    if not path:
        return ["data.source=folder needs data.path=/path/to/images (ImageFolder layout: <path>/<class>/<image>)"]
    folder = os.path.expanduser(str(path))
    if not os.path.exists(folder):
        return [f"data folder not found: {path} (data.path)"]
    if not os.path.isdir(folder):
        return [f"data.path={path} is not a folder"]
    if not any(entry.is_dir() for entry in os.scandir(folder)):
        return [f"data.path={path} has no class subfolders (ImageFolder layout: <path>/<class>/<image>)"]
    return []


def check_data(data_cfg) -> list[str]:
    """Problems with the data settings that can be seen without reading the data (each value's type and
    range are checked before, against recipes.vision.schema.ImageData)."""
    source = data_cfg.get("source")
    if source == "synthetic":
        return []
    if source == "folder":
        return _folder_problems(data_cfg.get("path"))
    return [f"unknown data.source={source!r}; use {' or '.join(SOURCES)}"]


def prepare(data_cfg, model_cfg) -> str:
    """Check the data once, before workers start; returns the JSON description ``load`` reads."""
    problems = check_data(data_cfg)
    if problems:
        raise ValueError("; ".join(problems))
    if data_cfg.source == "synthetic":
        return json.dumps({"source": "synthetic", "num_samples": int(data_cfg.num_samples),
                           "seed": int(data_cfg.get("seed", 0)), "noise": float(data_cfg.get("noise", 1.0))})
    from torchvision.datasets.folder import find_classes

    path = os.path.abspath(os.path.expanduser(str(data_cfg.path)))
    classes, _ = find_classes(path)
    if len(classes) > int(model_cfg.num_classes):
        raise ValueError(f"data.path={data_cfg.path} has {len(classes)} classes but model.num_classes="
                         f"{model_cfg.num_classes}; set model.num_classes={len(classes)}")
    return json.dumps({"source": "folder", "path": path})


class SyntheticImages:
    """Deterministic synthetic classification data: class pattern + noise, generated per index."""

    def __init__(self, *, num_samples: int, num_classes: int, image_size: int, seed: int, noise: float,
                 key: str) -> None:
        self.num_samples = num_samples
        self.num_classes = num_classes
        self.image_size = image_size
        self.seed = seed
        self.noise = noise
        self.key = key
        self._patterns: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.num_samples

    def pattern(self, label: int) -> torch.Tensor:
        """The mean image of class ``label``: smooth, zero mean, unit variance, ``[3, H, W]``."""
        if label not in self._patterns:
            generator = torch.Generator().manual_seed(_seed(self.seed, "pattern", label))
            coarse = torch.randn(1, 3, PATTERN_GRID, PATTERN_GRID, generator=generator)
            image = F.interpolate(coarse, size=(self.image_size, self.image_size), mode="bilinear",
                                  align_corners=False)[0]
            self._patterns[label] = (image - image.mean()) / image.std()
        return self._patterns[label]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} of {self.num_samples}")
        generator = torch.Generator().manual_seed(_seed(self.seed, "sample", index))
        label = int(torch.randint(self.num_classes, (1,), generator=generator))
        noise = torch.randn(3, self.image_size, self.image_size, generator=generator)
        image = self.pattern(label) + self.noise * noise
        return {self.key: image, "labels": torch.tensor(label, dtype=torch.long)}


class FolderImages:
    """``torchvision.datasets.ImageFolder`` with samples as dicts of tensors."""

    def __init__(self, path: str, *, image_size: int, key: str) -> None:
        from torchvision import transforms
        from torchvision.datasets import ImageFolder

        transform = transforms.Compose([
            transforms.Resize(image_size), transforms.CenterCrop(image_size), transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
        self.images = ImageFolder(path, transform=transform)
        self.key = key

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        image, label = self.images[index]
        return {self.key: image, "labels": torch.tensor(label, dtype=torch.long)}


def load(prepared: str, model_cfg):
    """The dataset described by ``prepare``'s result, shaped for ``model_cfg``."""
    description = json.loads(prepared)
    key, size = input_key(model_cfg), int(model_cfg.image_size)
    if description["source"] == "folder":
        return FolderImages(description["path"], image_size=size, key=key)
    return SyntheticImages(num_samples=description["num_samples"], num_classes=int(model_cfg.num_classes),
                           image_size=size, seed=description["seed"], noise=description["noise"], key=key)


def image_model_problems(model_cfg, sources) -> list[str]:
    """The check every vision model config shares: ``model.source`` is one of the recipe's ``sources``."""
    if model_cfg.get("source") not in sources:
        return [f"model.source={model_cfg.get('source')!r} is unknown; use {' or '.join(sources)}"]
    return []
