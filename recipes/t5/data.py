"""Sequence-to-sequence data: T5 span corruption of real English text (default), or synthetic.

Text sources (``data.source``, read by the shared ``recipes/text.py``, as in the gpt recipe):
  * ``python_docs`` (default, offline): the English reference text of the Python language
    documentation that ships with CPython (``pydoc_data``, ~465 kB, 79 documents).
  * ``files``: local .txt, .csv (``data.text_column``, the seeds' ``train_context.csv`` style)
    or .jsonl files (``data.files=[...]``).
  * ``hub``: ``datasets.load_dataset(data.name, data.config)``, e.g. wikitext /
    wikitext-103-raw-v1; online only: offline, ``prepare`` raises a ConfigError naming the
    dataset and suggesting ``data=files``, before any worker starts.

The text is tokenized with a SentencePiece-like vocabulary trained offline on (at most
``data.tokenizer_chars``, default 1 MB, of) it: a ``tokenizers`` Unigram model behind NFKC
normalization and the ``▁`` metaspace, with T5's ids: pad=0 (also the decoder start),
eos=1, unk=2, and the 100 sentinels ``<extra_id_0>`` ... ``<extra_id_99>`` at the top of
the tokenizer's vocabulary (``<extra_id_0>`` highest), ``model.vocab_size`` tokens in all at
most (a small corpus gives fewer; the model's rows above are unused, as in t5-base's 32128).
The training is made independent of the process (same text, same ids), so nodes that
prepare the data separately agree. The documents' tokens are concatenated (T5's packing)
and cut into chunks of ``raw`` tokens; vocabulary (tokenizer JSON) and tokens are cached in
``data.cache_dir``, named by a hash of their settings and the text (local files: their
content), built once under a file lock and written atomically (a damaged one is named in a
warning and rebuilt); ranks memory-map the tokens.

Span corruption follows T5: ``data.noise_density`` (0.15) of a chunk's tokens, in spans of
mean length ``data.mean_noise_span_length`` (3), are noise; the input keeps the other
tokens, each noise span replaced by one sentinel (``<extra_id_0>``, ``<extra_id_1>``, ...)
and ends with eos; the target lists each sentinel followed by its span's tokens and ends
with eos. ``raw`` and the number of noise tokens and spans are fixed (chosen so the input
is exactly ``model.source_length`` tokens and the target fits ``model.target_length``, e.g.
568 raw tokens -> 512 input and 114 target tokens for t5-base), so only the span placement
is random, drawn from a generator seeded with ``(data.seed, sample index)``: identical on
every rank and every run. ``labels`` are the target padded with -100, ``decoder_input_ids``
the target shifted right behind the start token (0), padded with 0.

``data=synthetic`` keeps the synthetic task: read a source of ``model.source_length``
tokens and write its first ``target_length - 1`` words, each replaced by the next word id
(``w -> w + 1``, the last word wrapping to the first), followed by eos; source words (ids
from 3 up) come from a fixed random Markov chain (Zipf-weighted successors,
``data.branching`` per word). Nothing is cached: ``prepare`` returns the generation
parameters as JSON and ``load`` generates the tensors from them.

Every sample is ``{input_ids, decoder_input_ids, labels}`` with fixed lengths (graph capture
specializes to them; the encoder input has no padding, so no attention masks are needed).
"""

from __future__ import annotations

import json

import numpy as np
import torch

from merak.config import ConfigError
from recipes import text

PAD, EOS, UNK = 0, 1, 2
DECODER_START = PAD
FIRST_WORD = 3
IGNORE = -100
SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")
NUM_SENTINELS = 100
TOKENIZER_VERSION = "t5-unigram-v1"  # part of the cache key: bump when the training below changes


def check_data(data_cfg) -> list[str]:
    """Problems with the data settings that can be seen without reading or generating the data (each
    value's type and range are checked before, against schema.T5Data)."""
    return text.check_source_or_synthetic(data_cfg)


