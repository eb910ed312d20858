"""The loss MerakTrainer computes on the last pipeline stage, from the model output and the batch."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from merak.tensor_parallel.cross_entropy import cross_entropy


def output_logits(output) -> torch.Tensor:
    """The logits of a model output: a tensor, a ModelOutput/dict with ``logits``, or its first tensor."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        if "logits" in output:
            return output["logits"]
        output = list(output.values())
    if isinstance(output, list | tuple) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"cannot find logits in a model output of type {type(output).__name__}; pass a loss_fn "
                    f"that takes (output, batch) through MerakTrainer(compute_loss=...)")


def is_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face causal language model (its labels are the inputs, shifted)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from merak.hf.lora import unwrap_peft

    return type(unwrap_peft(model)[0]).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


class LabelLoss:
    """``loss_fn(logits, labels)`` applied to flattened logits and labels (the seed API's contract).

    Args:
        loss_fn: an ``nn.Module`` loss such as ``CrossEntropyLoss()``, or None for merak's cross
            entropy (the same numbers, and it also handles vocabulary-parallel logits).
        label_name: the batch field holding the labels.
        shift: causal language models: position t predicts label t + 1.
        label_smoothing: Hugging Face's ``label_smoothing_factor`` (with merak's cross entropy): the
            target puts this much weight uniformly over the vocabulary.
    """

    def __init__(self, loss_fn: Callable | None, *, label_name: str = "labels", shift: bool = False,
                 label_smoothing: float = 0.0) -> None:
        self.loss_fn = loss_fn
        self.label_name = label_name
        self.shift = shift
        self.label_smoothing = float(label_smoothing or 0.0)

    def __call__(self, output, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if self.label_name not in batch:
            raise KeyError(f"the batch has no {self.label_name!r} field (it has {sorted(batch)}); set "
                           f"label_names in MerakArguments")
        logits, labels = output_logits(output), batch[self.label_name]
        if self.shift:
            logits, labels = logits[..., :-1, :], labels[..., 1:]
        logits = logits.reshape(-1, logits.size(-1)).float()
        labels = labels.reshape(-1)
        if self.loss_fn is not None:
            return self.loss_fn(logits, labels)
        if self.label_smoothing:
            return nn.functional.cross_entropy(logits, labels, ignore_index=-100,
                                               label_smoothing=self.label_smoothing)
        return cross_entropy(logits, labels, ignore_index=-100)
