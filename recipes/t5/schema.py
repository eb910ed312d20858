"""Every key of the t5 recipe's ``model`` and ``data`` config groups, with its type, default and range
(merak checks each value against them before ``check_layout`` and ``check_data`` run)."""

from __future__ import annotations

from dataclasses import dataclass

from merak.core.fields import finite, setting
from recipes.schema import ModelOption, dropout_probability, positive_int
from recipes.text_schema import SelfTrainedText


@dataclass(frozen=True)
class T5Model(ModelOption):
    """A T5ForConditionalGeneration (``conf/model/*.yaml``), in Hugging Face's T5Config names."""

    vocab_size: int = positive_int(1000, "rows of the shared token embedding (the trained vocabulary and its "
                                         "100 sentinels fit in it)")
    source_length: int = positive_int(32, "encoder tokens per sample")
    target_length: int = positive_int(16, "decoder tokens per sample (at most source_length)")
    d_model: int = positive_int(64, "width of the hidden state")
    d_kv: int = positive_int(16, "width of each attention head")
    d_ff: int = positive_int(128, "width of each feed-forward block")
    num_layers: int = positive_int(2, "encoder blocks")
    num_decoder_layers: int = positive_int(2, "decoder blocks")
    num_heads: int = positive_int(4, "attention heads (divided by parallel.tp)")
    relative_attention_num_buckets: int = positive_int(32, "buckets of the relative position bias")
    feed_forward_proj: str = setting("relu", "the feed-forward activation: relu | gated-gelu (T5Config)")
    dropout: float = dropout_probability()


def noise_fraction(value: float) -> bool:
    """A fraction of the tokens hidden behind sentinels: some, not all."""
    return 0 < value < 1


def span_length(value: float) -> bool:
    """A mean span length in tokens: at least one."""
    return finite(value) and value >= 1


@dataclass(frozen=True)
class T5Data(SelfTrainedText):
    """Seq2seq samples (``conf/data/*.yaml``): span-corrupted text under a trained Unigram vocabulary,
    or synthetic."""

    noise_density: float = setting(0.15, "fraction of the tokens hidden behind sentinels", check=noise_fraction,
                                   requirement="must be in (0, 1)")
    mean_noise_span_length: float = setting(3.0, "mean length of a hidden span, in tokens", check=span_length,
                                            requirement="must be >= 1")
