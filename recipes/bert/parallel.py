"""How BERT is split into pipeline stages, and which layouts fit a model size.

The model is captured and sharded automatically (merak.shard); this file only
holds the recipe's data for it: which inputs the model takes (token ids only:
every sample has the full length, so the attention mask is all ones and the
model's default), where ``layer_split`` cuts by default (before every encoder
layer), the TP plan and the layout checks.
"""

from __future__ import annotations

import torch

from merak.hf.family_plans import bert_plan

INPUT_NAMES = ("input_ids",)
SPLIT_POINTS = ("bert.encoder.layer.*",)

# merak's BERT plan (merak.hf.family_plans.bert_plan: Megatron's split of every encoder
# layer; with parallel_vocab the word embedding and the tied MLM decoder) for BertForMaskedLM.
TP_PLAN = bert_plan()


def example_inputs(model_cfg, micro_batch_size: int) -> dict[str, torch.Tensor]:
    """A microbatch-shaped input for graph capture (token ids of ``seq_length``)."""
    return {"input_ids": torch.zeros(micro_batch_size, model_cfg.seq_length, dtype=torch.long)}


def check_layout(model_cfg, dp: int, tp: int, pp: int) -> list[str]:
    """Problems with running ``model_cfg`` at this layout (empty list when it fits).

    Each size is already a positive integer (schema.BertModel); these checks relate them.
    """
    from .data import FIRST_WORD

    problems = []
    if model_cfg.hidden_size % model_cfg.num_heads:
        problems.append(f"model.hidden_size={model_cfg.hidden_size} is not divisible by "
                        f"model.num_heads={model_cfg.num_heads}")
    if model_cfg.num_heads % tp:
        problems.append(f"model.num_heads={model_cfg.num_heads} is not divisible by parallel.tp={tp}")
    if model_cfg.vocab_size <= FIRST_WORD + 1:
        problems.append(f"model.vocab_size={model_cfg.vocab_size} must exceed {FIRST_WORD + 1} "
                        "(ids below it are the special tokens)")
    if model_cfg.seq_length < 3:
        problems.append(f"model.seq_length={model_cfg.seq_length} must be at least 3 ([CLS] word [SEP])")
    return problems
