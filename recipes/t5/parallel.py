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

from merak.tensor_parallel import TPPlan

INPUT_NAMES = ("input_ids", "decoder_input_ids")
SPLIT_POINTS = ("encoder.block.*", "decoder.block.*")

# Megatron's split of every T5 attention (self-attention and the decoder's cross-attention):
# q, k, v by output features (each rank keeps num_heads / tp heads), o by input features;
# the feed-forward's input layers (wi, or wi_0 and wi_1 for gated activations) by output
# features and wo by input features. The first block of each stack owns the relative
# position bias table (buckets x heads): each rank keeps the columns of its heads. Attention
# layers without the table make a zero bias of n_heads heads, hence n_heads is divided. With
# parallel_vocab the token embedding (one weight shared by ``shared``, both stacks'
# ``embed_tokens`` and ``lm_head``) is split by vocabulary, and so are the logits.
_ATTENTION = "*.block.*.layer.*.*Attention"  # SelfAttention, and EncDecAttention in the decoder
TP_PLAN = TPPlan(
    styles={f"{_ATTENTION}.q": "column", f"{_ATTENTION}.k": "column", f"{_ATTENTION}.v": "column",
            f"{_ATTENTION}.o": "row",
            "*.block.*.layer.*.DenseReluDense.wi*": "column", "*.block.*.layer.*.DenseReluDense.wo": "row"},
    attributes={_ATTENTION: ("n_heads", "inner_dim")},
    sliced={"*.block.0.layer.0.SelfAttention.relative_attention_bias": 1},
    vocab={"shared": "vocab", "encoder.embed_tokens": "vocab", "decoder.embed_tokens": "vocab",
           "lm_head": "column"},
)


def example_inputs(model_cfg, micro_batch_size: int) -> dict[str, torch.Tensor]:
    """A microbatch-shaped input for graph capture (source and target token ids)."""
    return {"input_ids": torch.zeros(micro_batch_size, model_cfg.source_length, dtype=torch.long),
            "decoder_input_ids": torch.zeros(micro_batch_size, model_cfg.target_length, dtype=torch.long)}


def check_layout(model_cfg, dp: int, tp: int, pp: int) -> list[str]:
    """Problems with running ``model_cfg`` at this layout (empty list when it fits)."""
    from recipes.t5.data import FIRST_WORD

    problems = []
    for field in ("d_model", "d_kv", "d_ff", "num_heads", "num_layers", "num_decoder_layers", "vocab_size",
                  "source_length", "target_length"):
        value = model_cfg.get(field)
        if not isinstance(value, int) or value < 1:
            problems.append(f"model.{field}={value!r} must be a positive integer")
    if problems:
        return problems
    if model_cfg.num_heads % tp:
        problems.append(f"model.num_heads={model_cfg.num_heads} is not divisible by parallel.tp={tp}")
    if model_cfg.vocab_size <= FIRST_WORD + 1:
        problems.append(f"model.vocab_size={model_cfg.vocab_size} must exceed {FIRST_WORD + 1} "
                        "(ids below it are the special tokens)")
    if model_cfg.target_length > model_cfg.source_length:
        problems.append(f"model.target_length={model_cfg.target_length} must not exceed "
                        f"model.source_length={model_cfg.source_length} (targets are made from the source)")
    return problems
