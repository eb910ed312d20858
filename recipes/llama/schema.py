"""Every key of the llama recipe's ``model`` and ``data`` config groups, with its type, default and range
(merak checks each value against them before ``check_layout`` and ``check_data`` run). The data are
the gpt recipe's, with its fields."""

from __future__ import annotations

from dataclasses import dataclass

from merak.core.fields import positive_finite, setting
from recipes.gpt.schema import GptData
from recipes.schema import TransformerSizes, positive_int

# The gpt recipe's data, read by the gpt recipe's code (data.py).
LlamaData = GptData


@dataclass(frozen=True)
class LlamaModel(TransformerSizes):
    """A LlamaForCausalLM (``conf/model/*.yaml``): grouped-query attention, rotary positions, RMS norms."""

    max_position_embeddings: int = positive_int(32, "the longest sequence the rotary positions expect")
    intermediate_size: int = positive_int(64, "width of the SwiGLU MLP (divided by parallel.tp)")
    num_kv_heads: int = positive_int(2, "key-value heads, each serving a group of num_heads / num_kv_heads "
                                        "query heads (divided by parallel.tp)")
    rope_theta: float = setting(10000.0, "base of the rotary frequencies", check=positive_finite,
                                requirement="must be a finite number > 0")
    rope_scaling: dict | None = setting(None, "null, or Llama 3.1's long-context scaling: {rope_type: llama3, "
                                              "factor, low_freq_factor, high_freq_factor, "
                                              "original_max_position_embeddings}")
    rms_norm_eps: float = setting(1e-5, "epsilon of the RMS norms", check=positive_finite,
                                  requirement="must be a finite number > 0")
    tie_word_embeddings: bool = setting(True, "the LM head shares the token embedding's weight")
