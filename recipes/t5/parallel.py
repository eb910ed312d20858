"""How T5 is split into pipeline stages, and which layouts fit a model size.

The model is captured and sharded automatically (merak.shard); this file only
holds the recipe's data for it: which inputs the model takes (source ids and
the shifted target ids; every sample has the full lengths, so no attention
masks), where ``layer_split`` cuts by default (before every encoder and every
decoder block), the TP plan and the layout checks. The encoder's output crosses
every stage boundary after the encoder (the decoder's cross-attention reads it);
merak finds and sends it by itself.
"""

from __future__ import annotations

import torch

from merak.hf.family_plans import t5_plan

INPUT_NAMES = ("input_ids", "decoder_input_ids")
SPLIT_POINTS = ("encoder.block.*", "decoder.block.*")

# merak's T5 plan (merak.hf.family_plans.t5_plan: Megatron's split of every attention and
# feed-forward, the relative position bias by heads; with parallel_vocab the shared token embedding
# and the logits) for T5ForConditionalGeneration.
TP_PLAN = t5_plan()


def example_inputs(model_cfg, micro_batch_size: int) -> dict[str, torch.Tensor]:
    """A microbatch-shaped input for graph capture (source and target token ids)."""
    return {"input_ids": torch.zeros(micro_batch_size, model_cfg.source_length, dtype=torch.long),
            "decoder_input_ids": torch.zeros(micro_batch_size, model_cfg.target_length, dtype=torch.long)}


def check_layout(model_cfg, dp: int, tp: int, pp: int) -> list[str]:
    """Problems with running ``model_cfg`` at this layout (empty list when it fits).

    Each size is already a positive integer (schema.T5Model); these checks relate them.
    """
    from .data import FIRST_WORD

    problems = []
    if model_cfg.num_heads % tp:
        problems.append(f"model.num_heads={model_cfg.num_heads} is not divisible by parallel.tp={tp}")
    if model_cfg.vocab_size <= FIRST_WORD + 1:
        problems.append(f"model.vocab_size={model_cfg.vocab_size} must exceed {FIRST_WORD + 1} "
                        "(ids below it are the special tokens)")
    if model_cfg.target_length > model_cfg.source_length:
        problems.append(f"model.target_length={model_cfg.target_length} must not exceed "
                        f"model.source_length={model_cfg.source_length} (targets are made from the source)")
    return problems
