"""Text generation through the pipeline, with a KV cache on every stage.

Training runs captured graphs, which are specialized to the training shapes; a
decoding step has one new token, so generation runs the model's own (eager)
modules instead: each rank runs the decoder blocks whose weights it trained
(tensor-parallel blocks keep their collectives), keeps the keys and values of
those blocks in a ``transformers.DynamicCache``, and passes the hidden states to
the next stage. The last stage turns them into logits and picks the next token
(greedy, or sampling with temperature, top-k and top-p from a seeded generator,
so every tensor-parallel rank picks the same token), and sends it back to the
first stage. Prompts are spread over the data-parallel replicas, one at a time.

Supported decoders: GPT-2 and the Llama family (Llama, Mistral, Qwen2/3) — see
``DECODERS``. Every block must lie wholly on one stage (``split_method=layer_split``
guarantees it).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from merak.distributed import groups
from merak.lora import unwrap_peft


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


class GenerationError(ValueError):
    """The model or layout cannot generate through the pipeline; the message says what to change."""


class _Gpt2:
    """GPT-2: token + position embeddings, blocks ``transformer.h``, ``ln_f`` and ``lm_head``."""

    blocks = "transformer.h"

    def __init__(self, model: nn.Module) -> None:
        self.model, self.base = model, model.transformer

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.base.wte(ids) + self.base.wpe(positions)

    def block(self, block: nn.Module, hidden: torch.Tensor, cache, positions: torch.Tensor) -> torch.Tensor:
        out = block(hidden, past_key_values=cache, use_cache=True, cache_position=positions[0])
        return out[0] if isinstance(out, tuple) else out

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.base.ln_f(hidden))


class _Llama:
    """Llama-style decoders: ``model.embed_tokens``, blocks ``model.layers``, rotary positions, ``norm``."""

    blocks = "model.layers"

    def __init__(self, model: nn.Module) -> None:
        self.model, self.base = model, model.model

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.base.embed_tokens(ids)

    def block(self, block: nn.Module, hidden: torch.Tensor, cache, positions: torch.Tensor) -> torch.Tensor:
        rotary = self.base.rotary_emb(hidden, positions)
        out = block(hidden, attention_mask=None, position_ids=positions, past_key_values=cache, use_cache=True,
                    cache_position=positions[0], position_embeddings=rotary)
        return out[0] if isinstance(out, tuple) else out

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.base.norm(hidden))


DECODERS = {"gpt2": _Gpt2, "llama": _Llama, "mistral": _Llama, "qwen2": _Llama, "qwen3": _Llama}


def _decoder(model: nn.Module):
    inner, prefix = unwrap_peft(model)
    model_type = getattr(getattr(inner, "config", None), "model_type", None)
    if model_type not in DECODERS or not hasattr(inner, "lm_head"):
        raise GenerationError(f"text generation through the pipeline supports causal LMs of types "
                              f"{', '.join(sorted(DECODERS))}; got {type(inner).__name__} ({model_type})")
    return DECODERS[model_type](inner), prefix


def _local_blocks(decoder, prefix: str, local_names: set[str]) -> list[nn.Module]:
    """The blocks this rank holds, in order; a block split between ranks is an error."""
    blocks = decoder.model.get_submodule(decoder.blocks)
    mine = []
    for index, block in enumerate(blocks):
        names = [f"{prefix}{decoder.blocks}.{index}.{name}" for name, _ in block.named_parameters()]
        held = sum(name in local_names for name in names)
        if held == len(names):
            mine.append(block)
        elif held:
            raise GenerationError(f"block {decoder.blocks}.{index} is split between pipeline stages; generation "
                                  f"needs whole blocks per stage: train with split_method=layer_split")
    return mine


def _sample(logits: torch.Tensor, options: GenerationOptions, generator: torch.Generator) -> int:
    """The next token from the last position's logits (float32, full vocabulary)."""
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


@contextlib.contextmanager
def _eval_sdpa(model: nn.Module, modules: list[nn.Module]):
    """Eval mode and SDPA attention (causal without a mask) for the duration of generation."""
    config = unwrap_peft(model)[0].config
    previous = config._attn_implementation
    training = [(m, m.training) for m in modules]
    config._attn_implementation = "sdpa"
    for module in modules:
        module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        config._attn_implementation = previous
        for module, mode in training:
            module.train(mode)


