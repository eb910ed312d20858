"""Graph capture: turn an unmodified model into one flat ``torch.fx.GraphModule``.

``'fx'`` (the default) tries ``torch.fx`` symbolic tracing and, when that
fails (Hugging Face models of the library's version 5 do), falls back to
``torch.export``; ``'dynamo'`` uses ``torch.export`` directly. The captured
module holds references to the model's own parameters (never copies), so
stages cut from it train the model's weights.

What comes out is normalised for graph sharding: placeholders are the model
inputs named in ``input_names``; every node records the module it came from
(``nn_module_stack``), leaf modules stay whole (fx keeps them as single
``call_module`` nodes; with export their nodes are grouped so no cut falls
inside them).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from merak.trace import reuse

logger = logging.getLogger(__name__)

TRACE_METHODS = ("fx", "dynamo")


class TraceError(RuntimeError):
    """The model could not be captured; the message names the module and operation that failed."""


@dataclass
class CapturedGraph:
    """A model captured as a graph.

    Attributes:
        module: the flat GraphModule (parameters shared with the model).
        method: ``'fx'`` or ``'export'`` — what produced ``module``.
        input_names: model inputs, in placeholder order.
        output_spec: for export captures, the pytree spec that rebuilds the model's
            output from the flat graph outputs (None for fx: its graph builds the output).
        leaf_scopes: qualified names of leaf-module instances whose nodes must stay in one shard.
        notes: why a fallback happened, for logs and dry-run reports.
        key: the model's fingerprint in a run that reuses captures (merak.trace.reuse), else None;
            what is derived from the graph alone can be remembered under it.
    """

    module: fx.GraphModule
    method: str
    input_names: list[str]
    output_spec: pytree.TreeSpec | None = None
    leaf_scopes: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)
    key: str | None = None


def _is_leaf_instance(module: nn.Module, qualname: str, leaf_modules: Sequence) -> bool:
    for leaf in leaf_modules:
        if isinstance(leaf, str):
            if qualname == leaf or type(module).__name__ == leaf:
                return True
        elif isinstance(leaf, type) and isinstance(module, leaf):
            return True
    return False


class _ScopeTracer(fx.Tracer):
    """fx tracer that keeps user leaf modules whole and remembers where tracing failed."""

    def __init__(self, leaf_modules: Sequence) -> None:
        super().__init__()
        self.leaf_modules = tuple(leaf_modules)
        self.scope_stack: list[tuple[str, str]] = []
        self.failed_in: tuple[str, str] | None = None

    def is_leaf_module(self, module: nn.Module, qualname: str) -> bool:
        return _is_leaf_instance(module, qualname, self.leaf_modules) or super().is_leaf_module(module, qualname)

    def call_module(self, module, forward, args, kwargs):
        qualname = self.path_of_module(module)
        self.scope_stack.append((qualname, type(module).__name__))
        try:
            result = super().call_module(module, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:  # the innermost module is where it broke
                self.failed_in = self.scope_stack[-1]
            raise
        self.scope_stack.pop()
        return result


@contextlib.contextmanager
def _training_capture_config(model: nn.Module):
    """Hugging Face models: no KV cache while capturing (a cache is not a graph output)."""
    config = getattr(model, "config", None)
    saved = getattr(config, "use_cache", None)
    if saved:
        config.use_cache = False
    try:
        yield
    finally:
        if saved:
            config.use_cache = saved


def forward_parameter_names(model: nn.Module) -> list[str]:
    """Names of the positional-or-keyword parameters of ``model.forward``."""
    params = inspect.signature(model.forward).parameters.values()
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _check_input_names(model: nn.Module, input_names: Sequence[str]) -> None:
    known = forward_parameter_names(model)
    unknown = [name for name in input_names if name not in known]
    if unknown:
        raise TraceError(f"input_names {unknown} are not arguments of {type(model).__name__}.forward; "
                         f"it takes {known}")


def _capture_fx(model: nn.Module, input_names: Sequence[str], leaf_modules: Sequence) -> fx.GraphModule:
    arguments = [p for p in inspect.signature(model.forward).parameters.values()
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    concrete = {p.name: p.default for p in arguments
                if p.name not in input_names and p.default is not inspect.Parameter.empty}
    tracer = _ScopeTracer(leaf_modules)
    try:
        graph = tracer.trace(model, concrete_args=concrete)
    except Exception as error:
        where = tracer.failed_in
        location = f"in module '{where[0] or '<root>'}' ({where[1]})" if where else "at the top level"
        raise TraceError(f"torch.fx could not trace {type(model).__name__} {location}: "
                         f"{type(error).__name__}: {error}") from error
    # Arguments outside input_names were fixed (concrete_args); fx still keeps placeholders for them
    # (one per argument, in signature order), read only by its specialization checks. Put the fixed
    # value in their place so the graph's inputs are exactly input_names.
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(arguments):  # *args / **kwargs in the signature
        raise TraceError(f"torch.fx made {len(placeholders)} inputs for {type(model).__name__}.forward's "
                         f"{len(arguments)} named arguments; variadic arguments are not traced by fx")
    for argument, node in zip(arguments, placeholders):
        if argument.name in input_names:
            continue

        value = concrete.get(argument.name)

        def fixed(arg: fx.Node, placeholder=node, constant=value):
            return constant if arg is placeholder else arg

        for user in list(node.users):
            user.args = fx.node.map_arg(user.args, fixed)
            user.kwargs = fx.node.map_arg(user.kwargs, fixed)
        graph.erase_node(node)
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def _capture_export(model: nn.Module, example_inputs: Mapping[str, torch.Tensor]
                    ) -> tuple[fx.GraphModule, pytree.TreeSpec]:
    try:
        program = torch.export.export(model, (), dict(example_inputs), strict=False)
    except Exception as error:
        raise TraceError(f"torch.export could not capture {type(model).__name__}: "
                         f"{type(error).__name__}: {_first_lines(error)}") from error
    module = program.module()
    graph = module.graph
    # Shape guards and the pytree codegen are replaced by merak's own boundary handling.
    for node in list(graph.nodes):
        if node.op == "call_module" and not node.users and str(node.target).startswith("_guards"):
            graph.erase_node(node)
    graph.set_codegen(fx.graph.CodeGen())
    module.recompile()
    return module, program.call_spec.out_spec


def _export_stack_once(model: nn.Module, examples: Mapping[str, torch.Tensor], notes: list[str]
                       ) -> tuple[fx.GraphModule, pytree.TreeSpec]:
    """torch.export, with a long stack of identical blocks exported three blocks deep and repeated
    (merak.trace.repeat) when its blocks repeat exactly."""
    from merak.trace.repeat import capture_with_repeats

    repeated = capture_with_repeats(model, lambda shortened: _capture_export(shortened, examples))
    if repeated is None:
        return _capture_export(model, examples)
    module, out_spec, note = repeated
    notes.append(note)
    return module, out_spec


def _first_lines(error: Exception, count: int = 6) -> str:
    return "\n".join(str(error).strip().splitlines()[:count])


def _leaf_scopes(model: nn.Module, leaf_modules: Sequence) -> set[str]:
    return {name for name, module in model.named_modules() if name and _is_leaf_instance(module, name, leaf_modules)}


def capture(model: nn.Module, example_inputs: Mapping[str, torch.Tensor], *, method: str | None = "fx",
            input_names: Sequence[str] | None = None, leaf_modules: Sequence = ()) -> CapturedGraph:
    """Capture ``model`` as a flat graph over the inputs ``input_names``.

    Args:
        model: the unmodified model (real or meta parameters).
        example_inputs: name -> example tensor; export specializes the graph to these shapes.
        method: ``'fx'`` (torch.fx, falling back to torch.export) or ``'dynamo'`` (torch.export).
        input_names: which forward arguments are graph inputs (default: the keys of example_inputs).
        leaf_modules: module classes, class names or qualified names to keep whole.

    Raises:
        TraceError: naming the module and operation that failed, suggesting ``leaf_modules``.
    """
    if method not in TRACE_METHODS:
        raise ValueError(f"trace_method={method!r}; choose one of {TRACE_METHODS} (or None for no tracing)")
    input_names = list(input_names or example_inputs)
    missing = [name for name in input_names if name not in example_inputs]
    if missing:
        raise TraceError(f"no example value for inputs {missing}; the data provides {sorted(example_inputs)}")
    _check_input_names(model, input_names)
    examples = {name: example_inputs[name] for name in input_names}
    leaf_scopes = _leaf_scopes(model, leaf_modules)
    key = reuse.fingerprint(model, examples, (method, input_names, leaf_modules)) if reuse.active() else None
    reused = reuse.recall(key, model)
    if reused is not None:
        module, fields = reused
        logger.info("captured %s with %s (%d nodes, rebuilt from this run's first capture)", type(model).__name__,
                    "torch.fx" if fields["method"] == "fx" else "torch.export", len(module.graph.nodes))
        return CapturedGraph(module, leaf_scopes=leaf_scopes, key=key, **{**fields, "notes": list(fields["notes"])})
    captured = _capture_anew(model, examples, method, input_names, leaf_modules)
    captured.leaf_scopes, captured.key = leaf_scopes, key
    reuse.remember(key, model, captured.module, {"method": captured.method, "input_names": captured.input_names,
                                                 "output_spec": captured.output_spec, "notes": list(captured.notes)})
    return captured


def _capture_anew(model: nn.Module, examples: Mapping[str, torch.Tensor], method: str, input_names: list[str],
                  leaf_modules: Sequence) -> CapturedGraph:
    notes: list[str] = []
    with _training_capture_config(model):
        if method == "fx":
            try:
                module = _capture_fx(model, input_names, leaf_modules)
                logger.info("captured %s with torch.fx (%d nodes)", type(model).__name__, len(module.graph.nodes))
                ordered = [str(n.target) for n in module.graph.nodes if n.op == "placeholder"]
                return CapturedGraph(module, "fx", ordered, None, notes=notes)
            except TraceError as fx_error:
                notes.append(f"torch.fx failed, used torch.export: {_first_lines(fx_error, 2)}")
                # Expected for most Hugging Face models, so not news; if export fails too, the error names both.
                logger.debug("%s", notes[-1])
                try:
                    module, out_spec = _export_stack_once(model, examples, notes)
                except TraceError as export_error:
                    raise TraceError(f"{fx_error}\n{export_error}\n{_LEAF_HINT}") from export_error
        else:
            try:
                module, out_spec = _export_stack_once(model, examples, notes)
            except TraceError as export_error:
                raise TraceError(f"{export_error}\n{_LEAF_HINT}") from export_error
    logger.info("captured %s with torch.export (%d nodes)", type(model).__name__, len(module.graph.nodes))
    return CapturedGraph(module, "export", input_names, out_spec, notes=notes)


_LEAF_HINT = ("If a submodule cannot be traced, name it in leaf_modules (its class, class name or "
              "qualified name) so it is kept whole, or set trace_method=None and supply the stages.")


class RebuildOutput(nn.Module):
    """Rebuilds the model's output structure (e.g. a ModelOutput) from an exported graph's flat outputs."""

    def __init__(self, spec: pytree.TreeSpec) -> None:
        super().__init__()
        self.spec = spec

    def forward(self, flat):
        return pytree.tree_unflatten(list(flat), self.spec)
