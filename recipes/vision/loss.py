"""Classification loss shared by the vision recipes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from merak.tensor_parallel.cross_entropy import accepts_half_precision


def logits_of(output) -> torch.Tensor:
    """The logits in a model output: a tensor (torchvision, timm), a ModelOutput/dict with
    ``logits`` (Hugging Face), or a tuple whose first element is the logits."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) or hasattr(output, "keys"):
        return output["logits"]
    if isinstance(output, (tuple, list)):
        return output[0]
    raise TypeError(f"cannot find logits in a model output of type {type(output).__name__}")


@accepts_half_precision
def cross_entropy_loss(output, batch) -> torch.Tensor:
    """Mean cross-entropy of the class logits ``[batch, num_classes]`` against ``batch['labels']``."""
    logits = logits_of(output)
    return F.cross_entropy(logits.float(), batch["labels"])
