"""Text sources and token caches shared by the language-model recipes (gpt, bert, t5).

Sources (``data.source``):
  * ``python_docs`` (offline): the English reference text of the Python language
    documentation that ships with every CPython (``pydoc_data``, ~465 kB, 79 documents).
  * ``files``: local text (.txt, one document per line), CSV (.csv, the seeds'
    ``train_context.csv`` style) or JSON lines (.json/.jsonl) files read with
    ``datasets``; ``data.text_column`` names the column holding the text. Each file is checked
    first (``recipes.text_files.check_data_file``): an empty file, bytes that are not UTF-8, a malformed JSON
    line or CSV row, or a missing or empty text column raise :class:`merak.config.ConfigError`
    naming the file and the line (or byte offset), and whatever ``datasets`` still rejects is
    reported the same way, naming the files.
  * ``hub``: ``datasets.load_dataset(data.name, data.config, split=data.split)``, e.g.
    ``wikitext`` / ``wikitext-103-raw-v1``; needs network access (or the dataset already in
    the Hugging Face cache). When it cannot be loaded, :func:`read_texts` raises
    :class:`merak.config.ConfigError` naming the dataset and suggesting ``data=files``.

Caches live in ``data.cache_dir``, are named by a hash of everything they depend on
(:func:`cache_key`), and are written atomically (a temporary file, then ``os.replace``),
so ranks or nodes preparing the same data at once never read a half-written file.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from merak.config import ConfigError
from recipes.text_files import check_data_file

if TYPE_CHECKING:
    import tokenizers

logger = logging.getLogger(__name__)

SOURCES = ("python_docs", "files", "hub")


def python_docs_texts() -> list[str]:
    """The documents of the Python reference documentation shipped with CPython, in a fixed order."""
    import pydoc_data.topics

    return [pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics)]


# The ``datasets`` builder that reads a file, by its suffix (anything else is read as plain text).
READERS = {".csv": "csv", ".json": "json", ".jsonl": "json"}

def _root_cause(error: BaseException) -> BaseException:
    """The innermost explicit cause (datasets wraps its readers' errors in DatasetGenerationError)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def _load_files(reader: str, paths: list[str]):
    """``datasets.load_dataset(reader, data_files=paths)``, its failures as ConfigError naming the files."""
    import datasets

    try:
        return datasets.load_dataset(reader, data_files=paths, split="train")
    except Exception as error:  # datasets raises many kinds (its own, pyarrow's, pandas'): all end here
        logger.debug("datasets.load_dataset(%r) failed", reader, exc_info=error)
        cause = _root_cause(error)
        why = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
        raise ConfigError(f"invalid configuration:\n  - data.files: datasets cannot read {', '.join(paths)} as "
                          f"{reader}: {why}") from None


def file_texts(files, text_column: str) -> list[str]:
    """The non-empty texts of local .txt / .csv / .json(l) files (the suffix of the first picks the reader).

    Every file is checked first (``recipes.text_files.check_data_file``), so a bad one fails with a short
    message naming it rather than deep inside ``datasets``.
    """
    paths = [str(Path(f).expanduser()) for f in files]
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise FileNotFoundError(f"data.files: {', '.join(missing)} not found; pass existing files "
                                "(e.g. data.files=[/path/train_context.csv])")
    reader = READERS.get(Path(paths[0]).suffix.lower(), "text")
    column = "text" if reader == "text" else text_column
    started = time.perf_counter()
    for path in paths:
        check_data_file(path, reader, column)
    logger.debug("checked %d %s files in %.1f s", len(paths), reader, time.perf_counter() - started)
    table = _load_files(reader, paths)
    if column not in table.column_names:
        raise ConfigError(f"invalid configuration:\n  - data.text_column={column!r} is not a column of "
                          f"{paths[0]}; columns: {', '.join(table.column_names)}")
    texts = [t for t in table[column] if t]
    if not texts:
        raise ConfigError(f"invalid configuration:\n  - data.files: no text in {', '.join(paths)}")
    return texts


def _offline() -> bool:
    return any(os.environ.get(name, "").lower() in ("1", "true", "yes", "on")
               for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


def hub_texts(name: str, config: str | None, split: str, text_column: str) -> list[str]:
    """The non-empty texts of a Hugging Face dataset, or ConfigError when it cannot be loaded."""
    import datasets

    label = f"{name!r}" + (f" (config {config!r})" if config else "")
    logger.info("loading the dataset %s, split %s, with datasets.load_dataset", label, split)
    try:
        table = datasets.load_dataset(name, config, split=split)
    except Exception as error:  # offline, unknown name or config, no network: all end here
        why = ("offline (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE is set) and the dataset is not in the "
               "Hugging Face cache" if _offline() else f"{type(error).__name__}: {error}")
        raise ConfigError(
            f"invalid configuration:\n  - data.source=hub: cannot load the dataset {label} with "
            f"datasets.load_dataset: {why}. Use local text instead: data=files data.files=[/path/a.txt] "
            "(.txt, .csv with data.text_column, or .jsonl), or the offline default data=python_docs") from None
    if text_column not in table.column_names:
        raise ConfigError(f"invalid configuration:\n  - data.text_column={text_column!r} is not a column of "
                          f"the dataset {label}; columns: {', '.join(table.column_names)}")
    return [t for t in table[text_column] if t]


def check_source(data_cfg) -> list[str]:
    """Problems with the text-source settings that can be seen without reading the text."""
    source = data_cfg.get("source")
    if source == "python_docs":
        return []
    if source == "files":
        files = list(data_cfg.get("files") or [])
        if not files:
            return ["data.source=files needs data.files=[path, ...]"]
        missing = [f for f in files if not os.path.exists(os.path.expanduser(str(f)))]
        return [f"data file not found: {f} (data.files)" for f in missing]
    if source == "hub":
        if not data_cfg.get("name"):
            return ["data.source=hub needs data.name (a datasets.load_dataset name, e.g. wikitext)"]
        return []
    return [f"unknown data.source={source!r}; use {', '.join(SOURCES[:-1])} or {SOURCES[-1]}"]


def check_source_or_synthetic(data_cfg) -> list[str]:
    """:func:`check_source` for the recipes that also generate synthetic words (bert, t5): their
    ``data.source`` may be ``synthetic`` too (the default), which reads nothing."""
    source = data_cfg.get("source", "synthetic")
    if source == "synthetic":
        return []
    problems = check_source(data_cfg)
    if problems and problems[0].startswith("unknown data.source"):
        return [f"unknown data.source={source!r}; use {', '.join(SOURCES)} or synthetic"]
    return problems


def source_key(data_cfg) -> str:
    """A string that changes whenever the text of the source may change (for cache keys)."""
    source = data_cfg.source
    if source == "python_docs":
        return f"python_docs:{sys.version_info[:3]}"
    if source == "hub":
        return (f"hub:{data_cfg.name}:{data_cfg.get('config')}:{data_cfg.get('split') or 'train'}:"
                f"{data_cfg.get('text_column') or 'text'}")
    stats = [(str(f), os.path.getsize(os.path.expanduser(str(f))), os.path.getmtime(os.path.expanduser(str(f))))
             for f in data_cfg.files]
    return f"files:{stats}:{data_cfg.text_column}"


def read_texts(data_cfg) -> list[str]:
    """The documents of ``data.source`` (see the module docstring)."""
    problems = check_source(data_cfg)
    if problems:
        raise ValueError("; ".join(problems))
    if data_cfg.source == "python_docs":
        return python_docs_texts()
    if data_cfg.source == "files":
        return file_texts(data_cfg.files, data_cfg.text_column)
    return hub_texts(str(data_cfg.name), data_cfg.get("config"), str(data_cfg.get("split") or "train"),
                     str(data_cfg.get("text_column") or "text"))


def first_chars(texts: list[str], max_chars: int | None) -> list[str]:
    """The leading documents holding at most ``max_chars`` characters (the last one cut); all if None."""
    if max_chars is None:
        return texts
    out, left = [], int(max_chars)
    for text in texts:
        if left <= 0:
            break
        out.append(text[:left])
        left -= len(out[-1])
    return out


def cache_key(*parts) -> str:
    """A short hash of ``parts`` (their ``str``), to name a cache file."""
    return hashlib.sha256(":".join(str(p) for p in parts).encode()).hexdigest()[:16]


def cache_path(data_cfg, name: str) -> Path:
    """``name`` inside ``data.cache_dir`` (created)."""
    folder = Path(os.path.expanduser(str(data_cfg.cache_dir)))
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def save_array(path: Path, array: np.ndarray) -> None:
    """``np.save`` to ``path`` atomically."""
    temporary = path.with_suffix(f".{os.getpid()}.tmp.npy")
    np.save(temporary, array)
    os.replace(temporary, path)


def save_tokenizer(tokenizer, path: Path) -> None:
    """A ``tokenizers.Tokenizer`` saved as JSON at ``path``, atomically."""
    temporary = path.with_suffix(f".{os.getpid()}.tmp.json")
    tokenizer.save(str(temporary))
    os.replace(temporary, path)


def tokenize(tokenizer, texts: list[str], separator: int | None = None, batch_documents: int = 2000) -> np.ndarray:
    """All documents' token ids in one int32 array, each document followed by ``separator`` if given.

    Encodes in batches (``tokenizer.encode_batch`` runs them in parallel) and logs the progress
    of long corpora; no special tokens are added by the tokenizer itself.
    """
    total = len(texts)
    chunks: list[np.ndarray] = []
    count = 0
    for start in range(0, total, batch_documents):
        ids: list[int] = []
        for encoding in tokenizer.encode_batch(texts[start:start + batch_documents], add_special_tokens=False):
            ids.extend(encoding.ids)
            if separator is not None:
                ids.append(separator)
        chunks.append(np.asarray(ids, dtype=np.int32))
        count += len(ids)
        if total > batch_documents:
            logger.info("tokenized %d/%d documents (%d tokens)", min(start + batch_documents, total), total, count)
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)


def cached_tokenizer(path: Path, train: Callable[[], tokenizers.Tokenizer], what: str):
    """The tokenizer saved at ``path``, or ``train()``'s, saved there (atomically) first."""
    from tokenizers import Tokenizer

    if path.exists():
        return Tokenizer.from_file(str(path))
    logger.info("training the %s vocabulary (cached afterwards in %s)", what, path.parent)
    started = time.perf_counter()
    tokenizer = train()
    save_tokenizer(tokenizer, path)
    logger.info("trained the %s vocabulary (%d tokens) in %.1f s; cached at %s", what, tokenizer.get_vocab_size(),
                time.perf_counter() - started, path)
    return tokenizer


def cached_tokens(path: Path, tokenizer, texts: Callable[[], list[str]], separator: int | None, what: str) -> None:
    """Tokenize ``texts()`` into the int32 array at ``path`` unless it is there already."""
    if path.exists():
        return
    documents = texts()
    logger.info("tokenizing %d documents (%.1f MB) with the %s vocabulary", len(documents),
                sum(len(d) for d in documents) / 1e6, what)
    tokens = tokenize(tokenizer, documents, separator=separator)
    save_array(path, tokens)
    logger.info("cached %d tokens at %s", len(tokens), path)


@contextlib.contextmanager
def building(*paths: Path):
    """Hold an inter-process file lock while any of ``paths`` is missing, so that processes
    preparing the same data at once (every rank under torchrun) build it once, one after the other."""
    if all(path.exists() for path in paths):
        yield
        return
    from filelock import FileLock  # a dependency of datasets and huggingface_hub

    with FileLock(str(paths[-1]) + ".lock"):
        yield


class LazyTexts:
    """``read_texts(data_cfg)``, read on the first call only (never when every cache is there)."""

    def __init__(self, data_cfg) -> None:
        self.data_cfg = data_cfg
        self._texts: list[str] | None = None

    def __call__(self) -> list[str]:
        if self._texts is None:
            self._texts = read_texts(self.data_cfg)
        return self._texts
