"""Model factory: a plain Swin Transformer classifier built from a config (random init, no download).

``model.source`` picks the library: ``hf`` builds transformers' ``SwinForImageClassification``,
``timm`` builds ``timm.create_model(model.timm_name)`` with the sizes overridden by the config.
"""

from __future__ import annotations

from torch import nn

import merak  # noqa: F401  (before transformers/timm: makes the CUDA-built torchvision importable on CPU)


def build_hf(model_cfg) -> nn.Module:
    from transformers import SwinConfig, SwinForImageClassification

    config = SwinConfig(
        image_size=model_cfg.image_size,
        patch_size=model_cfg.patch_size,
        num_channels=3,
        embed_dim=model_cfg.embed_dim,
        depths=list(model_cfg.depths),
        num_heads=list(model_cfg.num_heads),
        window_size=model_cfg.window_size,
        mlp_ratio=float(model_cfg.mlp_ratio),
        hidden_dropout_prob=model_cfg.dropout,
        attention_probs_dropout_prob=model_cfg.dropout,
        drop_path_rate=model_cfg.drop_path,
        num_labels=model_cfg.num_classes,
    )
    config._attn_implementation = "sdpa"
    return SwinForImageClassification(config)


def build_timm(model_cfg) -> nn.Module:
    import timm

    return timm.create_model(
        model_cfg.timm_name,
        pretrained=False,
        img_size=model_cfg.image_size,
        patch_size=model_cfg.patch_size,
        embed_dim=model_cfg.embed_dim,
        depths=tuple(model_cfg.depths),
        num_heads=tuple(model_cfg.num_heads),
        window_size=model_cfg.window_size,
        mlp_ratio=float(model_cfg.mlp_ratio),
        num_classes=model_cfg.num_classes,
        drop_rate=model_cfg.dropout,
        proj_drop_rate=model_cfg.dropout,
        attn_drop_rate=model_cfg.dropout,
        drop_path_rate=model_cfg.drop_path,
    )


def build_model(model_cfg) -> nn.Module:
    """The Swin classifier described by ``model_cfg`` (conf/model/*.yaml)."""
    if model_cfg.source == "timm":
        return build_timm(model_cfg)
    return build_hf(model_cfg)
