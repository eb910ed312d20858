"""The TP plan a model trains with: the user's, else a default one (merak's, else transformers').

:func:`plan_for` is what a trainer calls; :func:`default_plan` is the plan of a
model the user describes no plan for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from torch import nn

from merak.config import ConfigError
from merak.tensor_parallel.hf_plans import transformers_rules, translate_plan
from merak.tensor_parallel.model_plans import known_plan
from merak.tensor_parallel.plan import TPPlan
from merak.trace.meta import parameters_on_meta

logger = logging.getLogger(__name__)


def default_plan(model: nn.Module) -> TPPlan | None:
    """The TP plan ``model`` gets when the user gives none.

    Merak's own plan for the model's family (GPT-2, BERT, T5, ViT, Swin, timm's ViT and
    Swin, torchvision's ResNet; :mod:`merak.tensor_parallel.model_plans`), else the
    model's transformers plan translated (see the module docstring), else None.

    Raises:
        TPPlanError: the transformers plan uses a style merak cannot express.
    """
    plan = known_plan(model)
    if plan is not None:
        logger.info("tensor-parallel plan of %s: merak's plan for its model family", type(model).__name__)
        return plan
    rules = transformers_rules(model)
    if not rules:
        return None
    plan = translate_plan(model, rules)
    if plan is not None:
        logger.info("tensor-parallel plan of %s: transformers' plan (%d rules) translated", type(model).__name__,
                    len(rules))
    return plan


def _built(model: nn.Module | Callable[[], nn.Module]) -> nn.Module:
    """``model``, or the model its builder makes with parameters on the meta device (no memory)."""
    if isinstance(model, nn.Module):
        return model
    with parameters_on_meta():
        return model()


def _has_rules(plan: TPPlan | None) -> bool:
    return plan is not None and any((plan.styles, plan.vocab, plan.sliced, plan.attributes, plan.any_attributes,
                                     plan.ratios, plan.partial, plan.sequence))


def plan_for(model: nn.Module | Callable[[], nn.Module], user_plan: TPPlan | Mapping[str, str] | None = None, *,
             tp: int) -> TPPlan | None:
    """The TP plan to train ``model`` with at tensor-parallel degree ``tp``.

    Args:
        model: the single-device model (parameters may be on the meta device), or a
            function building it (a trainer's ``model_init``): called only when the
            plan needs the model, with its parameters on the meta device.
        user_plan: the user's plan: a TPPlan (``tp_plan=``, or the one
            ``merak.set_tp_layer_lists`` built), or a dict in transformers' form
            (module glob -> style), translated for ``model``. None or a plan without
            rules: no user plan.
        tp: the tensor-parallel degree.

    Returns:
        The user's plan when it has rules; else, for ``tp > 1``, :func:`default_plan`;
        None for ``tp == 1`` without a user plan (nothing is split).

    Raises:
        ConfigError: ``tp > 1`` and neither the user nor the model has a plan.
        TPPlanError: the model's (or the dict's) transformers plan uses a style merak
            cannot express.
    """
    if isinstance(user_plan, Mapping):
        user_plan = translate_plan(_built(model), user_plan) if user_plan else None
    if _has_rules(user_plan):
        return user_plan
    if tp <= 1:
        return None
    model = _built(model)
    plan = default_plan(model)
    if plan is None:
        name = type(model).__name__
        raise ConfigError(f"model class {name} has no tensor-parallel plan (merak has none for its family, and "
                          f"transformers none that splits a layer): pass tp_plan=merak.tensor_parallel.TPPlan(...) "
                          f"or a transformers-style dict, or describe it with merak.set_tp_layer_lists(...), "
                          f"or train with tp=1")
    return plan
