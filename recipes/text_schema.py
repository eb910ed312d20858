"""The ``data`` fields of the language-model recipes: the text source (``recipes/text.py``) every one
reads, and the self-trained vocabulary and synthetic words bert and t5 add."""

from __future__ import annotations

from dataclasses import dataclass

from merak.core.fields import non_negative, positive, setting
from recipes.schema import positive_int


@dataclass(frozen=True)
class TextSource:
    """Where the text comes from (``data.source``) and where its caches go."""

    source: str = setting("python_docs", "python_docs (offline) | files | hub (recipes/text.py)")
    files: list[str] | None = setting(None, "source=files: .txt, .csv or .jsonl paths")
    text_column: str = setting("text", "the column holding the text (.csv, .jsonl, hub datasets)")
    name: str | None = setting(None, "source=hub: the datasets.load_dataset name, e.g. wikitext")
    config: str | None = setting(None, "source=hub: the dataset's config, e.g. wikitext-103-raw-v1")
    split: str = setting("train", "source=hub: the split read")
    cache_dir: str = setting("~/.cache/merak", "tokenizers and token arrays ($MERAK_CACHE_DIR)")


@dataclass(frozen=True)
class SelfTrainedText(TextSource):
    """Text tokenized with a vocabulary trained on it (bert, t5), or offline synthetic words
    (``source=synthetic``: a random Markov chain over word ids)."""

    tokenizer_chars: int | None = setting(None, "characters of text the vocabulary is trained on (null: all "
                                                "of it)", check=positive,
                                          requirement="must be a positive integer or null (all the text)")
    # numpy's generators, seeded with (seed, sample index), take no negative seed.
    seed: int = setting(1234, "sample i draws its masking or spans from a generator seeded with (seed, i); "
                              "synthetic: also the Markov chain", check=non_negative,
                        requirement="must be an integer >= 0")
    num_samples: int = positive_int(4096, "source=synthetic: samples generated")
    branching: int = positive_int(4, "source=synthetic: successors of each word in the Markov chain")