def prepare(data_cfg, model_cfg) -> str:
    """Synthetic: the generation parameters. Text: train the vocabulary and tokenize once (both
    cached); the paths and span-corruption parameters. JSON either way, for ``load``."""
    problems = check_data(data_cfg)
    if problems:
        raise ValueError("; ".join(problems))
    if data_cfg.get("source", "synthetic") == "synthetic":
        return json.dumps({"kind": "synthetic", "num_samples": int(data_cfg.num_samples), "seed": int(data_cfg.seed),
                           "branching": int(data_cfg.branching), "vocab_size": int(model_cfg.vocab_size),
                           "source_length": int(model_cfg.source_length),
                           "target_length": int(model_cfg.target_length)})
    return json.dumps({"kind": "text", **prepare_text(data_cfg, model_cfg)})


PENALTY_STEP = 1e-4  # the Unigram trainer's score step between characters it had to add back


def canonical_pieces(pieces: list[list]) -> list[tuple[str, float]]:
    """The trained ``[piece, score]`` list made independent of the process that trained it.

    The trainer iterates hash maps, whose order changes with every process: characters it
    adds back at the end get scores ``min + k * 1e-4`` in that order, float sums differ in the
    last bits and equal scores come in any order. Re-score those characters in sorted order,
    round the scores and sort by (score, piece), so the same text gives the same ids anywhere.
    """
    low = min(score for _, score in pieces)
    singles = sorted(piece for piece, score in pieces if len(piece) == 1
                     and abs((score - low) / PENALTY_STEP - round((score - low) / PENALTY_STEP)) < 1e-6
                     and (score - low) / PENALTY_STEP < len(pieces))
    added = {piece: low + i * PENALTY_STEP for i, piece in enumerate(singles)}
    rounded = [(piece, round(added.get(piece, score), 8)) for piece, score in pieces]
    return sorted(rounded, key=lambda item: (-item[1], item[0]))


def unigram_tokenizer(texts: list[str], vocab_size: int):
    """A SentencePiece-like Unigram tokenizer trained on ``texts``: ``vocab_size`` pieces at most
    (<pad>, </s>, <unk> first), then the 100 sentinels, ``<extra_id_0>`` the highest id."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")])
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), unk_token="<unk>",
                                      show_progress=False)
    tokenizer.train_from_iterator(texts, trainer, length=len(texts))
    pieces = json.loads(tokenizer.to_str())["model"]["vocab"]
    special, rest = pieces[:len(SPECIAL_TOKENS)], canonical_pieces(pieces[len(SPECIAL_TOKENS):])
    assert [piece for piece, _ in special] == list(SPECIAL_TOKENS), special
    tokenizer.model = models.Unigram([(piece, 0.0) for piece, _ in special] + rest, unk_id=UNK, byte_fallback=False)
    tokenizer.add_special_tokens([AddedToken(f"<extra_id_{i}>", special=True)
                                  for i in reversed(range(NUM_SENTINELS))])
    return tokenizer


def span_corruption_lengths(source_length: int, target_length: int, noise_density: float,
                            mean_span_length: float) -> tuple[int, int, int]:
    """``(raw, noise, spans)``: chunk length, noise tokens and noise spans per sample, such that the
    corrupted input (``raw - noise + spans + 1``) is exactly ``source_length`` and the target
    (``noise + spans + 1``) at most ``target_length``, with ``noise`` nearest ``noise_density * raw``
    (fewer where the target length binds). As T5's ``random_spans_helper``, for the longest raw."""

    def spans_of(noise: int) -> int:
        return min(max(1, round(noise / mean_span_length)), noise)

    best = None
    for raw in range(source_length - 1, 4 * source_length + 16):
        noise = min(max(1, round(raw * noise_density)), raw - 1)
        while noise > 1 and noise + spans_of(noise) + 1 > target_length:
            noise -= 1
        spans = spans_of(noise)
        inputs = raw - noise + spans + 1
        if inputs > source_length:
            break
        if inputs == source_length and noise + spans + 1 <= target_length and raw - noise >= spans:
            best = (raw, noise, spans)
    if best is None:
        raise ConfigError(f"invalid configuration:\n  - model.source_length={source_length} and "
                          f"model.target_length={target_length} are too short for span corruption "
                          "(the target needs at least 3 tokens: sentinel, noise token, eos)")
    return best


