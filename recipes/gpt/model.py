"""Model factory: a plain Hugging Face GPT-2 built from a config (random init, no download)."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from merak.tensor_parallel.cross_entropy import accepts_half_precision, cross_entropy


def build_model(model_cfg) -> GPT2LMHeadModel:
    """A GPT2LMHeadModel with the sizes in ``model_cfg`` (conf/model/*.yaml)."""
    config = GPT2Config(
        vocab_size=model_cfg.vocab_size,
        n_positions=model_cfg.seq_length,
        n_embd=model_cfg.hidden_size,
        n_layer=model_cfg.num_layers,
        n_head=model_cfg.num_heads,
        resid_pdrop=model_cfg.dropout,
        embd_pdrop=model_cfg.dropout,
        attn_pdrop=model_cfg.dropout,
        tie_word_embeddings=True,
    )
    config._attn_implementation = "sdpa"
    return GPT2LMHeadModel(config)


def tokens_per_sample(model_cfg) -> int:
    """Every sample is one block of ``seq_length`` tokens."""
    return int(model_cfg.seq_length)


@accepts_half_precision
def causal_lm_loss(output, batch) -> torch.Tensor:
    """Mean next-token cross-entropy: position t predicts token t + 1.

    ``output`` is the model's output (a ModelOutput with ``logits``) or the logits; with
    ``parallel_vocab`` they are this rank's vocabulary slice and the loss is vocabulary-parallel.
    """
    logits = output if isinstance(output, torch.Tensor) else output["logits"]
    labels = batch["labels"]
    shifted_logits = logits[:, :-1, :].reshape(-1, logits.size(-1))
    return cross_entropy(shifted_logits, labels[:, 1:].reshape(-1), ignore_index=-100)
