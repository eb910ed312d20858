"""How a sequence is continued: the options, and the choice of each next token from its logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GenerationOptions:
    """How to continue a prompt.

    Attributes:
        max_length: total length of each sequence, prompt included.
        temperature: 0 picks the most likely token (greedy); otherwise logits are divided by it.
        top_k: keep the k most likely tokens (0: all).
        top_p: keep the most likely tokens whose probabilities add up to p (1: all).
        seed: sampling seed (prompt i uses seed + i).
        stop_at_eos: stop a sequence after the model's end-of-sequence token.
    """

    max_length: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_at_eos: bool = True


def pick_token(logits: torch.Tensor, options: GenerationOptions, generator: torch.Generator) -> int:
    """The next token from the last position's logits (float32, the full vocabulary).

    Sampling draws from ``generator`` alone, so ranks that hold the same logits and generator
    (the tensor-parallel ranks of the last stage) pick the same token.
    """
    if options.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits / options.temperature
    if options.top_k:
        threshold = torch.topk(logits, min(options.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    if options.top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True)
        cumulative = torch.cumsum(torch.softmax(ordered, dim=-1), dim=-1)
        drop = cumulative - torch.softmax(ordered, dim=-1) >= options.top_p  # keep the token that crosses p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
