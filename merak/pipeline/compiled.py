"""Compiled stages: each run of a stage's parts as one ``torch.compile`` graph.

A stage runs its parts (shards of the captured graph) in ranges: a checkpointed
chunk, the rest of the stage, or every part when recomputation is off. Each
range is compiled once into one graph, forward and backward, so inductor fuses
across the parts of the range and the host makes one call per range instead of
one per operator. A range is handed to ``torch.compile`` as a small
``fx.GraphModule`` that calls its parts in order: every range has code of its
own, so dynamo keeps one cache per range (a shared function would hit its
recompilation limit after eight ranges).

Stages whose parts reseed dropout (merak.pipeline.recompute) run one part per
range, with the reseeding between the compiled calls, so recomputation redraws
the masks of the first run. Random numbers inside an inductor graph are drawn
from seeds taken from the reseeded generator: reproducible, but not the same
masks as eager PyTorch.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import fx, nn

from merak.pipeline.settings import CompileSettings

logger = logging.getLogger(__name__)

def range_module(parts: Sequence[nn.Module], start: int, stop: int) -> fx.GraphModule:
    """A graph module calling ``parts[start:stop]`` in order, each on the previous one's payload.

    It holds the parts themselves (the same modules, parameters and buffers), under the names
    ``part_<index>``.
    """
    root = nn.Module()
    graph = fx.Graph()
    payload = graph.placeholder("payload")
    for index in range(start, stop):
        name = f"part_{index}"
        root.add_module(name, parts[index])
        payload = graph.call_module(name, (payload,))
    graph.output(payload)
    return fx.GraphModule(root, graph, class_name=f"Parts{start}to{stop}")


class CompiledParts:
    """The compiled ranges of one stage's parts, made on first use.

    Args:
        parts: the stage's parts (kept by reference; not registered as submodules).
        options: compile settings.
        where: names the stage in warnings.
        retains_graph: the schedule runs each backward in two calls (input gradients, then weight
            gradients) over one autograd graph, which must then keep every buffer the compiled
            backward reads (no donated buffers).
    """

    def __init__(self, parts: Sequence[nn.Module], options: CompileSettings, where: str, *,
                 retains_graph: bool = False) -> None:
        self._parts = list(parts)
        self.options = options
        self.where = where
        self.retains_graph = retains_graph
        self._ranges: dict[tuple[int, int], Callable] = {}
        self._eager: set[tuple[int, int]] = set()

    def run(self, start: int, stop: int, payload):
        """Run parts ``start`` to ``stop - 1`` on ``payload`` (compiled unless compilation failed)."""
        if start == stop:  # e.g. the rest of a stage whose every part is checkpointed
            return payload
        key = (start, stop)
        if key in self._eager:
            return self._run_eager(start, stop, payload)
        compiled = self._ranges.get(key)
        if compiled is None:
            module = range_module(self._parts, start, stop)
            # Captured graphs hold their shapes as constants: nothing is gained by dynamic shapes.
            compiled = torch.compile(module.forward, backend=self.options.backend,
                                     mode=self.options.effective_mode, dynamic=False)
            if self.retains_graph:
                compiled = torch._functorch.config.patch(donated_buffer=False)(compiled)
            self._ranges[key] = compiled
        try:
            return compiled(payload)
        except torch._dynamo.exc.TorchDynamoException as error:
            # Compilation failed before anything ran: this range runs eagerly from now on.
            logger.warning("%s: parts %d-%d cannot be compiled and run eagerly (%s: %s)", self.where, start,
                           stop - 1, type(error).__name__, str(error).splitlines()[0] if str(error) else "")
            self._eager.add(key)
            return self._run_eager(start, stop, payload)

    def _run_eager(self, start: int, stop: int, payload):
        for index in range(start, stop):
            payload = self._parts[index](payload)
        return payload

    @property
    def eager_ranges(self) -> list[tuple[int, int]]:
        """Ranges that fell back to eager execution, as (first part, last part + 1)."""
        return sorted(self._eager)


_eager = {"active": False}


@contextlib.contextmanager
def eager_execution() -> Iterator[None]:
    """Run stages eagerly inside the block, without compiling or caching anything.

    Operator-counting modes (``FlopCounterMode``) need it: dynamo does not trace under a dispatch
    mode, and a first call it skipped is never compiled afterwards. Stages remember the choice for
    the parts they checkpoint, so the recomputation saves what the first run saved.
    """
    previous = _eager["active"]
    _eager["active"] = True
    try:
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        _eager["active"] = previous


def running_eagerly() -> bool:
    """Whether :func:`eager_execution` is active."""
    return _eager["active"]


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (dynamo, AOTAutograd and the backend,
    forward and backward graphs)."""
    spent = torch._dynamo.utils.calculate_time_spent()
    return float(spent.get("total_wall_time", 0.0))


class CompileClock:
    """Compile seconds since it was made (compilation is process-wide, runs are not)."""

    def __init__(self) -> None:
        self._start = compile_seconds()

    def seconds(self) -> float:
        """Compile seconds since the clock was made."""
        return compile_seconds() - self._start
