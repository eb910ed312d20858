"""Samples as MerakTrainer reads them: dicts of tensors, whatever the dataset gives."""

from __future__ import annotations

import torch

from merak.data.batching import stack_samples


def to_tensors(sample) -> dict[str, torch.Tensor]:
    """A sample's fields as tensors (Hugging Face datasets give lists)."""
    return {key: torch.as_tensor(value) for key, value in sample.items()}


def default_collate(samples) -> dict[str, torch.Tensor]:
    """Stack the fields of dict samples (lists, numpy arrays or tensors)."""
    return stack_samples([to_tensors(sample) for sample in samples])


class Samples:
    """A dataset whose samples are dicts of tensors."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return to_tensors(self.dataset[int(index)])


__all__ = ["Samples", "default_collate", "to_tensors"]
