"""How Swin is split into pipeline stages, and which layouts fit a model size.

The model is captured and sharded automatically (merak.shard); this file only
holds the recipe's data for it: the example microbatch for capture, where
``layer_split`` cuts by default (before every Swin block) and the layout checks.
The image input is ``pixel_values`` (Hugging Face) or ``x`` (timm); merak feeds the
data fields the model's forward accepts, so no fixed ``input_names`` are needed.
"""

from __future__ import annotations

from merak.hf.family_plans import hf_swin_plan
from merak.tensor_parallel.model_plans import timm_swin_plan
from merak.tensor_parallel.plan import TPPlan
from recipes.vision.data import example_inputs, image_model_problems  # noqa: F401

# Swin blocks of the Hugging Face model (transformers v5 names); the timm model's are
# ``layers.*.blocks.*``. conf/train.yaml takes the points of the chosen model from ``model.split_points``.
SPLIT_POINTS = ("swin.encoder.layers.*.blocks.*",)

# merak's Swin plans (merak.hf.family_plans and merak.tensor_parallel.model_plans: Megatron's split of
# every Swin block, the relative position bias table by heads). The Hugging Face and timm models name
# their modules differently, and a rule that matches nothing is an error, so each source has its plan
# (tp_plan, the recipe's plan, picks it from model.source).
HF_TP_PLAN = hf_swin_plan()
TIMM_TP_PLAN = timm_swin_plan()
TP_PLAN = HF_TP_PLAN


def tp_plan(model_cfg) -> TPPlan:
    """The TP plan of the model ``model_cfg`` builds (its ``source``)."""
    return TIMM_TP_PLAN if model_cfg.source == "timm" else HF_TP_PLAN


def check_layout(model_cfg, dp: int, tp: int, pp: int) -> list[str]:
    """Problems with running ``model_cfg`` at this layout (empty list when it fits).

    Each size is already a positive integer, and depths and heads non-empty lists of them
    (schema.SwinModel); these checks relate them.
    """
    problems = image_model_problems(model_cfg, ("hf", "timm"))
    if problems:
        return problems
    depths, heads = list(model_cfg.depths), list(model_cfg.num_heads)
    if model_cfg.source == "timm" and not model_cfg.get("timm_name"):
        problems.append("model.source=timm needs model.timm_name (e.g. swin_tiny_patch4_window7_224)")
    if len(depths) != len(heads):
        problems.append(f"model.depths ({len(depths)} stages) and model.num_heads ({len(heads)}) differ in length")
        return problems
    for stage, count in enumerate(heads):
        width = model_cfg.embed_dim * 2**stage
        if width % count:
            problems.append(f"stage {stage}: width model.embed_dim*2^{stage}={width} is not divisible by "
                            f"model.num_heads[{stage}]={count}")
        elif count % tp:
            problems.append(f"model.num_heads[{stage}]={count} is not divisible by parallel.tp={tp}")
    if model_cfg.image_size % model_cfg.patch_size:
        problems.append(f"model.image_size={model_cfg.image_size} is not divisible by "
                        f"model.patch_size={model_cfg.patch_size}")
        return problems
    # Every stage's token grid must tile into windows, and each stage but the last halves it.
    resolution = model_cfg.image_size // model_cfg.patch_size
    for stage in range(len(depths)):
        if resolution % model_cfg.window_size:
            problems.append(f"stage {stage}: the {resolution}x{resolution} token grid (model.image_size / "
                            f"model.patch_size / 2^{stage}) is not a multiple of model.window_size="
                            f"{model_cfg.window_size}")
            break
        if stage < len(depths) - 1:
            if resolution % 2:
                problems.append(f"stage {stage}: the {resolution}x{resolution} token grid cannot be halved "
                                "for the next stage")
                break
            resolution //= 2
    return problems
