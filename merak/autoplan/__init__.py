"""Automatic choice of the parallel layout: cluster description, cost model and search.

``parallel=auto`` in a recipe, ``merak-plan`` on the command line, or :func:`plan_recipe` here
(docs/auto_parallel.md).
"""

from merak.autoplan.cluster import Cluster, load_cluster
from merak.autoplan.layout import Layout
from merak.autoplan.planner import PlanError, PlanReport, plan_for_settings, plan_recipe

__all__ = ["Cluster", "Layout", "PlanError", "PlanReport", "load_cluster", "plan_for_settings", "plan_recipe"]
