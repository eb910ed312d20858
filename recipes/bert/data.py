"""Masked-language-modelling data: real English text (default) or synthetic words.

Text sources (``data.source``, read by the shared ``recipes/text.py``, as in the gpt recipe):
  * ``python_docs`` (default, offline): the English reference text of the Python language
    documentation that ships with CPython (``pydoc_data``, ~465 kB, 79 documents).
  * ``files``: local .txt, .csv (``data.text_column``, the seeds' ``train_context.csv`` style)
    or .jsonl files (``data.files=[...]``).
  * ``hub``: ``datasets.load_dataset(data.name, data.config)``, e.g. wikitext /
    wikitext-103-raw-v1; online only: offline, ``prepare`` raises a ConfigError naming the
    dataset and suggesting ``data=files``, before any worker starts.

The text is tokenized with a WordPiece vocabulary trained offline on it with the
``tokenizers`` library the way ``BertWordPieceTokenizer`` does (lowercased, BERT's
normalizer and pre-tokenizer, ``##`` continuation pieces; special tokens [PAD]=0 [UNK]=1
[CLS]=2 [SEP]=3 [MASK]=4), of at most ``model.vocab_size`` tokens (the model's embedding
must hold it; a small corpus gives fewer: 1000 for ``toy``, 4320 of 30522 for ``bert-base``
on python_docs). ``data.tokenizer_chars`` limits the text the vocabulary is trained on
(null: all). The training is made independent of the process (same text, same ids), so
nodes that prepare the data separately agree. Documents are joined with [SEP] and cut into
blocks of ``model.seq_length - 2`` tokens; each sample is ``[CLS] block [SEP]`` (no
padding). The vocabulary (tokenizer JSON) and the token array are cached in
``data.cache_dir``, named by a hash of their settings and the text (local files: their
content), built once under a file lock and written atomically (a damaged one is named in a
warning and rebuilt); ranks memory-map the tokens.

Masking follows BERT: ``data.mask_prob`` (15 %) of a sample's word positions are chosen
(never [CLS]/[SEP], at least one; 15 % of 30 is 4 or 5 at random, so the mean is exact);
of those 80 % become [MASK], 10 % a random word and 10 % stay unchanged; ``labels`` hold
the original token at the chosen positions and -100 elsewhere. The choice is drawn from a
generator seeded with ``(data.seed, sample index)``, so every rank and every run masks a
sample identically.

``data=synthetic`` keeps the synthetic source: each sample is ``[CLS] w_1 ... w_n [SEP]``
of exactly ``model.seq_length`` tokens (ids follow bert-base-uncased: [PAD]=0, [CLS]=101,
[SEP]=102, [MASK]=103 - the module constants below; words are ids from 104 up) from a
fixed random Markov chain in which every word can be followed by only ``data.branching``
words (Zipf weights), so a masked word can be predicted from its neighbours.
``data.mask_prob`` of the words (at least one per sample) are replaced by [MASK]. Nothing
is cached: ``prepare`` returns the generation parameters as JSON and ``load`` generates
the tensors (a few MB) from them.

Every sample is ``{input_ids, labels}`` of length ``model.seq_length`` (the model's
attention mask and token types are its all-ones / all-zeros defaults).
"""

from __future__ import annotations

import json

import numpy as np
import torch

from merak.config import ConfigError
from recipes import text

# Ids of the synthetic source (bert-base-uncased's).
PAD, CLS, SEP, MASK = 0, 101, 102, 103
FIRST_WORD = 104
IGNORE = -100

# The trained WordPiece vocabulary's special tokens and their ids (BertWordPieceTokenizer's order).
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
TEXT_PAD, TEXT_UNK, TEXT_CLS, TEXT_SEP, TEXT_MASK = range(len(SPECIAL_TOKENS))
TEXT_FIRST_WORD = len(SPECIAL_TOKENS)
TOKENIZER_VERSION = "bert-wordpiece-v1"  # part of the cache key: bump when the training below changes


def check_data(data_cfg) -> list[str]:
    """Problems with the data settings that can be seen without reading or generating the data (each
    value's type and range are checked before, against schema.BertData)."""
    return text.check_source_or_synthetic(data_cfg)


