"""RecipeSpec: what a recipe hands to merak.run."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from merak.data.batching import stack_samples
from merak.tensor_parallel.plan import TPPlan


def no_problems(*_args) -> list[str]:
    """Default check: nothing to report."""
    return []


def one_token_per_sample(_model_cfg) -> int:
    """Default for models whose samples are not token sequences."""
    return 1


@dataclass(frozen=True)
class RecipeSpec:
    """A model family ready to train with merak.run.

    Every callable receives plain values or the recipe's own config sections
    (``model_cfg``, ``data_cfg``), never the whole run config.

    Attributes:
        name: recipe name (folder under recipes/).
        build_model: ``(model_cfg) -> nn.Module``, a plain single-device model;
            called after seeding, identically on every rank.
        loss_fn: ``(model_output, microbatch) -> scalar`` mean loss of a microbatch.
        prepare_data: ``(data_cfg, model_cfg) -> str``: runs once before workers
            start (download, tokenize, cache) and returns what ``load_dataset`` needs.
        load_dataset: ``(prepared, model_cfg) -> dataset`` with ``__len__`` and
            ``__getitem__(i) -> dict of tensors``; only ranks that consume data call it.
        check_layout: ``(model_cfg, dp, tp, pp) -> list[str]`` of problems with
            this layout for this model (empty when fine).
        check_data: ``(data_cfg) -> list[str]`` of problems visible before reading
            the data (missing files, unknown source).
        tokens_per_sample: ``(model_cfg) -> int`` for throughput in tokens/s.
        example_inputs: ``(model_cfg, micro_batch_size) -> dict of tensors`` shaped like
            a microbatch, for graph capture (default: the first samples of the data).
        input_names: the model's forward arguments fed from the microbatch.
        leaf_modules: module classes, class names or qualified names kept whole when tracing.
        split_points: default ``layer_split`` points, module-name globs (``transformer.h.*``).
        build_stages: ``(model, num_stages) -> list[nn.Module]``: hand-made stages, used
            only with ``trace_method=None`` (default: automatic capture and sharding).
        tp_plan: how the model splits for tensor parallelism: a TPPlan, or
            ``(model_cfg) -> TPPlan`` when it depends on the model option (None: tp must be 1).
        collate: ``(list of samples) -> dict of tensors``, one microbatch (default: stack each field).
        channels_last: a convolutional model: on CUDA its weights and 4-D inputs are kept in the
            channels-last layout the tensor-core convolutions read.
    """

    name: str
    build_model: Callable[[Any], nn.Module]
    loss_fn: Callable[[Any, Mapping[str, torch.Tensor]], torch.Tensor]
    prepare_data: Callable[[Any, Any], str]
    load_dataset: Callable[[str, Any], Any]
    # Module-level functions only (no lambdas): the spec is pickled when workers are spawned.
    check_layout: Callable[[Any, int, int, int], list[str]] = no_problems
    check_data: Callable[[Any], list[str]] = no_problems
    tokens_per_sample: Callable[[Any], int] = one_token_per_sample
    example_inputs: Callable[[Any, int], Mapping[str, torch.Tensor]] | None = None
    input_names: tuple[str, ...] | None = None
    leaf_modules: tuple = ()
    split_points: tuple[str, ...] = ()
    build_stages: Callable[[nn.Module, int], Sequence[nn.Module]] | None = None
    tp_plan: TPPlan | Callable[[Any], TPPlan] | None = None
    collate: Callable[[Sequence], Mapping[str, torch.Tensor]] = stack_samples
    channels_last: bool = False

    def tensor_parallel_plan(self, model_cfg) -> TPPlan | None:
        """The TP plan for ``model_cfg`` (see ``tp_plan``)."""
        return self.tp_plan(model_cfg) if callable(self.tp_plan) else self.tp_plan

