"""How Swin is split into pipeline stages, and which layouts fit a model size.

The model is captured and sharded automatically (merak.shard); this file only
holds the recipe's data for it: the example microbatch for capture, where
``layer_split`` cuts by default (before every Swin block) and the layout checks.
The image input is ``pixel_values`` (Hugging Face) or ``x`` (timm); merak feeds the
data fields the model's forward accepts, so no fixed ``input_names`` are needed.
"""

from __future__ import annotations

from merak.tensor_parallel import TPPlan
from recipes.vision.data import (  # noqa: F401
    example_inputs,
    image_model_problems,
    positive_int_problems,
)

# Swin blocks of the Hugging Face model (transformers v5 names); the timm model's are
# ``layers.*.blocks.*``. conf/train.yaml takes the points of the chosen model from ``model.split_points``.
SPLIT_POINTS = ("swin.encoder.layers.*.blocks.*",)

# Megatron's split of a Swin block: the query/key/value projections and the first MLP layer
# by output features (each rank keeps num_heads / tp heads of its stage), the attention output
# and the second MLP layer by input features; each rank keeps the columns of its heads of the
# relative position bias table (positions x heads). Patch embedding and merging, layer norms
# and the classifier stay replicated. The Hugging Face and timm models name their modules
# differently, and a rule that matches nothing is an error, so each source has its plan
# (tp_plan, the recipe's plan, picks it from model.source).
_HF_BLOCK = "swin.encoder.layers.*.blocks.*"
HF_TP_PLAN = TPPlan(
    styles={f"{_HF_BLOCK}.attention.q_proj": "column", f"{_HF_BLOCK}.attention.k_proj": "column",
            f"{_HF_BLOCK}.attention.v_proj": "column", f"{_HF_BLOCK}.attention.o_proj": "row",
            f"{_HF_BLOCK}.mlp.fc1": "column", f"{_HF_BLOCK}.mlp.fc2": "row"},
    attributes={f"{_HF_BLOCK}.attention": ("num_attention_heads",)},
    sliced={f"{_HF_BLOCK}.attention.relative_position_bias.relative_position_bias_table": 1},
)
# timm's WindowAttention stacks query, key and value in one ``qkv`` layer (3 fused blocks) and
# reads num_heads to shape them and the shifted-window mask.
_TIMM_BLOCK = "layers.*.blocks.*"
TIMM_TP_PLAN = TPPlan(
    styles={f"{_TIMM_BLOCK}.attn.qkv": "column", f"{_TIMM_BLOCK}.attn.proj": "row",
            f"{_TIMM_BLOCK}.mlp.fc1": "column", f"{_TIMM_BLOCK}.mlp.fc2": "row"},
    fused={f"{_TIMM_BLOCK}.attn.qkv": 3},
    attributes={f"{_TIMM_BLOCK}.attn": ("num_heads",)},
    sliced={f"{_TIMM_BLOCK}.attn.relative_position_bias_table": 1},
)
TP_PLAN = HF_TP_PLAN


def tp_plan(model_cfg) -> TPPlan:
    """The TP plan of the model ``model_cfg`` builds (its ``source``)."""
    return TIMM_TP_PLAN if model_cfg.source == "timm" else HF_TP_PLAN


def _int_list(value) -> list[int] | None:
    try:
        items = list(value)
    except TypeError:
        return None
    if not items or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in items):
        return None
    return items


def check_layout(model_cfg, dp: int, tp: int, pp: int) -> list[str]:
    """Problems with running ``model_cfg`` at this layout (empty list when it fits)."""
    problems = image_model_problems(model_cfg, ("hf", "timm"))
    problems += positive_int_problems(model_cfg, ("patch_size", "embed_dim", "window_size"))
    depths, heads = _int_list(model_cfg.get("depths")), _int_list(model_cfg.get("num_heads"))
    if depths is None:
        problems.append(f"model.depths={model_cfg.get('depths')!r} must be a list of positive integers")
    if heads is None:
        problems.append(f"model.num_heads={model_cfg.get('num_heads')!r} must be a list of positive integers")
    if problems:
        return problems
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
