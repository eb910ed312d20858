"""How ViT is split into pipeline stages, and which layouts fit a model size.

The model is captured and sharded automatically (merak.shard); this file only
holds the recipe's data for it: the example microbatch for capture, where
``layer_split`` cuts by default (before every encoder block) and the layout checks.
The image input is ``pixel_values`` (Hugging Face) or ``x`` (timm); merak feeds the
data fields the model's forward accepts, so no fixed ``input_names`` are needed.
"""

from __future__ import annotations

from merak.hf.family_plans import hf_vit_plan
from merak.tensor_parallel.model_plans import timm_vit_plan
from merak.tensor_parallel.plan import TPPlan
from recipes.vision.data import example_inputs, image_model_problems  # noqa: F401

# Encoder blocks of the Hugging Face model (transformers v5 names); the timm model's are
# ``blocks.*``. conf/train.yaml takes the points of the chosen model from ``model.split_points``.
SPLIT_POINTS = ("vit.layers.*",)

# merak's ViT plans (merak.hf.family_plans and merak.tensor_parallel.model_plans: Megatron's split of
# every encoder block). The Hugging Face and timm models name their modules differently, and a rule
# that matches nothing is an error, so each source has its plan (tp_plan, the recipe's plan, picks it
# from model.source).
HF_TP_PLAN = hf_vit_plan()
TIMM_TP_PLAN = timm_vit_plan()
TP_PLAN = HF_TP_PLAN


def tp_plan(model_cfg) -> TPPlan:
    """The TP plan of the model ``model_cfg`` builds (its ``source``)."""
    return TIMM_TP_PLAN if model_cfg.source == "timm" else HF_TP_PLAN


def check_layout(model_cfg, dp: int, tp: int, pp: int) -> list[str]:
    """Problems with running ``model_cfg`` at this layout (empty list when it fits).

    Each size is already a positive integer (schema.VitModel); these checks relate them.
    """
    problems = image_model_problems(model_cfg, ("hf", "timm"))
    if problems:
        return problems
    if model_cfg.source == "timm" and not model_cfg.get("timm_name"):
        problems.append("model.source=timm needs model.timm_name (e.g. vit_tiny_patch16_224)")
    if model_cfg.hidden_size % model_cfg.num_heads:
        problems.append(f"model.hidden_size={model_cfg.hidden_size} is not divisible by "
                        f"model.num_heads={model_cfg.num_heads}")
    if model_cfg.image_size % model_cfg.patch_size:
        problems.append(f"model.image_size={model_cfg.image_size} is not divisible by "
                        f"model.patch_size={model_cfg.patch_size}")
    if model_cfg.num_heads % tp:
        problems.append(f"model.num_heads={model_cfg.num_heads} is not divisible by parallel.tp={tp}")
    return problems
