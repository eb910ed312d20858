"""Synthetic sequence-to-sequence data, generated offline and deterministically from a seed.

The task: read a source of ``model.source_length`` tokens and write its first
``target_length - 1`` words, each replaced by the next word id (``w -> w + 1``,
the last word wrapping to the first), followed by end-of-sequence.
Ids follow T5: pad=0 (also the decoder start), eos=1, unk=2; words are ids from
3 up. Source words come from the same kind of fixed random Markov chain as the
bert recipe's data (Zipf-weighted successors, ``data.branching`` per word), so
both the marginal and the next-word distributions have structure to learn
before the copy itself is learnt.

Each sample is ``{input_ids, decoder_input_ids, labels}`` with fixed lengths
(graph capture specializes to them): ``labels`` is the target and
``decoder_input_ids`` the target shifted right behind the start token (0).

Nothing is downloaded or cached: ``prepare`` returns the generation parameters
as a JSON string and ``load`` generates the tensors from them.
"""

from __future__ import annotations

import json

import torch

PAD, EOS, UNK = 0, 1, 2
DECODER_START = PAD
FIRST_WORD = 3


def check_data(data_cfg) -> list[str]:
    """Problems with the data settings that can be seen without generating the data."""
    problems = []
    if data_cfg.get("source", "synthetic") != "synthetic":
        problems.append(f"unknown data.source={data_cfg.source!r}; use synthetic")
    if not isinstance(data_cfg.get("num_samples"), int) or data_cfg.num_samples < 1:
        problems.append(f"data.num_samples={data_cfg.get('num_samples')!r} must be a positive integer")
    if not isinstance(data_cfg.get("branching"), int) or data_cfg.branching < 1:
        problems.append(f"data.branching={data_cfg.get('branching')!r} must be a positive integer")
    return problems


def prepare(data_cfg, model_cfg) -> str:
    """The generation parameters as JSON (nothing to download or tokenize)."""
    problems = check_data(data_cfg)
    if problems:
        raise ValueError("; ".join(problems))
    return json.dumps({"num_samples": int(data_cfg.num_samples), "seed": int(data_cfg.seed),
                       "branching": int(data_cfg.branching), "vocab_size": int(model_cfg.vocab_size),
                       "source_length": int(model_cfg.source_length),
                       "target_length": int(model_cfg.target_length)})


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


def load(prepared: str, model_cfg) -> SyntheticSeq2Seq:
    """The dataset for ranks that read data, generated from ``prepare``'s parameters."""
    return SyntheticSeq2Seq(**json.loads(prepared))
