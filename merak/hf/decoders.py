"""Hugging Face decoder families for text generation through the pipeline.

GPT-2 and the Llama family (Llama, Mistral, Qwen2/3), keyed by the config's
``model_type`` in :data:`DECODERS`; each implements
:class:`merak.pipeline.decode_adapter.DecoderAdapter` with the model's own modules
and a ``transformers.DynamicCache`` per sequence. Importing this module registers
them (:func:`merak.pipeline.decode_adapter.register_decoder_families`); transformers
itself is imported only when a cache is made.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from merak.hf.lora import unwrap_peft
from merak.pipeline.decode_adapter import DecoderFamilies, GenerationError, register_decoder_families


def _token_ids(value) -> frozenset[int]:
    """A config's end-of-sequence token(s): none, one id, or a list of ids."""
    if value is None:
        return frozenset()
    return frozenset(int(v) for v in value) if isinstance(value, (list, tuple)) else frozenset({int(value)})


class _HuggingFaceDecoder:
    """What every family shares: the blocks under ``blocks_path``, the config's eos, the cache, SDPA."""

    blocks_path = ""

    def __init__(self, model: nn.Module, prefix: str) -> None:
        """``model``: the causal LM (inside any peft wrapper); ``prefix``: its name in the model the engine holds."""
        self.model, self.prefix = model, prefix
        self.eos_token_ids = _token_ids(getattr(model.config, "eos_token_id", None))

    def named_blocks(self) -> list[tuple[str, nn.Module]]:
        blocks = self.model.get_submodule(self.blocks_path)
        return [(f"{self.prefix}{self.blocks_path}.{index}", block) for index, block in enumerate(blocks)]

    def new_cache(self) -> object:
        from transformers import DynamicCache

        return DynamicCache()

    @contextlib.contextmanager
    def decoding(self) -> Iterator[None]:
        """SDPA attention, which is causal without a mask, whatever the model trained with."""
        config = self.model.config
        previous = config._attn_implementation
        config._attn_implementation = "sdpa"
        try:
            yield
        finally:
            config._attn_implementation = previous


class Gpt2Decoder(_HuggingFaceDecoder):
    """GPT-2: token + position embeddings, blocks ``transformer.h``, ``ln_f`` and ``lm_head``."""

    blocks_path = "transformer.h"

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        base = self.model.transformer
        return base.wte(ids) + base.wpe(positions)

    def run_block(self, block: nn.Module, hidden: torch.Tensor, cache: object, positions: torch.Tensor) -> torch.Tensor:
        out = block(hidden, past_key_values=cache, use_cache=True, cache_position=positions[0])
        return out[0] if isinstance(out, tuple) else out

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.transformer.ln_f(hidden))


class LlamaDecoder(_HuggingFaceDecoder):
    """Llama-style decoders: ``model.embed_tokens``, blocks ``model.layers``, rotary positions, ``norm``."""

    blocks_path = "model.layers"

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(ids)

    def run_block(self, block: nn.Module, hidden: torch.Tensor, cache: object, positions: torch.Tensor) -> torch.Tensor:
        rotary = self.model.model.rotary_emb(hidden, positions)
        out = block(hidden, attention_mask=None, position_ids=positions, past_key_values=cache, use_cache=True,
                    cache_position=positions[0], position_embeddings=rotary)
        return out[0] if isinstance(out, tuple) else out

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.norm(hidden))


DECODERS: dict[str, type[_HuggingFaceDecoder]] = {
    "gpt2": Gpt2Decoder, "llama": LlamaDecoder, "mistral": LlamaDecoder, "qwen2": LlamaDecoder, "qwen3": LlamaDecoder,
}


def decoder_for(model: nn.Module) -> _HuggingFaceDecoder | None:
    """The decoder of a Hugging Face causal LM (peft-wrapped or not); None for a model that is not a
    Hugging Face model (no ``config.model_type``).

    Raises:
        GenerationError: a Hugging Face model of a type not in :data:`DECODERS`, or without ``lm_head``.
    """
    inner, prefix = unwrap_peft(model)
    model_type = getattr(getattr(inner, "config", None), "model_type", None)
    if model_type is None:
        return None
    if model_type not in DECODERS or not hasattr(inner, "lm_head"):
        raise GenerationError(f"text generation through the pipeline supports causal LMs of types "
                              f"{', '.join(sorted(DECODERS))}; got {type(inner).__name__} ({model_type})")
    return DECODERS[model_type](inner, prefix)


FAMILIES = DecoderFamilies(name="Hugging Face", supported=f"causal LMs of types {', '.join(sorted(DECODERS))}",
                           adapter_for=decoder_for)
register_decoder_families(FAMILIES)