def prepare_text(data_cfg, model_cfg) -> dict:
    """Train (or reuse) the Unigram vocabulary and the token array in ``data.cache_dir``."""
    max_vocab = int(model_cfg.vocab_size)
    if max_vocab <= NUM_SENTINELS + len(SPECIAL_TOKENS) + 1:
        raise ConfigError(f"invalid configuration:\n  - model.vocab_size={max_vocab} leaves no room for words "
                          f"beside {len(SPECIAL_TOKENS)} special tokens and {NUM_SENTINELS} sentinels")
    raw, noise, spans = span_corruption_lengths(int(model_cfg.source_length), int(model_cfg.target_length),
                                                float(data_cfg.noise_density), float(data_cfg.mean_noise_span_length))
    chars = data_cfg.get("tokenizer_chars")
    key = text.cache_key(TOKENIZER_VERSION, text.source_key(data_cfg), max_vocab, chars)
    tokenizer_path = text.cache_path(data_cfg, f"t5-unigram-{key}.json")
    tokens_path = text.cache_path(data_cfg, f"t5-tokens-{key}.npy")
    with text.building(tokenizer_path, tokens_path):
        texts = text.LazyTexts(data_cfg)

        def train():
            documents = text.first_chars(texts(), chars)
            try:
                return unigram_tokenizer(documents, max_vocab - NUM_SENTINELS)
            except Exception as error:  # tokenizers raises a bare Exception when the alphabet does not fit
                raise ConfigError(f"invalid configuration:\n  - model.vocab_size={max_vocab} is too small for a "
                                  f"Unigram vocabulary of data.source={data_cfg.source} plus {NUM_SENTINELS} "
                                  f"sentinels (tokenizers: {error}); raise model.vocab_size") from None

        tokenizer = text.cached_tokenizer(tokenizer_path, train, "Unigram")
        vocab_size = tokenizer.get_vocab_size()
        if vocab_size > max_vocab:
            raise ConfigError(f"invalid configuration:\n  - the Unigram vocabulary trained on data.source="
                              f"{data_cfg.source} and the sentinels have {vocab_size} tokens, more than "
                              f"model.vocab_size={max_vocab}; raise model.vocab_size")
        if [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] != [PAD, EOS, UNK] or \
                tokenizer.token_to_id("<extra_id_0>") != vocab_size - 1:
            raise ValueError(f"{tokenizer_path}: not T5's special token ids; delete it")
        text.cached_tokens(tokens_path, tokenizer, texts, None, "Unigram")
    return {"tokens": str(tokens_path), "tokenizer": str(tokenizer_path), "sentinel": vocab_size - 1,
            "raw_length": raw, "noise_tokens": noise, "noise_spans": spans,
            "source_length": int(model_cfg.source_length), "target_length": int(model_cfg.target_length),
            "seed": int(data_cfg.seed)}


def _segments(rng: np.random.Generator, total: int, count: int) -> np.ndarray:
    """``count`` positive lengths summing to ``total``, uniformly over all such splits."""
    cuts = np.sort(rng.choice(total - 1, size=count - 1, replace=False) + 1)
    return np.diff(np.concatenate([[0], cuts, [total]]))


def span_corrupt(tokens: np.ndarray, rng: np.random.Generator, noise: int, spans: int, sentinel: int
                 ) -> tuple[list[int], list[int]]:
    """T5's span corruption of one chunk: ``(inputs, targets)``, both ending with eos.

    The chunk alternates ``spans`` kept and ``spans`` noise runs (a kept run first); noise run i
    becomes sentinel ``sentinel - i`` (``<extra_id_i>``) in the inputs and is listed after that
    sentinel in the targets.
    """
    kept_lengths = _segments(rng, len(tokens) - noise, spans)
    noise_lengths = _segments(rng, noise, spans)
    inputs: list[int] = []
    targets: list[int] = []
    position = 0
    for i, (kept, noisy) in enumerate(zip(kept_lengths, noise_lengths)):
        inputs.extend(tokens[position:position + kept].tolist())
        position += kept
        inputs.append(sentinel - i)
        targets.append(sentinel - i)
        targets.extend(tokens[position:position + noisy].tolist())
        position += noisy
    inputs.append(EOS)
    targets.append(EOS)
    return inputs, targets