def prepare(data_cfg, model_cfg) -> str:
    """Synthetic: the generation parameters. Text: train the vocabulary and tokenize once (both
    cached); the paths and masking parameters. JSON either way, for ``load``."""
    problems = check_data(data_cfg)
    if problems:
        raise ValueError("; ".join(problems))
    if data_cfg.get("source", "synthetic") == "synthetic":
        return json.dumps({"kind": "synthetic", "num_samples": int(data_cfg.num_samples), "seed": int(data_cfg.seed),
                           "branching": int(data_cfg.branching), "mask_prob": float(data_cfg.mask_prob),
                           "vocab_size": int(model_cfg.vocab_size), "seq_length": int(model_cfg.seq_length)})
    return json.dumps({"kind": "text", **prepare_text(data_cfg, model_cfg)})


def _bert_pipeline(tokenizer) -> None:
    from tokenizers import decoders, normalizers, pre_tokenizers

    tokenizer.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                      strip_accents=None, lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")


def wordpiece_tokenizer(texts: list[str], vocab_size: int):
    """A lowercasing WordPiece tokenizer (BertWordPieceTokenizer's pipeline) trained on ``texts``.

    The same text gives the same vocabulary and ids in every process (so nodes that prepare
    the data separately agree): the trainer numbers the ``##c`` continuation pieces in hash-map
    order, which decides ties between equally frequent merges, so they are handed to it in
    sorted order first; the result is renumbered (special tokens, then the rest sorted).
    """
    from tokenizers import Tokenizer, models, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]", continuing_subword_prefix="##"))
    _bert_pipeline(tokenizer)
    continuations: set[str] = set()
    for document in texts:
        normalized = tokenizer.normalizer.normalize_str(document)
        for word, _ in tokenizer.pre_tokenizer.pre_tokenize_str(normalized):
            continuations.update(word[1:])
    seeded = list(SPECIAL_TOKENS) + [f"##{c}" for c in sorted(continuations)]
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=seeded,
                                        limit_alphabet=1000, continuing_subword_prefix="##", show_progress=False)
    tokenizer.train_from_iterator(texts, trainer, length=len(texts))
    words = sorted(set(tokenizer.get_vocab()) - set(SPECIAL_TOKENS))
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *words])}
    result = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", continuing_subword_prefix="##"))
    _bert_pipeline(result)
    result.add_special_tokens(list(SPECIAL_TOKENS))
    return result


def prepare_text(data_cfg, model_cfg) -> dict:
    """Train (or reuse) the WordPiece vocabulary and the token array in ``data.cache_dir``."""
    max_vocab = int(model_cfg.vocab_size)
    chars = data_cfg.get("tokenizer_chars")
    key = text.cache_key(TOKENIZER_VERSION, text.source_key(data_cfg), max_vocab, chars)
    tokenizer_path = text.cache_path(data_cfg, f"bert-wordpiece-{key}.json")
    tokens_path = text.cache_path(data_cfg, f"bert-tokens-{key}.npy")
    with text.building(tokenizer_path, tokens_path):
        texts = text.LazyTexts(data_cfg)
        tokenizer = text.cached_tokenizer(
            tokenizer_path, lambda: wordpiece_tokenizer(text.first_chars(texts(), chars), max_vocab), "WordPiece")
        vocab_size = tokenizer.get_vocab_size()
        if vocab_size > max_vocab:
            raise ConfigError(f"invalid configuration:\n  - the WordPiece vocabulary trained on data.source="
                              f"{data_cfg.source} has {vocab_size} tokens, more than model.vocab_size={max_vocab} "
                              "(its alphabet alone is too large); raise model.vocab_size")
        if [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] != list(range(len(SPECIAL_TOKENS))):
            raise ValueError(f"{tokenizer_path}: the special tokens are not {SPECIAL_TOKENS} at ids 0-4; delete it")
        text.cached_tokens(tokens_path, tokenizer, texts, TEXT_SEP, "WordPiece")
    return {"tokens": str(tokens_path), "tokenizer": str(tokenizer_path), "vocab_size": vocab_size,
            "seq_length": int(model_cfg.seq_length), "seed": int(data_cfg.seed),
            "mask_prob": float(data_cfg.mask_prob)}