def generate(session, prompts, options: GenerationOptions) -> list[list[int]]:
    """Continue each prompt (a list of token ids); every rank returns every sequence."""
    state, engine, settings = session.state, session.engine, session.settings
    grid, coords = state.grid, state.coordinates
    if grid.tp > 1 and settings.trainer.sequence_parallel:
        raise GenerationError("generation with sequence_parallel=true is not supported: turn it off")
    if engine.num_chunks > 1:
        raise GenerationError("generation with interleaved schedules (pipeline_chunks > 1) is not supported")
    decoder, prefix = _decoder(session.model)
    blocks = _local_blocks(decoder, prefix, {name for name, _ in engine.named_parameters()})
    eos = getattr(decoder.model.config, "eos_token_id", None) if options.stop_at_eos else None
    run = _PipelineRun(decoder, blocks, state, dtype=engine.optimizer.precision.dtype,
                       vocab_parallel=grid.tp > 1 and settings.trainer.parallel_vocab)
    results = {}
    with _eval_sdpa(session.model, [*blocks, decoder.model]):
        for index, prompt in enumerate(prompts):
            if index % grid.dp == coords.dp:
                results[index] = run.continue_prompt(list(map(int, prompt)), options, eos,
                                                     torch.Generator().manual_seed(options.seed + index))
    merged = {}
    for part in groups.gather_from_all(results):
        merged.update(part)
    return [merged[i] for i in range(len(prompts))]


class _PipelineRun:
    """One rank's part of decoding: receive, run its blocks, send; the last stage picks tokens."""

    def __init__(self, decoder, blocks: list[nn.Module], state, *, dtype: torch.dtype, vocab_parallel: bool) -> None:
        self.decoder, self.blocks, self.state = decoder, blocks, state
        grid, rank = state.grid, state.rank
        self.first, self.last = state.is_first_stage, state.is_last_stage
        self.prev = grid.stage_rank(rank, state.coordinates.pp - 1) if not self.first else None
        self.next = grid.stage_rank(rank, state.coordinates.pp + 1) if not self.last else None
        self.last_rank = grid.stage_rank(rank, grid.pp - 1)
        self.dtype, self.vocab_parallel = dtype, vocab_parallel
        config = decoder.model.config
        self.hidden_size = getattr(config, "hidden_size", None) or config.n_embd

    def continue_prompt(self, tokens: list[int], options: GenerationOptions, eos: int | None,
                        generator: torch.Generator) -> list[int]:
        from transformers import DynamicCache

        cache, position = DynamicCache(), 0
        ids = torch.tensor([tokens], device=self.state.device)
        while len(tokens) < options.max_length:
            length = ids.shape[1]
            positions = torch.arange(position, position + length, device=self.state.device)[None]
            token = self._step(ids, positions, cache, options, generator)
            tokens.append(token)
            position += length
            ids = torch.tensor([[token]], device=self.state.device)
            if eos is not None and token == eos:
                break
        return tokens

    def _step(self, ids, positions, cache, options, generator) -> int:
        if self.first:
            hidden = self.decoder.embed(ids, positions).to(self.dtype)
        else:
            hidden = torch.empty(1, ids.shape[1], self.hidden_size, dtype=self.dtype, device=self.state.device)
            dist.recv(hidden, src=self.prev)
        for block in self.blocks:
            hidden = self.decoder.block(block, hidden, cache, positions)
        token = torch.zeros(1, dtype=torch.long, device=self.state.device)
        if self.last:
            logits = self.decoder.head(hidden[:, -1:]).float()[0, -1]
            if self.vocab_parallel:
                parts = [torch.empty_like(logits) for _ in range(self.state.grid.tp)]
                dist.all_gather(parts, logits.contiguous(), group=self.state.tp_group)
                logits = torch.cat(parts)
            token[0] = _sample(logits, options, generator)
        else:
            dist.send(hidden.contiguous(), dst=self.next)
        if self.state.grid.pp > 1:
            dist.broadcast(token, src=self.last_rank, group=self.state.pp_group)
        return int(token)
