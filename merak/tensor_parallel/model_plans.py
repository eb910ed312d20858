"""Merak's own TP plans for the timm and torchvision model families its recipes train.

timm's ViT and Swin and torchvision's ResNet. :func:`known_plan` picks the plan
from a model's class (and its ancestors), without importing either library.
The plans of Hugging Face models come from the Hugging Face adapter
(:mod:`merak.hf.family_plans`, registered in :mod:`merak.core.plan_sources`).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from merak.tensor_parallel.plan import TPPlan


def timm_vit_plan() -> TPPlan:
    """timm's VisionTransformer: Megatron's split of every encoder block, as for the Hugging Face ViT;
    its Attention stacks query, key and value in one ``qkv`` layer (3 fused blocks)."""
    return TPPlan(
        styles={"blocks.*.attn.qkv": "column", "blocks.*.attn.proj": "row",
                "blocks.*.mlp.fc1": "column", "blocks.*.mlp.fc2": "row"},
        fused={"blocks.*.attn.qkv": 3},
        attributes={"blocks.*.attn": ("num_heads", "attn_dim")},
    )


def timm_swin_plan() -> TPPlan:
    """timm's SwinTransformer: Megatron's split of every Swin block, as for the Hugging Face Swin (each
    rank keeps the columns of its heads of the relative position bias table); its WindowAttention
    stacks query, key and value in one ``qkv`` layer (3 fused blocks) and reads num_heads to shape
    them and the shifted-window mask."""
    block = "layers.*.blocks.*"
    return TPPlan(
        styles={f"{block}.attn.qkv": "column", f"{block}.attn.proj": "row",
                f"{block}.mlp.fc1": "column", f"{block}.mlp.fc2": "row"},
        fused={f"{block}.attn.qkv": 3},
        attributes={f"{block}.attn": ("num_heads",)},
        sliced={f"{block}.attn.relative_position_bias_table": 1},
    )


def resnet_plan() -> TPPlan:
    """torchvision's ResNet: Megatron's MLP split applied to every residual block.

    conv1 by output channels, its batch norm bn1 on this rank's channels (per-channel
    statistics, so exact), conv2 by input channels (its output summed over the tp group).
    The other convolutions and norms, the downsample branch, the stem and the classifier
    stay replicated.
    """
    return TPPlan(styles={"layer?.*.conv1": "conv_column", "layer?.*.conv2": "conv_row"},
                  sliced={"layer?.*.bn1": 0})


def _resnet(model: nn.Module) -> TPPlan | None:
    # Slicing bn1 by channel is exact only for batch norm (a group norm mixes channels).
    norms = [m for name, m in model.named_modules() if name.startswith("layer") and name.endswith(".bn1")]
    return resnet_plan() if norms and all(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in norms) else None


# (module, class) of the libraries' models, matched on the class and its ancestors; nothing is imported.
_FAMILIES: dict[tuple[str, str], Callable[[nn.Module], TPPlan | None]] = {
    ("timm.models.vision_transformer", "VisionTransformer"): lambda model: timm_vit_plan(),
    ("timm.models.swin_transformer", "SwinTransformer"): lambda model: timm_swin_plan(),
    ("torchvision.models.resnet", "ResNet"): _resnet,
}


def known_plan(model: nn.Module) -> TPPlan | None:
    """Merak's plan for ``model``'s family when it is a timm or torchvision model (None otherwise)."""
    for cls in type(model).__mro__:
        build = _FAMILIES.get((cls.__module__, cls.__name__))
        if build is not None:
            return build(model)
    return None
