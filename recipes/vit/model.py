"""Model factory: a plain ViT classifier built from a config (random init, no download).

``model.source`` picks the library: ``hf`` builds transformers' ``ViTForImageClassification``,
``timm`` builds ``timm.create_model(model.timm_name)`` with the sizes overridden by the config.
"""

from __future__ import annotations

from torch import nn

import merak  # noqa: F401  (before transformers/timm: makes the CUDA-built torchvision importable on CPU)

SOURCES = ("hf", "timm")


def build_hf(model_cfg) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=model_cfg.image_size,
        patch_size=model_cfg.patch_size,
        num_channels=3,
        hidden_size=model_cfg.hidden_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_heads,
        intermediate_size=model_cfg.intermediate_size,
        hidden_dropout_prob=model_cfg.dropout,
        attention_probs_dropout_prob=model_cfg.dropout,
        num_labels=model_cfg.num_classes,
    )
    config._attn_implementation = "sdpa"
    return ViTForImageClassification(config)


def build_timm(model_cfg) -> nn.Module:
    import timm

    return timm.create_model(
        model_cfg.timm_name,
        pretrained=False,
        img_size=model_cfg.image_size,
        patch_size=model_cfg.patch_size,
        embed_dim=model_cfg.hidden_size,
        depth=model_cfg.num_layers,
        num_heads=model_cfg.num_heads,
        mlp_ratio=model_cfg.intermediate_size / model_cfg.hidden_size,
        num_classes=model_cfg.num_classes,
        drop_rate=model_cfg.dropout,
        proj_drop_rate=model_cfg.dropout,
        attn_drop_rate=model_cfg.dropout,
    )


def build_model(model_cfg) -> nn.Module:
    """The ViT classifier described by ``model_cfg`` (conf/model/*.yaml)."""
    if model_cfg.source == "timm":
        return build_timm(model_cfg)
    return build_hf(model_cfg)
