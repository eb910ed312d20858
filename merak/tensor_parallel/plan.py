"""TP plans (the "feature dict"): which modules of a model split how.

A :class:`TPPlan` is data: module-name globs (``*`` within one dotted part,
``**`` across parts) mapped to styles, attributes to divide by tp (head
counts), and tensors to slice. :func:`resolve_plan` matches it against a
model and reports exactly which modules change, or every problem at once (a
rule that matches nothing, a module matched twice, sizes not divisible by tp,
with the numbers). :func:`apply_plan` then turns the model into this rank's
shard in place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import nn

from merak.core.names import module_pattern
from merak.core.slices import TensorSlice, mark_partial, record_slice, slice_tensor_
from merak.tensor_parallel.layers import STYLES, ParallelContext, parallelize, weight_in_out
from merak.tensor_parallel.sequence import SequenceParallelPlan, install_sequence_parallel


class TPPlanError(ValueError):
    """The plan does not fit the model at this tp degree; the message lists every problem."""


@dataclass(frozen=True)
class TPPlan:
    """How a model splits over the tensor-parallel group.

    Attributes:
        styles: module glob -> ``column`` | ``row`` | ``conv_column`` | ``conv_row``.
        fused: column rule (the same glob) -> number of fused blocks (3 for a stacked
            query/key/value).
        vocab: module glob -> style, applied only with ``parallel_vocab``: ``vocab`` for
            embeddings, ``column`` for output layers (logits split by vocabulary).
        sliced: module or parameter glob -> dimension. A module gets every parameter and
            floating buffer with that dimension sliced (a batch norm between a column and
            a row convolution); a parameter path (``...relative_position_bias_table``)
            just that tensor (per-head tables).
        attributes: module glob -> attribute names divided by tp (``num_heads``).
        any_attributes: attribute names divided by tp on every module that has them.
        ratios: ``(in, out, style)``: linear layers whose input:output features are in
            this ratio get ``style`` (``col`` or ``row``), for models known only by shape.
        sequence: where the sequence-parallel region starts, gathers and ends (None:
            this model has no sequence-parallel plan).
        blocks: transformer-block globs for ``tp_overlapping_level=2`` (empty: not supported).
        heads: column or row rule (the same glob) -> features of one attention head: each
            rank must get whole heads (a key projection of 1 head of 8 features cannot
            split over 2 ranks, although 8 features can).
        partial: module globs whose replicated parameters see only this rank's part of
            the features (a per-head norm over the heads of a column layer): their
            gradients are summed over the tp group.
    """

    styles: Mapping[str, str] = field(default_factory=dict)
    fused: Mapping[str, int] = field(default_factory=dict)
    vocab: Mapping[str, str] = field(default_factory=dict)
    sliced: Mapping[str, int] = field(default_factory=dict)
    attributes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    any_attributes: tuple[str, ...] = ()
    ratios: tuple[tuple[int, int, str], ...] = ()
    sequence: SequenceParallelPlan | None = None
    blocks: tuple[str, ...] = ()
    heads: Mapping[str, int] = field(default_factory=dict)
    partial: tuple[str, ...] = ()


@dataclass(frozen=True)
class Change:
    """One module (or tensor) the plan changes."""

    name: str
    kind: str  # a style, 'sliced', 'attributes' or 'partial gradients'
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.name}: {self.kind}{f' ({self.detail})' if self.detail else ''}"


@dataclass
class ResolvedPlan:
    """A plan matched against one model: the exact changes, in module order."""

    tp: int
    layers: dict[str, tuple[str, int]]  # module name -> (style, fused parts)
    tensors: dict[tuple[str, str], int]  # (module name, tensor name) -> dimension
    attributes: dict[str, tuple[str, ...]]
    sequence: SequenceParallelPlan | None
    changes: list[Change]
    partial: tuple[str, ...] = ()  # modules whose parameters' gradients are summed over the tp group

    def describe(self) -> str:
        return "\n".join(str(c) for c in self.changes)


def _match(pattern: str, names: list[str]) -> list[str]:
    regex = module_pattern(pattern)
    return [n for n in names if regex.fullmatch(n)]


def _check_divisible(what: str, value: int, tp: int, problems: list[str]) -> None:
    if value % tp:
        problems.append(f"{what} = {value} is not divisible by tp={tp}")


def _layer_problems(name: str, module: nn.Module, style: str, parts: int, tp: int, head: int = 0) -> list[str]:
    problems: list[str] = []
    if style in ("column", "row"):
        try:
            in_out = weight_in_out(module)
        except TypeError as error:
            return [f"{name}: {error}"]
        rows, cols = module.weight.shape
        out_features, in_features = (cols, rows) if in_out else (rows, cols)
        if style == "column":
            _check_divisible(f"{name} output features" + (f" per fused block ({parts} blocks)" if parts > 1 else ""),
                             out_features // parts if out_features % parts == 0 else out_features, tp, problems)
        else:
            _check_divisible(f"{name} input features", in_features, tp, problems)
        split = (out_features // parts if style == "column" else in_features)
        if head and not problems and split % head == 0:
            _check_divisible(f"{name} attention heads ({head} features each)", split // head, tp, problems)
    elif style == "vocab":
        if not isinstance(module, nn.Embedding):
            return [f"{name}: vocab style needs nn.Embedding, got {type(module).__name__}"]
        _check_divisible(f"{name} vocabulary size", module.num_embeddings, tp, problems)
        if problems:
            padded = -(-module.num_embeddings // (128 * tp)) * 128 * tp
            problems[-1] += f" (pad the vocabulary, e.g. to {padded}, or turn parallel_vocab off)"
    elif style in ("conv_column", "conv_row"):
        if not isinstance(module, nn.Conv2d) or module.groups != 1:
            return [f"{name}: {style} needs an nn.Conv2d with groups=1, got {type(module).__name__}"]
        channels = module.out_channels if style == "conv_column" else module.in_channels
        _check_divisible(f"{name} {'output' if style == 'conv_column' else 'input'} channels", channels, tp, problems)
    else:
        problems.append(f"{name}: unknown style {style!r}; choose from {', '.join(STYLES)}")
    return problems


def resolve_plan(model: nn.Module, plan: TPPlan, *, tp: int, parallel_vocab: bool = False,
                 sequence_parallel: bool = False) -> ResolvedPlan:
    """Match ``plan`` against ``model`` for ``tp`` ranks (pure: the model is not changed).

    Raises:
        TPPlanError: listing every rule that matches nothing, every module matched
            twice and every size not divisible by ``tp``.
    """
    modules = dict(model.named_modules())
    names = list(modules)
    problems: list[str] = []
    layers: dict[str, tuple[str, int]] = {}
    rules = dict(plan.styles)
    if parallel_vocab:
        if not plan.vocab:
            problems.append("parallel_vocab=true but this model's TP plan has no vocabulary rules")
        rules.update(dict(plan.vocab.items()))
    for pattern in plan.fused:
        if rules.get(pattern) != "column":
            problems.append(f"fused {pattern!r} must also be a column rule (the same glob)")
    for pattern in plan.heads:
        if rules.get(pattern) not in ("column", "row"):
            problems.append(f"heads {pattern!r} must also be a column or row rule (the same glob)")
    for pattern, style in rules.items():
        matched = _match(pattern, names)
        if not matched:
            problems.append(f"rule {pattern!r} ({style}) matches no module; names look like {names[1:6]}")
        parts = plan.fused.get(pattern, 1)
        for name in matched:
            if name in layers:
                problems.append(f"module {name!r} is matched twice ({layers[name][0]} and {style})")
                continue
            layers[name] = (style, parts)
            problems.extend(_layer_problems(name, modules[name], style, parts, tp, plan.heads.get(pattern, 0)))
    for name, style in _ratio_matches(modules, plan.ratios, problems).items():
        if name not in layers:
            layers[name] = (style, 1)
            problems.extend(_layer_problems(name, modules[name], style, 1, tp))
    tensors: dict[tuple[str, str], int] = {}
    for pattern, dim in plan.sliced.items():
        found = _sliced_tensors(model, modules, pattern, dim)
        if not found:
            problems.append(f"sliced {pattern!r} matches no module or parameter")
        for (module_name, tensor_name), tensor in found.items():
            if module_name in layers:
                problems.append(f"{module_name!r} is both a {layers[module_name][0]} layer and sliced")
            reason = TensorSlice(dim=dim, rank=0, size=tp).problem(tuple(tensor.shape))
            if reason:
                problems.append(f"{module_name}.{tensor_name} {reason}")
            tensors[(module_name, tensor_name)] = dim
    attributes: dict[str, tuple[str, ...]] = {}
    for pattern, attrs in plan.attributes.items():
        matched = _match(pattern, names)
        if not matched:
            problems.append(f"attributes rule {pattern!r} matches no module")
        for name in matched:
            for attr in attrs:
                value = getattr(modules[name], attr, None)
                if not isinstance(value, int):
                    problems.append(f"{name}.{attr} is {value!r}, not an integer attribute to divide by tp")
                else:
                    _check_divisible(f"{name}.{attr}", value, tp, problems)
            attributes[name] = tuple(attrs)
    for attr in plan.any_attributes:
        owners = [n for n in names if isinstance(getattr(modules[n], attr, None), int)]
        if not owners:
            problems.append(f"no module has an integer attribute {attr!r} to divide by tp")
        for name in owners:
            _check_divisible(f"{name}.{attr}", getattr(modules[name], attr), tp, problems)
            attributes[name] = tuple(dict.fromkeys((*attributes.get(name, ()), attr)))
    partial = _partial_modules(plan.partial, names, layers, problems)
    sequence = plan.sequence if sequence_parallel else None
    if sequence_parallel:
        if plan.sequence is None:
            problems.append("sequence_parallel=true but this model's TP plan has no sequence-parallel region: set "
                            "trainer.sequence_parallel=false")
        else:
            problems.extend(plan.sequence.problems(names))
    if problems:
        raise TPPlanError(f"the tensor-parallel plan does not fit {type(model).__name__} at tp={tp}:\n  - "
                          + "\n  - ".join(problems))
    changes = [Change(n, style, f"{parts} fused blocks" if parts > 1 else "") for n, (style, parts) in layers.items()]
    changes += [Change(f"{m}.{t}", "sliced", f"dimension {d}") for (m, t), d in tensors.items()]
    changes += [Change(n, "attributes", ", ".join(a)) for n, a in attributes.items()]
    changes += [Change(n, "partial gradients", "summed over the tp group") for n in partial]
    order = {n: i for i, n in enumerate(names)}
    changes.sort(key=lambda c: order.get(c.name, order.get(c.name.rsplit(".", 1)[0], len(order))))
    return ResolvedPlan(tp=tp, layers=layers, tensors=tensors, attributes=attributes, sequence=sequence,
                        changes=changes, partial=partial)


def _partial_modules(patterns, names: list[str], layers: dict, problems: list[str]) -> tuple[str, ...]:
    """The modules of ``partial`` rules; a split layer's gradients are its own slice, never partial."""
    found: dict[str, None] = {}
    for pattern in patterns:
        matched = _match(pattern, names)
        if not matched:
            problems.append(f"partial {pattern!r} matches no module")
        for name in matched:
            if name in layers:
                problems.append(f"{name!r} is both a {layers[name][0]} layer and partial")
            found[name] = None
    return tuple(found)


