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
(:func:`cache_key`) - for local files, their content (:func:`file_digests`: sha256, so an edit
that keeps the size and the modification time, as ``cp -p``, ``rsync -t`` or ``tar x`` leave it,
is read again) - and are written atomically (a temporary file, then ``os.replace``), so ranks or
nodes preparing the same data at once never read a half-written file. The digests are memoised in
``data.cache_dir/file-digests.json`` by each file's stat (inode and change time included, which
no copy can restore), so an unchanged file is not read again. ``datasets`` reads the local files
into a fresh folder inside ``data.cache_dir``, removed afterwards, so it never serves a table of
an older version (nor writes to ``~/.cache/huggingface/datasets``). A cache file that cannot be
opened (a truncated token array, a broken tokenizer JSON) is named in one warning, deleted and
rebuilt.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
import tempfile
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


def _load_files(reader: str, paths: list[str], cache_dir=None):
    """``datasets.load_dataset(reader, data_files=paths)``, its failures as ConfigError naming the files.

    ``datasets`` keys its own cache of local files by their path, size and modification time, so
    it would serve the table of an older version of a file edited in place with its mtime restored.
    Merak reads the files only when its content-keyed token cache misses, so the table is always
    built afresh: in a temporary folder ``cache_dir/datasets-*`` (the system's when None), removed once
    read (``keep_in_memory``), never in ``~/.cache/huggingface/datasets``.
    """
    import datasets

    folder = None
    if cache_dir is not None:
        # Beside merak's caches rather than in /tmp: the table is as large as the text.
        folder = Path(os.path.expanduser(str(cache_dir)))
        folder.mkdir(parents=True, exist_ok=True)
    try:
        # A folder left behind (a file still open somewhere) wastes space, not the run.
        with tempfile.TemporaryDirectory(prefix="datasets-", dir=folder, ignore_cleanup_errors=True) as scratch:
            return datasets.load_dataset(reader, data_files=paths, split="train", cache_dir=scratch,
                                         keep_in_memory=True)
    except Exception as error:  # datasets raises many kinds (its own, pyarrow's, pandas'): all end here
        logger.debug("datasets.load_dataset(%r) failed", reader, exc_info=error)
        cause = _root_cause(error)
        why = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
        raise ConfigError(f"invalid configuration:\n  - data.files: datasets cannot read {', '.join(paths)} as "
                          f"{reader}: {why}") from None


def _reader(paths: list[str]) -> str:
    """The ``datasets`` builder that reads ``paths`` (the suffix of the first picks it)."""
    return READERS.get(Path(paths[0]).suffix.lower(), "text")


def file_texts(files, text_column: str, cache_dir=None) -> list[str]:
    """The non-empty texts of local .txt / .csv / .json(l) files (the suffix of the first picks the reader).

    Every file is checked first (``recipes.text_files.check_data_file``), so a bad one fails with a short
    message naming it rather than deep inside ``datasets``. ``datasets`` works in a temporary folder
    in ``cache_dir`` (:func:`_load_files`).
    """
    paths = [str(Path(f).expanduser()) for f in files]
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise FileNotFoundError(f"data.files: {', '.join(missing)} not found; pass existing files "
                                "(e.g. data.files=[/path/train_context.csv])")
    reader = _reader(paths)
    column = "text" if reader == "text" else text_column
    started = time.perf_counter()
    for path in paths:
        check_data_file(path, reader, column)
    logger.debug("checked %d %s files in %.1f s", len(paths), reader, time.perf_counter() - started)
    table = _load_files(reader, paths, cache_dir)
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


# The memo of the data files' digests, in data.cache_dir.
DIGESTS = "file-digests.json"
# A file whose mtime or ctime is this close to the moment it is looked at is hashed but not memoised:
# file systems stamp times from a coarse clock (a few milliseconds), so an edit right after the stat
# could leave every field of it unchanged ("racily clean", as git calls it).
RACY_NS = 2_000_000_000
HASH_CHUNK = 1 << 20


def _sha256(path: str) -> str:
    """The sha256 of the file at ``path``, read in chunks (data files may be larger than memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(HASH_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _describe(error: BaseException) -> str:
    """``Type: message`` of an error, for a one-line warning."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _drop_damaged(path: Path, why: str) -> None:
    """Name the damaged cache file at ``path`` in one warning and delete it, so that it is rebuilt."""
    logger.warning("damaged cache %s (%s): rebuilding", path, why)
    path.unlink(missing_ok=True)


def _read_memo(path: Path) -> dict:
    """The digest memo at ``path``: {realpath: {"stat": [...], "sha256": hex}}; empty when missing or damaged."""
    try:
        memo = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:  # unreadable, not UTF-8, not JSON
        _drop_damaged(path, _describe(error))
        return {}
    if not isinstance(memo, dict):
        _drop_damaged(path, f"a JSON {type(memo).__name__}, not an object")
        return {}
    return memo


