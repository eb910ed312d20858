"""Tensor parallelism for unmodified models: plans, parallel layers, collectives, sequence parallel.

Typical use (merak.session.assemble does this for every worker)::

    resolved = resolve_plan(model, plan, tp=2)       # exact changes, or TPPlanError
    apply_plan(model, resolved, ParallelContext(rank=tp_rank, size=2))

A model without a user plan gets :func:`default_plan`: merak's plan for its
family, else the plan a registered source gives it (the Hugging Face adapter's:
its own plan translated); :func:`plan_for` picks.
"""

from merak.tensor_parallel.defaults import MissingTPPlanError, default_plan, plan_for
from merak.tensor_parallel.layers import ParallelContext
from merak.tensor_parallel.plan import Change, ResolvedPlan, TPPlan, TPPlanError, apply_plan, resolve_plan
from merak.tensor_parallel.seed_api import set_tp_layer_lists, user_plan
from merak.tensor_parallel.sequence import SequenceParallelPlan

__all__ = ["Change", "MissingTPPlanError", "ParallelContext", "ResolvedPlan", "SequenceParallelPlan", "TPPlan",
           "TPPlanError", "apply_plan", "default_plan", "plan_for", "resolve_plan", "set_tp_layer_lists",
           "user_plan"]
