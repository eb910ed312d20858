"""RecipeSpec: what a recipe hands to merak.run; load_spec: a train.py finds its own spec."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from merak.data.batching import stack_samples
from merak.shard.settings import ShardingSettings
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
        model_schema, data_schema: dataclasses whose fields (merak.core.fields.setting: type, default,
            range) are every key of the ``model`` / ``data`` config groups; each value is checked against
            its field before check_layout / check_data run, which then see values of the right types.
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
    model_schema: type | None = None
    data_schema: type | None = None

    def tensor_parallel_plan(self, model_cfg) -> TPPlan | None:
        """The TP plan for ``model_cfg`` (see ``tp_plan``)."""
        return self.tp_plan(model_cfg) if callable(self.tp_plan) else self.tp_plan

    def sharding(self, settings: ShardingSettings) -> ShardingSettings:
        """The run's sharding section with this recipe's defaults in it: its split points where the run
        names none, its leaf modules before the run's (which may then hold classes as well as names)."""
        return dataclasses.replace(settings,
                                   custom_split_points=list(settings.custom_split_points or self.split_points),
                                   leaf_modules=[*self.leaf_modules, *(settings.leaf_modules or ())])


def load_spec(script: str | os.PathLike) -> RecipeSpec:
    """The ``SPEC`` of the recipe directory that holds ``script``: ``SPEC = load_spec(__file__)`` in a train.py.

    The directory's ``spec.py`` is imported as a module of the directory's own package (see
    :func:`recipe_package`), so a copied recipe directory trains its own files, wherever it lies.

    Raises:
        FileNotFoundError: the directory has no ``__init__.py`` or no ``spec.py``.
        TypeError: its ``spec.py`` defines no ``SPEC`` RecipeSpec.
    """
    folder = Path(script).resolve().parent
    if not (folder / "spec.py").is_file():
        raise FileNotFoundError(f"{folder} has no spec.py: a recipe defines SPEC = RecipeSpec(...) there")
    module = importlib.import_module(f"{recipe_package(folder)}.spec")
    spec = getattr(module, "SPEC", None)
    if not isinstance(spec, RecipeSpec):
        raise TypeError(f"{module.__file__} defines no SPEC = merak.recipe.RecipeSpec(...)")
    return spec


def recipe_package(folder: str | os.PathLike) -> str:
    """The name under which the package in ``folder`` is imported (imported first when needed).

    Its dotted name in the packages around it (``recipes.gpt``) when that name imports from this
    very directory (this repository's recipes, installed or run from the checkout); otherwise
    (a copy elsewhere, or a name taken by another package) a name made from the directory's path,
    the same in every process, under which the directory is registered as a package.
    """
    folder = Path(folder).resolve()
    if not (folder / "__init__.py").is_file():
        raise FileNotFoundError(f"{folder} is not a recipe package: it needs an __init__.py")
    parts, top = [folder.name], folder
    while (top.parent / "__init__.py").is_file():
        top = top.parent
        parts.insert(0, top.name)
    if all(part.isidentifier() for part in parts) and _imports_from(parts[0], top):
        name = ".".join(parts)
        if Path(importlib.import_module(name).__file__).resolve().parent == folder:
            return name
    return _register_package(folder)


def _imports_from(name: str, folder: Path) -> bool:
    """Whether the top-level package ``name`` is the one in ``folder``."""
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a broken or half-initialised module of that name
        return False
    locations = (found.submodule_search_locations or []) if found is not None else []
    return any(Path(location).resolve() == folder for location in locations)


def _register_package(folder: Path) -> str:
    """Import ``folder`` as a package under a name derived from its path, so that its modules'
    relative imports work and the spec's functions pickle by reference (a spawned worker runs
    the train.py again, which registers the same name)."""
    digest = hashlib.sha256(str(folder).encode()).hexdigest()[:10]
    stem = re.sub(r"\W", "_", folder.name)
    name = f"_merak_recipe_{stem}_{digest}"
    if name not in sys.modules:
        found = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                       submodule_search_locations=[str(folder)])
        module = importlib.util.module_from_spec(found)
        sys.modules[name] = module
        try:
            found.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return name
