"""How GPT-2 is split into pipeline stages and tensor-parallel shards, and which layouts fit.

The model is captured and sharded automatically (merak.shard); this file only
holds the recipe's data for it: which inputs the model takes, where
``layer_split`` cuts by default (before every transformer block), the TP plan
and the layout checks.
"""

from __future__ import annotations

import torch

from merak.hf.family_plans import gpt2_plan

INPUT_NAMES = ("input_ids",)
SPLIT_POINTS = ("transformer.h.*",)

# merak's GPT-2 plan (merak.hf.family_plans.gpt2_plan: Megatron's split of every
# block, vocabulary and sequence parallel regions) for GPT2LMHeadModel.
TP_PLAN = gpt2_plan()


def example_inputs(model_cfg, micro_batch_size: int) -> dict[str, torch.Tensor]:
    """A microbatch-shaped input for graph capture (token ids of ``seq_length``)."""
    return {"input_ids": torch.zeros(micro_batch_size, model_cfg.seq_length, dtype=torch.long)}


def check_layout(model_cfg, dp: int, tp: int, pp: int) -> list[str]:
    """Problems with running ``model_cfg`` at this layout (empty list when it fits).

    Each size is already a positive integer (schema.GptModel); these checks relate them.
    """
    problems = []
    if model_cfg.hidden_size % model_cfg.num_heads:
        problems.append(f"model.hidden_size={model_cfg.hidden_size} is not divisible by "
                        f"model.num_heads={model_cfg.num_heads}")
    if model_cfg.num_heads % tp:
        problems.append(f"model.num_heads={model_cfg.num_heads} is not divisible by parallel.tp={tp}")
    return problems
