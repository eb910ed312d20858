"""``merak.set_tp_layer_lists``: the original Merak's way to describe a TP plan, as a TPPlan.

The original matched these names as substrings of module names, which silently
caught unrelated modules. Here a plain name matches a module of exactly that
name, or whose qualified name ends with it (``query`` matches
``bert.encoder.layer.0.attention.self.query`` but not ``query_proj``), and
globs work the same way (``layer.*.output.dense``). Resolving the plan on the model
(:func:`merak.tensor_parallel.resolve_plan`) lists exactly what matched and
fails on names that match nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from merak.tensor_parallel.plan import TPPlan

_USER_PLAN: dict[str, TPPlan | None] = {"plan": None}


def _as_glob(name: str) -> str:
    return name if name.startswith("**") else f"**.{name}"


def set_tp_layer_lists(col_para_list: Sequence[str] | None = None, row_para_list: Sequence[str] | None = None,
                       input_output_mapping: Sequence[tuple[int, int, str]] | None = None,
                       weight_change_list: Sequence[tuple[str, int]] | None = None,
                       tp_attr_list: Sequence[str] | None = None) -> TPPlan:
    """Describe how a model without a built-in plan splits over tensor-parallel ranks.

    Args:
        col_para_list: names of linear layers split by output features (column parallel).
        row_para_list: names of linear layers split by input features (row parallel).
        input_output_mapping: ``(input, output, 'col' | 'row')``: linear layers whose
            input:output feature ratio is input:output get that style (fused query/key/value
            weights need an explicit ``TPPlan(fused=...)``).
        weight_change_list: ``(name, dim)``: a module's tensors, or one parameter, sliced
            along ``dim`` (per-head tables, normalizations between split layers).
        tp_attr_list: attributes divided by tp on every module that has them (head counts).

    Returns:
        The plan; it is also kept as the plan for models trained without a recipe plan
        (see :func:`user_plan`).
    """
    styles = {_as_glob(n): "column" for n in col_para_list or ()}
    for name in row_para_list or ():
        if _as_glob(name) in styles:
            raise ValueError(f"{name!r} is in both col_para_list and row_para_list")
        styles[_as_glob(name)] = "row"
    plan = TPPlan(styles=styles, sliced={_as_glob(n): int(d) for n, d in weight_change_list or ()},
                  any_attributes=tuple(tp_attr_list or ()),
                  ratios=tuple((int(i), int(o), str(s)) for i, o, s in input_output_mapping or ()))
    _USER_PLAN["plan"] = plan
    return plan


def user_plan() -> TPPlan | None:
    """The plan last described with :func:`set_tp_layer_lists` (None if never called)."""
    return _USER_PLAN["plan"]
