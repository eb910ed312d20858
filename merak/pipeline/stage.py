"""Pipeline stages: the modules each rank runs, cut from one full model.

A stage is a sequence of parts; the payload returned by one part is passed to
the next, and the payload returned by the stage crosses to the next stage
(any pytree). The first stage receives the microbatch's model inputs as a
dict; the last stage's output goes to the loss function. Stages hold
references to the full model's modules, so parameters shared between stages
(tied weights) are recognised by identity.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from merak.core.partition import uniform_boundaries
from merak.pipeline import memory, recompute, selective
from merak.pipeline.compiled import CompiledParts, running_eagerly
from merak.pipeline.settings import CompileSettings


class StageModule(nn.Module):
    """One pipeline stage: ``parts`` applied in order to the incoming payload.

    Args:
        parts: The stage's parts (shards of the captured graph, or blocks).
        first_part: Index of ``parts[0]`` among all parts of the model; parts
            reseed dropout by their model-wide index (merak.pipeline.recompute).
    """

    def __init__(self, parts: Sequence[nn.Module], first_part: int = 0) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.first_part = first_part
        self.checkpoint_options = recompute.StageRecomputation()
        self._selective = None  # selective recomputation's policy (merak.pipeline.selective), if any
        self.compiled: CompiledParts | None = None

    def compile_parts(self, options: CompileSettings, where: str = "stage", *, retains_graph: bool = False) -> None:
        """Run the parts through ``torch.compile`` (merak.pipeline.compiled.CompiledParts); call it after
        the stage was moved and cast. Disabled options switch compilation off again."""
        self.compiled = CompiledParts(self.parts, options, where, retains_graph=retains_graph) \
            if options.enabled else None

    def configure_checkpointing(self, options: recompute.StageRecomputation) -> None:
        """Checkpoint the first ``options.parts`` parts in chunks of ``options.num_layers``, keeping
        what ``options.saves`` names inside them (None: only the chunk inputs)."""
        if not 0 <= options.parts <= len(self.parts) or options.num_layers < 1:
            raise ValueError(f"cannot checkpoint {options.parts} parts in chunks of {options.num_layers} "
                             f"of a stage with {len(self.parts)} parts")
        self._selective = selective.SelectiveContexts(options.saves) if options.saves is not None else None
        self.checkpoint_options = options

    def forward(self, payload):
        options = self.checkpoint_options
        checkpointed = options.parts if recompute.checkpointing_mode() == "configured" and torch.is_grad_enabled() \
            else 0
        # The seed and the choice of compiled code are arguments, so the recomputation inside the
        # backward (after the microbatch's contexts have ended) runs exactly as the first run did.
        seed = recompute.current_seed()
        compiled = self.compiled if not running_eagerly() else None
        for start in range(0, checkpointed, options.num_layers):
            stop = min(start + options.num_layers, checkpointed)
            memory.note_kept(payload)  # the checkpoint keeps its inputs for the recomputation
            with recompute.checkpointed_part():
                payload = checkpoint(self._run, start, stop, payload, seed, compiled, use_reentrant=False,
                                     **self._selective_arguments())
                if self._selective is not None:
                    self._selective.finish()
        return self._run(checkpointed, len(self.parts), payload, seed, compiled)

    def _selective_arguments(self) -> dict:
        """``checkpoint``'s keyword for selective recomputation (none for full recomputation)."""
        return {"context_fn": self._selective} if self._selective is not None else {}

    def _run(self, start: int, stop: int, payload, seed: int | None, compiled: CompiledParts | None):
        if compiled is not None and seed is None:
            return compiled.run(start, stop, payload)  # nothing to reseed: one graph for the range
        for index in range(start, stop):
            recompute.reseed_part(seed, self.first_part + index)
            payload = self.parts[index](payload) if compiled is None else compiled.run(index, index + 1, payload)
        return payload


def stages_from_blocks(first: nn.Module, blocks: Sequence[nn.Module], last: nn.Module,
                       num_stages: int) -> list[StageModule]:
    """Cut ``first, *blocks, last`` into stages with balanced block counts.

    ``first`` (e.g. embeddings) joins the first stage and ``last`` (e.g. the
    head) the last stage; the blocks are spread so counts differ by at most one.
    """
    bounds = uniform_boundaries(len(blocks), num_stages)
    stages = []
    for stage in range(num_stages):
        parts = list(blocks[bounds[stage]:bounds[stage + 1]])
        if stage == 0:
            parts.insert(0, first)
        if stage == num_stages - 1:
            parts.append(last)
        stages.append(StageModule(parts, first_part=bounds[stage] + (1 if stage > 0 else 0)))
    return stages


@dataclass(frozen=True)
class TiedParameter:
    """A parameter held by several stages (e.g. GPT-2's token embedding and LM head)."""

    name: str  # the full model's name for it
    stages: tuple[int, ...]


def parameter_names(model: nn.Module) -> dict[int, str]:
    """Map ``id(parameter)`` to the full model's (first) name for it."""
    return {id(param): name for name, param in model.named_parameters()}


def parameter_aliases(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """First name of each parameter -> every name it has in ``model`` (a tied weight has several)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {found[0]: tuple(found) for found in names.values()}


def persistent_buffer_names(model: nn.Module) -> dict[int, str]:
    """Map ``id(buffer)`` to the full model's name, for buffers saved in a state dict."""
    out = {}
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                out.setdefault(id(buffer), f"{module_name}.{name}" if module_name else name)
    return out


def find_tied_parameters(model: nn.Module, stages: Sequence[nn.Module]) -> list[TiedParameter]:
    """Parameters that appear in more than one stage, found by identity (never by shape)."""
    names = parameter_names(model)
    owners: dict[int, list[int]] = {}
    for stage_id, stage in enumerate(stages):
        for param in stage.parameters():
            owners.setdefault(id(param), []).append(stage_id)
    tied = [TiedParameter(name=names[key], stages=tuple(ids)) for key, ids in owners.items() if len(ids) > 1]
    return sorted(tied, key=lambda t: t.name)
