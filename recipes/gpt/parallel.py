"""How GPT-2 is split into pipeline stages and tensor-parallel shards, and which layouts fit.

The model is captured and sharded automatically (merak.shard); this file only
holds the recipe's data for it: which inputs the model takes, where
``layer_split`` cuts by default (before every transformer block), the TP plan
and the layout checks.
"""

from __future__ import annotations

import torch

from merak.tensor_parallel import SequenceParallelPlan, TPPlan

INPUT_NAMES = ("input_ids",)
SPLIT_POINTS = ("transformer.h.*",)

# Megatron's split of a GPT block: the fused query/key/value projection and the first MLP
# layer by output features (each rank keeps num_heads / tp heads), the two output
# projections by input features. With parallel_vocab the tied embedding and LM head are
# split by vocabulary. With sequence_parallel the activations between the attention and
# MLP blocks (layer norms, residuals, dropout) hold seq_length / tp positions per rank.
TP_PLAN = TPPlan(
    styles={"transformer.h.*.attn.c_attn": "column", "transformer.h.*.attn.c_proj": "row",
            "transformer.h.*.mlp.c_fc": "column", "transformer.h.*.mlp.c_proj": "row"},
    fused={"transformer.h.*.attn.c_attn": 3},
    attributes={"transformer.h.*.attn": ("num_heads", "split_size")},
    vocab={"transformer.wte": "vocab", "lm_head": "column"},
    sequence=SequenceParallelPlan(enter=("transformer.drop",),
                                  regions=("transformer.h.*.attn", "transformer.h.*.mlp"),
                                  exit=("transformer.ln_f",), sharded=("transformer.h.*",)),
    blocks=("transformer.h.*",),
)


def example_inputs(model_cfg, micro_batch_size: int) -> dict[str, torch.Tensor]:
    """A microbatch-shaped input for graph capture (token ids of ``seq_length``)."""
    return {"input_ids": torch.zeros(micro_batch_size, model_cfg.seq_length, dtype=torch.long)}


def check_layout(model_cfg, dp: int, tp: int, pp: int) -> list[str]:
    """Problems with running ``model_cfg`` at this layout (empty list when it fits)."""
    problems = []
    for field in ("hidden_size", "num_heads", "num_layers", "seq_length", "vocab_size"):
        value = model_cfg.get(field)
        if not isinstance(value, int) or value < 1:
            problems.append(f"model.{field}={value!r} must be a positive integer")
    if problems:
        return problems
    if model_cfg.hidden_size % model_cfg.num_heads:
        problems.append(f"model.hidden_size={model_cfg.hidden_size} is not divisible by "
                        f"model.num_heads={model_cfg.num_heads}")
    if model_cfg.num_heads % tp:
        problems.append(f"model.num_heads={model_cfg.num_heads} is not divisible by parallel.tp={tp}")
    return problems
