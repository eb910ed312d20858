"""How a Wide ResNet is split into pipeline stages, and which layouts fit a model size.

The model is captured and sharded automatically (merak.shard); this file only
holds the recipe's data for it: the example microbatch for capture, where
``layer_split`` cuts by default (before every Bottleneck block) and the layout checks.
torchvision's ResNet takes the images as ``x``.
"""

from __future__ import annotations

from merak.tensor_parallel.model_plans import resnet_plan
from recipes.vision.data import example_inputs, image_model_problems  # noqa: F401

# Every Bottleneck block: layer1.0, layer1.1, ..., layer4.2.
SPLIT_POINTS = ("layer?.*",)
MIN_IMAGE_SIZE = 32  # the stem and three strided stages divide the image by 32
STAGE_PLANES = (64, 128, 256, 512)  # torchvision's Bottleneck planes per stage

# merak's ResNet plan (merak.tensor_parallel.model_plans.resnet_plan: Megatron's MLP split applied to
# every Bottleneck: conv1 by output channels, bn1 on this rank's channels, conv2 by input channels).
TP_PLAN = resnet_plan()


def check_layout(model_cfg, dp: int, tp: int, pp: int) -> list[str]:
    """Problems with running ``model_cfg`` at this layout (empty list when it fits).

    Each size is already a positive integer, and the block counts positive (schema.WideResnetModel);
    these checks relate them, and ask for the sizes a model without a torchvision builder needs.
    """
    problems = image_model_problems(model_cfg, ("torchvision",))
    if not problems and model_cfg.image_size < MIN_IMAGE_SIZE:
        problems.append(f"model.image_size={model_cfg.image_size} is below {MIN_IMAGE_SIZE}: the ResNet stem and "
                        "stages downsample by 32")
    if model_cfg.get("torchvision_name"):
        return problems
    if model_cfg.get("width_per_group") is None:
        problems.append("model.torchvision_name=null needs model.width_per_group (64: the plain ResNet, 128: "
                        "twice as wide)")
    layers = model_cfg.get("layers")
    if layers is None or len(layers) != len(STAGE_PLANES):
        problems.append(f"model.layers={layers!r} must be {len(STAGE_PLANES)} positive block counts, "
                        "e.g. [3, 4, 6, 3]")
    if not problems:
        # tensor parallelism splits each Bottleneck's inner width (conv1's output channels)
        for stage, planes in enumerate(STAGE_PLANES, start=1):
            width = int(planes * (model_cfg.width_per_group / 64.0))
            if width % tp:
                problems.append(f"layer{stage}: the Bottleneck width {width} (planes {planes} x "
                                f"model.width_per_group={model_cfg.width_per_group} / 64) is not divisible by "
                                f"parallel.tp={tp}")
    return problems