def _ratio_matches(modules: dict[str, nn.Module], ratios, problems: list[str]) -> dict[str, str]:
    """Linear layers whose input:output feature ratio is one of ``ratios`` -> column or row."""
    styles = {"col": "column", "column": "column", "row": "row"}
    found: dict[str, str] = {}
    for ratio_in, ratio_out, style in ratios:
        if style not in styles:
            problems.append(f"input_output_mapping style {style!r}; use 'col' or 'row'")
            continue
        matched = []
        for name, module in modules.items():
            try:
                in_out = weight_in_out(module)
            except TypeError:
                continue
            rows, cols = module.weight.shape
            features_in, features_out = (rows, cols) if in_out else (cols, rows)
            if features_in * ratio_out == features_out * ratio_in:
                matched.append(name)
                found[name] = styles[style]
        if not matched:
            problems.append(f"input_output_mapping ({ratio_in}, {ratio_out}, {style!r}) matches no linear layer")
    return found


def _sliced_tensors(model: nn.Module, modules: dict[str, nn.Module], pattern: str, dim: int) -> dict:
    """(module name, tensor name) -> tensor for a ``sliced`` rule: a module's tensors or one parameter."""
    found = {}
    for name in _match(pattern, list(modules)):
        module = modules[name]
        for tensor_name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if tensor is not None and tensor.is_floating_point() and tensor.dim() > dim:
                found[(name, tensor_name)] = tensor
    if not found:
        for path, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if module_pattern(pattern).fullmatch(path):
                module_name, _, tensor_name = path.rpartition(".")
                found[(module_name, tensor_name)] = tensor
    return found


