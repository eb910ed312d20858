"""Config fields every recipe's ``model`` group has, those the one-stack language models share, and
the field makers and ranges the recipes' schemas use.

A recipe's ``model_schema`` / ``data_schema`` (merak.recipe.RecipeSpec) lists every key of its
``conf/model/*.yaml`` / ``conf/data/*.yaml`` as a field: merak checks each value's type and range
against it before the recipe's ``check_layout`` / ``check_data`` run, so those only relate values
to each other and to the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from merak.core.fields import finite, positive, setting

POSITIVE_INTEGER = "must be a positive integer"


def positive_int(default: int | None, help: str):
    """A field holding a count or a size: an integer >= 1."""
    return setting(default, help, check=positive, requirement=POSITIVE_INTEGER)


def dropout_rate(value: float) -> bool:
    """A probability of dropping an activation: 1 would drop everything."""
    return finite(value) and 0 <= value < 1


def dropout_probability(help: str = "dropout probability (0: every layout gives the same numbers)"):
    """A field holding a dropout probability, within [0, 1)."""
    return setting(0.0, help, check=dropout_rate, requirement="must be within [0, 1)")


def positive_items(values: list) -> bool:
    """A non-empty list of numbers >= 1."""
    return bool(values) and all(value >= 1 for value in values)


@dataclass(frozen=True)
class ModelOption:
    """What every model option (``conf/model/<option>.yaml``) names besides its sizes."""

    name: str = setting("toy", "the option's name (the yaml's stem): logs, summary.json")
    global_batch_size: int = positive_int(16, "recommended sequences or images per optimizer step "
                                              "(documentation: nothing reads it)")


@dataclass(frozen=True)
class TransformerSizes(ModelOption):
    """The sizes of a one-stack transformer language model (gpt, bert, llama)."""

    vocab_size: int = positive_int(50257, "rows of the token embedding (must hold the tokenizer's ids)")
    seq_length: int = positive_int(32, "tokens per sample")
    hidden_size: int = positive_int(32, "width of the hidden state")
    num_layers: int = positive_int(4, "transformer blocks")
    num_heads: int = positive_int(4, "attention heads (hidden_size must divide by them)")
    dropout: float = dropout_probability()
