"""How GPT-2 is cut into pipeline stages, and which layouts fit a model size.

Stages are cut at transformer-block boundaries: embeddings join the first
stage, the final norm and LM head the last, blocks are spread evenly.
"""

from __future__ import annotations

import torch
from torch import nn

from merak.pipeline.stage import stages_from_blocks


class Embeddings(nn.Module):
    """Token + position embeddings and dropout; takes the microbatch dict."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.wte = transformer.wte
        self.wpe = transformer.wpe
        self.drop = transformer.drop

    def forward(self, batch) -> torch.Tensor:
        input_ids = batch["input_ids"]
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        return self.drop(self.wte(input_ids) + self.wpe(positions))


class Block(nn.Module):
    """One transformer block on hidden states (causal attention, no padding mask)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.block(hidden_states)


class Head(nn.Module):
    """Final layer norm and the LM head (tied to the token embedding)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.ln_f = model.transformer.ln_f
        self.lm_head = model.lm_head

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden_states))


def build_stages(model: nn.Module, num_stages: int) -> list[nn.Module]:
    """Cut a GPT2LMHeadModel into ``num_stages`` stages at block boundaries."""
    blocks = [Block(block) for block in model.transformer.h]
    return stages_from_blocks(Embeddings(model.transformer), blocks, Head(model), num_stages)


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
    if model_cfg.num_layers < pp:
        problems.append(f"model.num_layers={model_cfg.num_layers} is smaller than parallel.pp={pp}: "
                        "every stage needs at least one transformer block; lower parallel.pp")
    return problems
