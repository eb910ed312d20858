"""Text generation through the pipeline, with a KV cache on every stage.

Training runs captured graphs, which are specialized to the training shapes; a
decoding step has one new token, so generation runs the model's own (eager)
modules instead, through a model family's :class:`~merak.pipeline.decode_adapter.DecoderAdapter`
(the Hugging Face ones: :mod:`merak.hf.decoders`). Each rank runs the decoder
blocks whose weights it trained (tensor-parallel blocks keep their collectives)
and keeps their keys and values in the adapter's cache; the steps are instruction
lists (:mod:`merak.pipeline.decode_schedule`) run by a pipeline executor
(:mod:`merak.pipeline.decode`): hidden states go to the next stage, the last stage
picks the next token (greedy, or sampling with temperature, top-k and top-p from a
seeded generator, so every tensor-parallel rank picks the same token) and sends it
back to the first stage, all point to point. Prompts are spread over the
data-parallel replicas, one at a time.

Every block must lie wholly on one stage (``split_method=layer_split`` guarantees it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from merak.distributed import groups
from merak.pipeline.decode import PipelineDecoder
from merak.pipeline.decode_adapter import (
    DecoderAdapter,
    DecoderFamilies,
    GenerationError,
    decoder_adapter,
    register_decoder_families,
)
from merak.pipeline.decode_sampling import GenerationOptions

__all__ = ["DecoderAdapter", "DecoderFamilies", "GenerationError", "GenerationOptions", "generate",
           "register_decoder_families"]


def _local_blocks(adapter: DecoderAdapter, local_names: set[str]) -> list[nn.Module]:
    """The blocks this rank holds, in order; a block split between ranks is an error."""
    mine = []
    for block_name, block in adapter.named_blocks():
        names = [f"{block_name}.{name}" for name, _ in block.named_parameters()]
        held = sum(name in local_names for name in names)
        if held == len(names):
            mine.append(block)
        elif held:
            raise GenerationError(f"block {block_name} is split between pipeline stages; generation needs whole "
                                  f"blocks per stage: train with split_method=layer_split")
    return mine


@contextlib.contextmanager
def _inference(model: nn.Module, adapter: DecoderAdapter) -> Iterator[None]:
    """Eval mode, no gradients and the adapter's decoding settings for the duration of generation;
    every module's training flag is restored afterwards."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad(), adapter.decoding():
            yield
    finally:
        for module, mode in modes:
            module.training = mode


def generate(session, prompts: Sequence[Sequence[int]], options: GenerationOptions) -> list[list[int]]:
    """Continue each prompt (a list of token ids); every rank returns every sequence. Collective.

    Raises:
        GenerationError: the model has no registered decoder adapter, or the layout cannot generate.
    """
    state, engine, settings = session.state, session.engine, session.settings
    grid, coords = state.grid, state.coordinates
    if grid.tp > 1 and settings.trainer.tensor_parallel.sequence_parallel:
        raise GenerationError("generation with sequence_parallel=true is not supported: turn it off")
    if engine.num_chunks > 1:
        raise GenerationError("generation with interleaved schedules (pipeline_chunks > 1) is not supported")
    adapter = decoder_adapter(session.model)
    blocks = _local_blocks(adapter, {name for name, _ in engine.named_parameters()})
    eos_token_ids = adapter.eos_token_ids if options.stop_at_eos else frozenset()
    decoder = PipelineDecoder(adapter, blocks, state, dtype=engine.optimizer.precision.dtype,
                              vocab_parallel=grid.tp > 1 and settings.trainer.tensor_parallel.parallel_vocab)
    results = {}
    # ZeRO-3: the decoder runs the blocks directly, so every parameter is gathered for the whole generation.
    with _inference(session.model, adapter), engine.whole_parameters():
        for index, prompt in enumerate(prompts):
            if index % grid.dp == coords.dp:
                sequence = decoder.continue_prompt(list(map(int, prompt)), options, eos_token_ids,
                                                   torch.Generator().manual_seed(options.seed + index))
                if sequence is not None:  # the last stage's ranks hold the sequences
                    results[index] = sequence
    merged = {}
    for part in groups.gather_from_all(results):
        merged.update(part)
    return [merged[i] for i in range(len(prompts))]
