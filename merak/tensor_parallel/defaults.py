"""The TP plan a model trains with: the user's, else a default one.

:func:`plan_for` is what a trainer calls; :func:`default_plan` is the plan of a
model the user describes no plan for: merak's own plan for a timm or torchvision
family (:mod:`merak.tensor_parallel.model_plans`), else the plan of the first
registered source that knows the model (:mod:`merak.core.plan_sources`; the
Hugging Face adapter registers one when merak is imported).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from torch import nn

from merak.core.plan_sources import plan_sources
from merak.tensor_parallel.model_plans import known_plan
from merak.tensor_parallel.plan import TPPlan, TPPlanError
from merak.trace.meta import parameters_on_meta

logger = logging.getLogger(__name__)


class MissingTPPlanError(TPPlanError):
    """``tp > 1`` but neither the user nor any plan source has a plan for the model."""


def default_plan(model: nn.Module) -> TPPlan | None:
    """The TP plan ``model`` gets when the user gives none.

    Merak's own plan for the model's family when it is a timm or torchvision model
    (:mod:`merak.tensor_parallel.model_plans`), else the plan of the first registered
    plan source that has one (for Hugging Face models: merak's plan for GPT-2, BERT, T5,
    ViT, Swin, else the model's own plan translated; :mod:`merak.hf.tp_plans`), else None.

    Raises:
        TPPlanError: the model's own plan uses a style merak cannot express.
    """
    plan = known_plan(model)
    if plan is not None:
        logger.info("tensor-parallel plan of %s: merak's plan for its model family", type(model).__name__)
        return plan
    for source in plan_sources():
        plan = source.default_plan(model)
        if plan is not None:
            return plan
    return None


def _built(model: nn.Module | Callable[[], nn.Module]) -> nn.Module:
    """``model``, or the model its builder makes with parameters on the meta device (no memory)."""
    if isinstance(model, nn.Module):
        return model
    with parameters_on_meta():
        return model()


def _translated(model: nn.Module, rules: Mapping[str, str]) -> TPPlan | None:
    """A user's plan written as a dict (module glob -> style), translated by the first source that reads one."""
    for source in plan_sources():
        if source.translate is not None:
            return source.translate(model, rules)
    raise TPPlanError("a tp_plan given as a dict needs a plan source that translates one, and none is "
                      "registered: pass a merak.tensor_parallel.TPPlan instead")


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
            ``merak.set_tp_layer_lists`` built), or a dict in Hugging Face's form
            (module glob -> style), translated for ``model``. None or a plan without
            rules: no user plan.
        tp: the tensor-parallel degree.

    Returns:
        The user's plan when it has rules; else, for ``tp > 1``, :func:`default_plan`;
        None for ``tp == 1`` without a user plan (nothing is split).

    Raises:
        MissingTPPlanError: ``tp > 1`` and neither the user nor the model has a plan.
        TPPlanError: the model's (or the dict's) plan uses a style merak cannot express.
    """
    if isinstance(user_plan, Mapping):
        user_plan = _translated(_built(model), user_plan) if user_plan else None
    if _has_rules(user_plan):
        return user_plan
    if tp <= 1:
        return None
    model = _built(model)
    plan = default_plan(model)
    if plan is None:
        name = type(model).__name__
        raise MissingTPPlanError(
            f"model class {name} has no tensor-parallel plan (merak has none for its family, and its library "
            f"none that splits a layer): pass tp_plan=merak.tensor_parallel.TPPlan(...) or a Hugging Face-style "
            f"dict, or describe it with merak.set_tp_layer_lists(...), or train with tp=1")
    return plan
