"""The llama recipe's data: the gpt recipe's causal-language-model text (any Hugging Face tokenizer,
local files, the offline documentation text), used as it is."""

from recipes.gpt.data import check_data, load, prepare

__all__ = ["check_data", "load", "prepare"]
