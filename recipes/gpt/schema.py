"""Every key of the gpt recipe's ``model`` and ``data`` config groups, with its type, default and range
(merak checks each value against them before ``check_layout`` and ``check_data`` run)."""

from __future__ import annotations

from dataclasses import dataclass

from merak.core.fields import setting
from recipes.schema import TransformerSizes
from recipes.text_schema import TextSource


@dataclass(frozen=True)
class GptModel(TransformerSizes):
    """A GPT-2 (``conf/model/*.yaml``); ``seq_length`` is also its position table."""


@dataclass(frozen=True)
class GptData(TextSource):
    """Causal-LM text (``conf/data/*.yaml``), tokenized by ``tokenizer``."""

    tokenizer: str = setting("gpt2", "gpt2 (the offline GPT-2 BPE), or a Hugging Face tokenizer: a directory "
                                     "holding tokenizer.json or a hub name; must fit model.vocab_size")