def mask_tokens(ids: np.ndarray, rng: np.random.Generator, mask_prob: float, vocab_size: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """BERT's masking of one sequence: ``(input_ids, labels)``.

    ``mask_prob`` of the positions that are not special tokens (at least one; the fraction
    rounded up or down at random, in proportion, so that it is exact on average) are chosen;
    each chosen token becomes [MASK] (80 %), a random word in ``[TEXT_FIRST_WORD, vocab_size)``
    (10 %) or stays (10 %). ``labels`` is the original token at chosen positions, -100 elsewhere.
    """
    candidates = np.flatnonzero(~np.isin(ids, (TEXT_PAD, TEXT_CLS, TEXT_SEP, TEXT_MASK)))
    expected = mask_prob * len(candidates)  # rounded at random, so short sequences get 15 % on average too
    count = min(len(candidates), max(1, int(expected) + int(rng.random() < expected - int(expected))))
    chosen = rng.choice(candidates, size=count, replace=False)
    action = rng.random(count)
    random_words = rng.integers(TEXT_FIRST_WORD, vocab_size, size=count)
    input_ids = ids.copy()
    input_ids[chosen] = np.where(action < 0.8, TEXT_MASK, np.where(action < 0.9, random_words, ids[chosen]))
    labels = np.full_like(ids, IGNORE)
    labels[chosen] = ids[chosen]
    return input_ids, labels


class MaskedText:
    """``[CLS] block [SEP]`` samples of a cached token array, masked from ``(seed, index)``."""

    def __init__(self, tokens: str, tokenizer: str, vocab_size: int, seq_length: int, seed: int,
                 mask_prob: float) -> None:
        self.tokens = np.load(tokens, mmap_mode="r")
        self.tokenizer_path = tokenizer
        self.vocab_size = vocab_size
        self.block = seq_length - 2
        self.seed = seed
        self.mask_prob = mask_prob

    def __len__(self) -> int:
        return len(self.tokens) // self.block

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} of {len(self)}")
        start = index * self.block
        ids = np.concatenate([[TEXT_CLS], self.tokens[start:start + self.block], [TEXT_SEP]]).astype(np.int64)
        rng = np.random.default_rng([self.seed, index])
        input_ids, labels = mask_tokens(ids, rng, self.mask_prob, self.vocab_size)
        return {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels)}

    def tokenizer(self):
        """The trained WordPiece tokenizer (to decode samples)."""
        from tokenizers import Tokenizer

        return Tokenizer.from_file(self.tokenizer_path)


def load(prepared: str, model_cfg) -> MaskedText | SyntheticMLM:
    """The dataset for ranks that read data, from ``prepare``'s JSON."""
    params = json.loads(prepared)
    kind = params.pop("kind", "synthetic")
    return MaskedText(**params) if kind == "text" else SyntheticMLM(**params)


# --- the synthetic source ---------------------------------------------------------------------------------------


def markov_words(generator: torch.Generator, num_samples: int, length: int, first: int, vocab_size: int,
                 branching: int) -> torch.Tensor:
    """``[num_samples, length]`` word ids in ``[first, vocab_size)`` from a random sparse Markov chain.

    Every word has ``branching`` successors (equally likely), drawn once from a Zipf distribution
    over the words, so frequent words are few (a skewed unigram distribution to learn first) and
    the next word is predictable from the previous one (a bigram structure to learn next).
    """
    words = vocab_size - first
    zipf = 1.0 / torch.arange(1, words + 1, dtype=torch.float64)  # word w is drawn with weight 1 / (w + 1)
    successors = torch.multinomial(zipf, words * branching, replacement=True, generator=generator)
    successors = successors.view(words, branching)
    current = torch.multinomial(zipf, num_samples, replacement=True, generator=generator)
    out = torch.empty(num_samples, length, dtype=torch.long)
    for position in range(length):
        out[:, position] = current
        pick = torch.randint(0, branching, (num_samples,), generator=generator)
        current = successors[current, pick]
    return out + first


def _column(rows: int, value: int) -> torch.Tensor:
    return torch.full((rows, 1), value, dtype=torch.long)


class SyntheticMLM:
    """Masked-LM samples ``{input_ids, labels}``, all of length ``seq_length``."""

    def __init__(self, num_samples: int, seed: int, branching: int, mask_prob: float, vocab_size: int,
                 seq_length: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        words = markov_words(generator, num_samples, seq_length - 2, FIRST_WORD, vocab_size, branching)
        masked = torch.rand(words.shape, generator=generator) < mask_prob
        # At least one masked word per sample, so no sample has an empty loss.
        forced = torch.randint(0, words.size(1), (num_samples,), generator=generator)
        masked[torch.arange(num_samples), forced] = True
        self.input_ids = torch.cat([_column(num_samples, CLS), torch.where(masked, MASK, words),
                                    _column(num_samples, SEP)], dim=1)
        self.labels = torch.cat([_column(num_samples, IGNORE), torch.where(masked, words, IGNORE),
                                 _column(num_samples, IGNORE)], dim=1)

    def __len__(self) -> int:
        return self.input_ids.size(0)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "labels": self.labels[index]}