def _write_json(path: Path, value) -> None:
    """``value`` as JSON at ``path``, atomically (processes sharing the cache never read half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(value, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(temporary, path)


def file_digests(files, cache_dir=None) -> list[str]:
    """The sha256 of each file's content, memoised in ``cache_dir/file-digests.json``.

    A memo entry holds for the file's (realpath, st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns):
    ``cp -p``, ``rsync -t`` and ``tar x`` restore the mtime but not the ctime, which every write or
    ``utime`` sets to now, so an edited file always misses and is hashed again. Processes updating
    the memo at once may lose each other's entries: that costs a hash, never a wrong digest.
    """
    memo_path = Path(os.path.expanduser(str(cache_dir))) / DIGESTS if cache_dir is not None else None
    memo = _read_memo(memo_path) if memo_path is not None else {}
    digests, changed = [], False
    for name in files:
        real = os.path.realpath(os.path.expanduser(str(name)))
        now = time.time_ns()  # before the stat: an edit after it gets a later ctime than this
        status = os.stat(real)
        stamp = [status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns]
        entry = memo.get(real)
        if isinstance(entry, dict) and entry.get("stat") == stamp and isinstance(entry.get("sha256"), str):
            digests.append(entry["sha256"])
            continue
        started = time.perf_counter()
        digests.append(_sha256(real))
        logger.debug("sha256 of %s (%d bytes) in %.1f s", real, status.st_size, time.perf_counter() - started)
        if now - max(status.st_mtime_ns, status.st_ctime_ns) >= RACY_NS:
            memo[real] = {"stat": stamp, "sha256": digests[-1]}
            changed = True
    if changed and memo_path is not None:
        # Files gone since are forgotten, so the memo does not grow with every file ever used.
        _write_json(memo_path, {path: entry for path, entry in memo.items() if os.path.exists(path)})
    return digests


def source_key(data_cfg) -> str:
    """A string that changes whenever the text of the source may change (for cache keys): for local
    files, their content (:func:`file_digests`), however their size and times were kept."""
    source = data_cfg.source
    if source == "python_docs":
        return f"python_docs:{sys.version_info[:3]}"
    if source == "hub":
        return (f"hub:{data_cfg.name}:{data_cfg.get('config')}:{data_cfg.get('split') or 'train'}:"
                f"{data_cfg.get('text_column') or 'text'}")
    paths = [str(f) for f in data_cfg.files]
    # The reader (by the first file's suffix) decides how the same bytes become documents.
    return f"files:{_reader(paths)}:{file_digests(paths, data_cfg.get('cache_dir'))}:{data_cfg.text_column}"


def read_texts(data_cfg) -> list[str]:
    """The documents of ``data.source`` (see the module docstring)."""
    problems = check_source(data_cfg)
    if problems:
        raise ValueError("; ".join(problems))
    if data_cfg.source == "python_docs":
        return python_docs_texts()
    if data_cfg.source == "files":
        return file_texts(data_cfg.files, data_cfg.text_column, data_cfg.get("cache_dir"))
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


def cache_problem(path: Path) -> str | None:
    """Why the cache file at ``path`` (a token array .npy, else a tokenizer .json) cannot be used; None
    when it opens. Cheap for the tokens: the header is read and the size checked, the array mapped."""
    if path.suffix == ".npy":
        try:
            with open(path, "rb") as file:
                magic = file.read(len(np.lib.format.MAGIC_PREFIX))
            if magic != np.lib.format.MAGIC_PREFIX:
                # Checked first: np.load would take any other bytes for a pickle and suggest allow_pickle.
                return f"not a .npy file: {path.stat().st_size} bytes"
            tokens = np.load(path, mmap_mode="r")  # a short header or short data raise here
        except (OSError, ValueError, EOFError) as error:
            return _describe(error)
        if tokens.dtype != np.int32 or tokens.ndim != 1:
            return f"a {tokens.dtype} array of shape {tokens.shape}, not int32 tokens"
        return None
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises a bare Exception for a file it cannot parse
        return _describe(error)
    return None


def reusable(path: Path) -> bool:
    """Whether the cache file at ``path`` is there and opens; a damaged one is named in one warning and
    deleted, so the caller rebuilds it (rather than every run failing where it is read)."""
    if not path.exists():
        return False
    problem = cache_problem(path)
    if problem is None:
        return True
    _drop_damaged(path, problem)
    return False


def cached_tokenizer(path: Path, train: Callable[[], tokenizers.Tokenizer], what: str):
    """The tokenizer saved at ``path``, or ``train()``'s, saved there (atomically) first; a saved one that
    does not parse is named in a warning and trained again."""
    from tokenizers import Tokenizer

    if path.exists():
        try:
            return Tokenizer.from_file(str(path))
        except Exception as error:  # tokenizers raises a bare Exception for a file it cannot parse
            _drop_damaged(path, _describe(error))
    logger.info("training the %s vocabulary (cached afterwards in %s)", what, path.parent)
    started = time.perf_counter()
    tokenizer = train()
    save_tokenizer(tokenizer, path)
    logger.info("trained the %s vocabulary (%d tokens) in %.1f s; cached at %s", what, tokenizer.get_vocab_size(),
                time.perf_counter() - started, path)
    return tokenizer


def cached_tokens(path: Path, tokenizer, texts: Callable[[], list[str]], separator: int | None, what: str) -> None:
    """Tokenize ``texts()`` into the int32 array at ``path`` unless it is there already (and opens:
    :func:`reusable`)."""
    if reusable(path):
        return
    documents = texts()
    logger.info("tokenizing %d documents (%.1f MB) with the %s vocabulary", len(documents),
                sum(len(d) for d in documents) / 1e6, what)
    tokens = tokenize(tokenizer, documents, separator=separator)
    save_array(path, tokens)
    logger.info("cached %d tokens at %s", len(tokens), path)


@contextlib.contextmanager
def building(*paths: Path):
    """Hold an inter-process file lock while any of ``paths`` is missing or damaged, so that processes
    preparing the same data at once (every rank under torchrun) build it once, one after the other.

    The check here only looks: the builder, holding the lock, finds the damage again, warns and rebuilds,
    while the others, let in after it, find the rebuilt file (one warning, one rebuild, and nobody deletes
    a file another process has just rebuilt)."""
    if all(path.exists() and cache_problem(path) is None for path in paths):
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
