"""Synthetic masked-language-modelling data, generated offline and deterministically from a seed.

Each sample is ``[CLS] w_1 ... w_{n} [SEP]`` of exactly ``model.seq_length`` tokens
(ids follow bert-base-uncased: [PAD]=0, [CLS]=101, [SEP]=102, [MASK]=103; words
are ids from 104 up). The words come from a fixed random Markov chain in which
every word can be followed by only ``data.branching`` words (chosen with Zipf
weights, so a few words are frequent), so a masked word can be predicted from
its neighbours and the loss has something to learn.
``data.mask_prob`` of the words (at least one per sample) are replaced by
[MASK]; ``labels`` hold the original word there and -100 everywhere else.

Nothing is downloaded or cached: ``prepare`` returns the generation parameters
as a JSON string and ``load`` generates the tensors (a few MB) from them.
"""

from __future__ import annotations

import json

import torch

PAD, CLS, SEP, MASK = 0, 101, 102, 103
FIRST_WORD = 104
IGNORE = -100


def check_data(data_cfg) -> list[str]:
    """Problems with the data settings that can be seen without generating the data."""
    problems = []
    if data_cfg.get("source", "synthetic") != "synthetic":
        problems.append(f"unknown data.source={data_cfg.source!r}; use synthetic")
    if not isinstance(data_cfg.get("num_samples"), int) or data_cfg.num_samples < 1:
        problems.append(f"data.num_samples={data_cfg.get('num_samples')!r} must be a positive integer")
    if not isinstance(data_cfg.get("branching"), int) or data_cfg.branching < 1:
        problems.append(f"data.branching={data_cfg.get('branching')!r} must be a positive integer")
    if not 0.0 < float(data_cfg.get("mask_prob", 0.0)) <= 1.0:
        problems.append(f"data.mask_prob={data_cfg.get('mask_prob')!r} must be in (0, 1]")
    return problems


def prepare(data_cfg, model_cfg) -> str:
    """The generation parameters as JSON (nothing to download or tokenize)."""
    problems = check_data(data_cfg)
    if problems:
        raise ValueError("; ".join(problems))
    return json.dumps({"num_samples": int(data_cfg.num_samples), "seed": int(data_cfg.seed),
                       "branching": int(data_cfg.branching), "mask_prob": float(data_cfg.mask_prob),
                       "vocab_size": int(model_cfg.vocab_size), "seq_length": int(model_cfg.seq_length)})


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


def load(prepared: str, model_cfg) -> SyntheticMLM:
    """The dataset for ranks that read data, generated from ``prepare``'s parameters."""
    return SyntheticMLM(**json.loads(prepared))