class SpanCorruptedText:
    """Span-corrupted chunks of a cached token array, the spans placed from ``(seed, index)``."""

    def __init__(self, tokens: str, tokenizer: str, sentinel: int, raw_length: int, noise_tokens: int,
                 noise_spans: int, source_length: int, target_length: int, seed: int) -> None:
        self.tokens = np.load(tokens, mmap_mode="r")
        self.tokenizer_path = tokenizer
        self.sentinel = sentinel
        self.raw_length = raw_length
        self.noise_tokens = noise_tokens
        self.noise_spans = noise_spans
        self.source_length = source_length
        self.target_length = target_length
        self.seed = seed

    def __len__(self) -> int:
        return len(self.tokens) // self.raw_length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} of {len(self)}")
        chunk = np.asarray(self.tokens[index * self.raw_length:(index + 1) * self.raw_length], dtype=np.int64)
        rng = np.random.default_rng([self.seed, index])
        inputs, targets = span_corrupt(chunk, rng, self.noise_tokens, self.noise_spans, self.sentinel)
        padding = self.target_length - len(targets)
        labels = torch.tensor(targets + [IGNORE] * padding, dtype=torch.long)
        decoder_input_ids = torch.tensor([DECODER_START, *targets, *[PAD] * padding][:self.target_length],
                                         dtype=torch.long)
        return {"input_ids": torch.tensor(inputs, dtype=torch.long), "decoder_input_ids": decoder_input_ids,
                "labels": labels}

    def tokenizer(self):
        """The trained Unigram tokenizer (to decode samples)."""
        from tokenizers import Tokenizer

        return Tokenizer.from_file(self.tokenizer_path)


def load(prepared: str, model_cfg) -> SpanCorruptedText | SyntheticSeq2Seq:
    """The dataset for ranks that read data, from ``prepare``'s JSON."""
    params = json.loads(prepared)
    kind = params.pop("kind", "synthetic")
    return SpanCorruptedText(**params) if kind == "text" else SyntheticSeq2Seq(**params)


# --- the synthetic source ---------------------------------------------------------------------------------------


def markov_words(generator: torch.Generator, num_samples: int, length: int, first: int, vocab_size: int,
                 branching: int) -> torch.Tensor:
    """``[num_samples, length]`` word ids in ``[first, vocab_size)`` from a random sparse Markov chain
    whose successors are drawn with Zipf weights (word w has weight 1 / (w - first + 1))."""
    words = vocab_size - first
    zipf = 1.0 / torch.arange(1, words + 1, dtype=torch.float64)
    successors = torch.multinomial(zipf, words * branching, replacement=True, generator=generator)
    successors = successors.view(words, branching)
    current = torch.multinomial(zipf, num_samples, replacement=True, generator=generator)
    out = torch.empty(num_samples, length, dtype=torch.long)
    for position in range(length):
        out[:, position] = current
        pick = torch.randint(0, branching, (num_samples,), generator=generator)
        current = successors[current, pick]
    return out + first


class SyntheticSeq2Seq:
    """Samples ``{input_ids, decoder_input_ids, labels}`` of fixed source and target lengths."""

    def __init__(self, num_samples: int, seed: int, branching: int, vocab_size: int, source_length: int,
                 target_length: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        source = markov_words(generator, num_samples, source_length - 1, FIRST_WORD, vocab_size, branching)
        eos = torch.full((num_samples, 1), EOS, dtype=torch.long)
        self.input_ids = torch.cat([source, eos], dim=1)
        words = vocab_size - FIRST_WORD
        target = (source[:, :target_length - 1] - FIRST_WORD + 1) % words + FIRST_WORD
        self.labels = torch.cat([target, eos], dim=1)
        start = torch.full((num_samples, 1), DECODER_START, dtype=torch.long)
        self.decoder_input_ids = torch.cat([start, self.labels[:, :-1]], dim=1)

    def __len__(self) -> int:
        return self.input_ids.size(0)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "decoder_input_ids": self.decoder_input_ids[index],
                "labels": self.labels[index]}
