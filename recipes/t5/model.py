"""Model factory: a plain Hugging Face T5ForConditionalGeneration built from a config (random init,
no download)."""

from __future__ import annotations

import torch
from transformers import T5Config, T5ForConditionalGeneration

from merak.tensor_parallel.cross_entropy import accepts_half_precision, cross_entropy


def build_model(model_cfg) -> T5ForConditionalGeneration:
    """A T5ForConditionalGeneration with the sizes in ``model_cfg`` (conf/model/*.yaml).

    The token embedding is shared by encoder, decoder and LM head (T5's default
    ``tie_word_embeddings``); no KV cache (training only).
    """
    config = T5Config(
        vocab_size=model_cfg.vocab_size,
        d_model=model_cfg.d_model,
        d_kv=model_cfg.d_kv,
        d_ff=model_cfg.d_ff,
        num_layers=model_cfg.num_layers,
        num_decoder_layers=model_cfg.num_decoder_layers,
        num_heads=model_cfg.num_heads,
        relative_attention_num_buckets=model_cfg.relative_attention_num_buckets,
        dropout_rate=model_cfg.dropout,
        feed_forward_proj=model_cfg.feed_forward_proj,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"  # the relative position bias goes in as the additive mask
    return T5ForConditionalGeneration(config)


def tokens_per_sample(model_cfg) -> int:
    """Source plus target tokens of one sample."""
    return int(model_cfg.source_length) + int(model_cfg.target_length)


@accepts_half_precision
def seq2seq_loss(output, batch) -> torch.Tensor:
    """Mean cross-entropy of the decoder's predictions against ``labels`` (-100 is ignored).

    No shift here: ``decoder_input_ids`` are already the labels shifted right. ``output`` is
    the model's output (a ModelOutput with ``logits``) or the logits; with ``parallel_vocab``
    they are this rank's vocabulary slice and the loss is vocabulary-parallel.
    """
    logits = output if isinstance(output, torch.Tensor) else output["logits"]
    labels = batch["labels"]
    return cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100)
