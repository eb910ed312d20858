"""The default tensor-parallel plans of Hugging Face models, registered with merak.

A transformers model the user describes no plan for gets merak's plan for its
family (:mod:`merak.hf.family_plans`: GPT-2, BERT, T5, ViT, Swin), else its own
transformers plan (``model.tp_plan``) translated (:mod:`merak.hf.tp_translation`).
A user's plan written as a dict in transformers' form is translated the same way.

Importing this module registers both with :mod:`merak.core.plan_sources`;
``import merak`` does it, so :func:`merak.tensor_parallel.default_plan` and
:func:`merak.tensor_parallel.plan_for` see them without importing this package.
"""

from __future__ import annotations

import logging

from torch import nn

from merak.core.plan_sources import PlanSource, register_plan_source
from merak.hf.family_plans import family_plan
from merak.hf.tp_translation import transformers_rules, translate_plan
from merak.tensor_parallel.plan import TPPlan

logger = logging.getLogger(__name__)

SOURCE_NAME = "Hugging Face"


def default_plan(model: nn.Module) -> TPPlan | None:
    """The plan of a transformers model without a user plan (None: merak has none for its family and
    transformers none that splits a layer, or ``model`` is not a transformers model).

    Raises:
        TPPlanError: the transformers plan uses a style merak cannot express.
    """
    plan = family_plan(model)
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


register_plan_source(PlanSource(name=SOURCE_NAME, default_plan=default_plan, translate=translate_plan))
