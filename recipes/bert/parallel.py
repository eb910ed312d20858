"""How BERT is split into pipeline stages, and which layouts fit a model size.

The model is captured and sharded automatically (merak.shard); this file only
holds the recipe's data for it: which inputs the model takes (token ids only:
every sample has the full length, so the attention mask is all ones and the
model's default), where ``layer_split`` cuts by default (before every encoder
layer), the TP plan and the layout checks.
"""

from __future__ import annotations

import torch

from merak.tensor_parallel import TPPlan

INPUT_NAMES = ("input_ids",)
SPLIT_POINTS = ("bert.encoder.layer.*",)

# Megatron's split of a BERT layer: query, key, value and the first MLP layer by output
# features (each rank keeps num_heads / tp heads), the attention output and the second MLP
# layer by input features. The MLM head's transform and the layer norms stay replicated.
# With parallel_vocab the word embedding and the tied MLM decoder are split by vocabulary.
TP_PLAN = TPPlan(
    styles={"bert.encoder.layer.*.attention.self.query": "column",
            "bert.encoder.layer.*.attention.self.key": "column",
            "bert.encoder.layer.*.attention.self.value": "column",
            "bert.encoder.layer.*.attention.output.dense": "row",
            "bert.encoder.layer.*.intermediate.dense": "column",
            "bert.encoder.layer.*.output.dense": "row"},
    attributes={"bert.encoder.layer.*.attention.self": ("num_attention_heads", "all_head_size")},
    vocab={"bert.embeddings.word_embeddings": "vocab", "cls.predictions.decoder": "column"},
)


def example_inputs(model_cfg, micro_batch_size: int) -> dict[str, torch.Tensor]:
    """A microbatch-shaped input for graph capture (token ids of ``seq_length``)."""
    return {"input_ids": torch.zeros(micro_batch_size, model_cfg.seq_length, dtype=torch.long)}


def check_layout(model_cfg, dp: int, tp: int, pp: int) -> list[str]:
    """Problems with running ``model_cfg`` at this layout (empty list when it fits)."""
    from recipes.bert.data import FIRST_WORD

    problems = []
    for field in ("hidden_size", "num_heads", "num_layers", "ffn_size", "seq_length", "vocab_size"):
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
    if model_cfg.vocab_size <= FIRST_WORD + 1:
        problems.append(f"model.vocab_size={model_cfg.vocab_size} must exceed {FIRST_WORD + 1} "
                        "(ids below it are the special tokens)")
    if model_cfg.seq_length < 3:
        problems.append(f"model.seq_length={model_cfg.seq_length} must be at least 3 ([CLS] word [SEP])")
    return problems
