"""Hand-made GPT-2 stages for the schedule benchmarks.

bench/pipeline_vs_torch.py compares merak's 1F1B executor with torch's
Schedule1F1B, which needs stages that pass one tensor. These stages cut a
GPT2LMHeadModel at block boundaries (embeddings join the first stage, ln_f
and the LM head the last) and pass the hidden states only, so both tools run
exactly the same modules. Training code uses merak's automatic splitting.
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


def hand_stages(model: nn.Module, num_stages: int) -> list[nn.Module]:
    """Cut a GPT2LMHeadModel into ``num_stages`` stages at block boundaries."""
    blocks = [Block(block) for block in model.transformer.h]
    return stages_from_blocks(Embeddings(model.transformer), blocks, Head(model), num_stages)