def apply_plan(model: nn.Module, resolved: ResolvedPlan, ctx: ParallelContext) -> None:
    """Turn ``model`` into rank ``ctx.rank``'s tensor-parallel shard, in place."""
    modules = dict(model.named_modules())
    memo: dict = {}
    sequence = resolved.sequence
    regions = sequence.region_modules(list(modules)) if sequence else set()
    exits = sequence.exit_modules(list(modules)) if sequence else set()
    for name, (style, parts) in resolved.layers.items():
        # A column layer's input is replicated, except with sequence parallelism inside a
        # region (the region gathered it) or as the region's exit (it gathers by itself).
        input_comm = "copy"
        if any(name == r or name.startswith(r + ".") for r in regions):
            input_comm = "none"
        elif name in exits:
            input_comm = "gather"
        layer_ctx = ctx if style in ("column", "row") else ParallelContext(ctx.rank, ctx.size, ctx.group)
        parallelize(modules[name], style, layer_ctx, memo, parts=parts, input_comm=input_comm)
    for (module_name, tensor_name), dim in resolved.tensors.items():
        slice_tensor_(modules[module_name], tensor_name, TensorSlice(dim=dim, rank=ctx.rank, size=ctx.size), memo)
    _retie(model, memo)
    for name, attrs in resolved.attributes.items():
        for attr in attrs:
            setattr(modules[name], attr, getattr(modules[name], attr) // ctx.size)
    for name in resolved.partial:
        for param in modules[name].parameters():
            mark_partial(param)
    if resolved.sequence is not None:
        column_layers = {n for n, (style, _) in resolved.layers.items() if style == "column"}
        install_sequence_parallel(model, resolved.sequence, ctx, gathers_itself=column_layers)


def _retie(model: nn.Module, memo: dict) -> None:
    """Point every other holder of a sliced parameter at its piece (BERT's ``cls.predictions.bias``
    is ``cls.predictions.decoder.bias``), with the same recorded slice."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in memo:
                piece, spec, _ = memo[id(param)]
                module._parameters[name] = piece
                record_slice(module, name, spec)
