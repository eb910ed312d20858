"""Model factory: a plain Hugging Face BertForMaskedLM built from a config (random init, no download)."""

from __future__ import annotations

import torch
from transformers import BertConfig, BertForMaskedLM

from merak.tensor_parallel.cross_entropy import accepts_half_precision, cross_entropy


def build_model(model_cfg) -> BertForMaskedLM:
    """A BertForMaskedLM with the sizes in ``model_cfg`` (conf/model/*.yaml); the MLM decoder is tied
    to the word embedding."""
    config = BertConfig(
        vocab_size=model_cfg.vocab_size,
        hidden_size=model_cfg.hidden_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_heads,
        intermediate_size=model_cfg.ffn_size,
        max_position_embeddings=model_cfg.seq_length,
        hidden_dropout_prob=model_cfg.dropout,
        attention_probs_dropout_prob=model_cfg.dropout,
        tie_word_embeddings=True,
    )
    config._attn_implementation = "sdpa"
    return BertForMaskedLM(config)


def tokens_per_sample(model_cfg) -> int:
    """Every sample is one sequence of ``seq_length`` tokens."""
    return int(model_cfg.seq_length)


@accepts_half_precision
def masked_lm_loss(output, batch) -> torch.Tensor:
    """Mean cross-entropy over the masked positions (labels of -100 elsewhere are ignored).

    ``output`` is the model's output (a ModelOutput with ``logits``) or the logits; with
    ``parallel_vocab`` they are this rank's vocabulary slice and the loss is vocabulary-parallel.
    """
    logits = output if isinstance(output, torch.Tensor) else output["logits"]
    labels = batch["labels"]
    return cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100)
