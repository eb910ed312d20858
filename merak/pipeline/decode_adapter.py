"""What decoding needs from a model family, and where model libraries register theirs.

The engine decodes any causal language model whose family has a
:class:`DecoderAdapter`: how to embed tokens, which modules are the decoder
blocks and how to run one with a KV cache, how to turn hidden states into logits,
and how to make an empty cache. The adapters live with the model libraries (the
Hugging Face ones in :mod:`merak.hf.decoders`, registered when that module is
imported, which the trainer's ``generate`` does), so this package imports none of
them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

logger = logging.getLogger(__name__)


class GenerationError(ValueError):
    """The model or layout cannot generate through the pipeline; the message says what to change."""


class DecoderAdapter(Protocol):
    """One model's decoder, as the pipeline runs it one step at a time.

    Attributes:
        eos_token_ids: the tokens that end a sequence (empty: none does).
    """

    eos_token_ids: frozenset[int]

    def named_blocks(self) -> list[tuple[str, nn.Module]]:
        """The decoder blocks in order, each with its qualified name in the model the engine holds
        (the names of its parameters there start with it)."""
        ...

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[1, length, hidden]`` of token ids ``[1, length]`` at ``positions`` ``[1, length]``."""
        ...

    def run_block(self, block: nn.Module, hidden: torch.Tensor, cache: object, positions: torch.Tensor) -> torch.Tensor:
        """Run ``block`` on the new positions' hidden states, reading and extending ``cache``."""
        ...

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[1, length, vocabulary (this rank's part when it is split)]`` of the last block's output."""
        ...

    def new_cache(self) -> object:
        """An empty KV cache for one sequence (every block of this rank shares it)."""
        ...

    def decoding(self) -> AbstractContextManager:
        """A context in which the model's modules run as decoding needs (e.g. attention without a mask)."""
        ...


@dataclass(frozen=True)
class DecoderFamilies:
    """A library's decoder adapters.

    Attributes:
        name: who provides them (named in errors).
        supported: what they cover, for the error a model no family knows gets.
        adapter_for: ``adapter_for(model)``: the adapter of ``model``, None when it is not this
            library's model; raises :class:`GenerationError` for a model of this library that
            cannot decode.
    """

    name: str
    supported: str
    adapter_for: Callable[[nn.Module], DecoderAdapter | None]


_FAMILIES: dict[str, DecoderFamilies] = {}


def register_decoder_families(families: DecoderFamilies) -> None:
    """Add ``families`` (replacing an earlier registration of the same name, which keeps its place)."""
    if families.name not in _FAMILIES:
        logger.debug("decoder families %r registered", families.name)
    _FAMILIES[families.name] = families


def decoder_adapter(model: nn.Module) -> DecoderAdapter:
    """The adapter of ``model`` from the first registered library that knows it.

    Raises:
        GenerationError: no registered library knows ``model``, or the one that does cannot decode it.
    """
    for families in _FAMILIES.values():
        adapter = families.adapter_for(model)
        if adapter is not None:
            return adapter
    supported = "; ".join(f"{f.name}: {f.supported}" for f in _FAMILIES.values()) or "no model family is registered"
    raise GenerationError(f"text generation through the pipeline has no decoder for {type(model).__name__} "
                          f"({supported})")
