"""Every key of the bert recipe's ``model`` and ``data`` config groups, with its type, default and range
(merak checks each value against them before ``check_layout`` and ``check_data`` run)."""

from __future__ import annotations

from dataclasses import dataclass

from merak.core.fields import setting
from recipes.schema import TransformerSizes, positive_int
from recipes.text_schema import SelfTrainedText


@dataclass(frozen=True)
class BertModel(TransformerSizes):
    """A BertForMaskedLM (``conf/model/*.yaml``); ``seq_length`` is also its position table."""

    ffn_size: int = positive_int(128, "width of each layer's feed-forward block")


def mask_probability(value: float) -> bool:
    """A fraction of the words to predict: some, at most all."""
    return 0 < value <= 1


@dataclass(frozen=True)
class BertData(SelfTrainedText):
    """Masked-LM samples (``conf/data/*.yaml``): text under a trained WordPiece vocabulary, or synthetic."""

    mask_prob: float = setting(0.15, "fraction of the tokens chosen for prediction (80 % [MASK], 10 % random, "
                                     "10 % kept)", check=mask_probability, requirement="must be in (0, 1]")
