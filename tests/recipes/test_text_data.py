"""The real-text data of the bert and t5 recipes (and the shared sources in recipes/text.py).

Offline only: the vocabularies are trained here on the Python documentation text (or a small
CSV), in a private cache; nothing is downloaded.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from train_py import run_in_process

from merak.config import ConfigError
from recipes import text
from recipes.bert import data as bert_data
from recipes.t5 import data as t5_data

REPO = Path(__file__).resolve().parents[2]
SENTENCE = "The quick brown fox jumps over the lazy dog."


def _conf(recipe: str, *parts: str):
    return OmegaConf.load(REPO / "recipes" / recipe / "conf" / Path(*parts))


def _data_cfg(recipe: str, name: str, cache: Path, **overrides):
    return OmegaConf.merge(_conf(recipe, "data", f"{name}.yaml"), {"cache_dir": str(cache)}, overrides)


def _dataset(recipe: str, cache: Path, name: str = "python_docs", model: str = "toy", **overrides):
    module = bert_data if recipe == "bert" else t5_data
    model_cfg = _conf(recipe, "model", f"{model}.yaml")
    return module.load(module.prepare(_data_cfg(recipe, name, cache, **overrides), model_cfg), model_cfg), model_cfg


@pytest.fixture(scope="module")
def bert_toy(cache_dir):
    return _dataset("bert", cache_dir)


@pytest.fixture(scope="module")
def t5_toy(cache_dir):
    return _dataset("t5", cache_dir)


def test_default_data_is_python_docs():
    for recipe in ("bert", "t5"):
        assert "  - data: python_docs\n" in (REPO / "recipes" / recipe / "conf" / "train.yaml").read_text()
        assert _conf(recipe, "data", "synthetic.yaml").source == "synthetic"  # still available


def test_bert_wordpiece_round_trip(bert_toy):
    dataset, model_cfg = bert_toy
    tokenizer = dataset.tokenizer()
    assert [tokenizer.token_to_id(t) for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")] == [0, 1, 2, 3, 4]
    assert dataset.vocab_size == tokenizer.get_vocab_size() <= model_cfg.vocab_size
    ids = tokenizer.encode(SENTENCE, add_special_tokens=False).ids
    assert bert_data.TEXT_UNK not in ids
    assert tokenizer.decode(ids) == SENTENCE.lower()


def test_t5_unigram_round_trip_and_sentinels(t5_toy):
    dataset, model_cfg = t5_toy
    tokenizer = dataset.tokenizer()
    size = tokenizer.get_vocab_size()
    assert size <= model_cfg.vocab_size
    assert [tokenizer.token_to_id(t) for t in ("<pad>", "</s>", "<unk>")] == [0, 1, 2]
    assert tokenizer.token_to_id("<extra_id_0>") == dataset.sentinel == size - 1
    assert tokenizer.token_to_id("<extra_id_99>") == size - 100
    ids = tokenizer.encode(SENTENCE).ids
    assert t5_data.UNK not in ids and max(ids) < size - 100
    assert tokenizer.decode(ids) == SENTENCE


def test_bert_masking_follows_bert(bert_toy):
    dataset, model_cfg = bert_toy
    samples = [dataset[i] for i in range(200)]
    ids = torch.stack([s["input_ids"] for s in samples])
    labels = torch.stack([s["labels"] for s in samples])
    original = torch.stack([torch.from_numpy(np.asarray(dataset.tokens[i * dataset.block:(i + 1) * dataset.block],
                                                         dtype=np.int64)) for i in range(200)])
    assert ids.shape == labels.shape == (200, model_cfg.seq_length)
    assert (ids[:, 0] == bert_data.TEXT_CLS).all() and (ids[:, -1] == bert_data.TEXT_SEP).all()
    chosen = labels != -100
    words = original != bert_data.TEXT_SEP  # documents are joined with [SEP], which is never chosen
    assert not chosen[:, [0, -1]].any() and not chosen[:, 1:-1][~words].any()
    assert torch.equal(labels[:, 1:-1][chosen[:, 1:-1]], original[chosen[:, 1:-1]])  # labels: the original token
    assert torch.equal(ids[~chosen], torch.cat([ids[:, :1], original, ids[:, -1:]], dim=1)[~chosen])  # rest kept
    assert chosen.any(dim=1).all()
    assert 0.14 < chosen.sum() / words.sum() < 0.16  # 15 % of the word positions (rounded per sample)
    masked = (ids[chosen] == bert_data.TEXT_MASK).float().mean()
    kept = (ids[chosen] == labels[chosen]).float().mean()
    replaced = 1 - masked - kept
    assert chosen.sum() > 800
    assert abs(masked - 0.8) < 0.04 and abs(kept - 0.1) < 0.03 and abs(replaced - 0.1) < 0.03, (masked, kept)
    random_words = ids[chosen][(ids[chosen] != bert_data.TEXT_MASK) & (ids[chosen] != labels[chosen])]
    assert (random_words >= bert_data.TEXT_FIRST_WORD).all() and (random_words < dataset.vocab_size).all()


def _expand(inputs: list[int], targets: list[int], first_sentinel: int) -> list[int]:
    """The uncorrupted sequence: every sentinel of ``inputs`` replaced by its span in ``targets``."""
    spans, current = {}, None
    for token in targets[:-1]:
        if token > first_sentinel - 100:
            current = spans.setdefault(token, [])
        else:
            current.append(token)
    out = []
    for token in inputs[:-1]:
        out.extend(spans.pop(token) if token > first_sentinel - 100 else [token])
    assert not spans
    return out


def test_t5_span_corruption_invariants(t5_toy):
    dataset, model_cfg = t5_toy
    assert (dataset.raw_length, dataset.noise_tokens, dataset.noise_spans) == (34, 5, 2)
    assert t5_data.span_corruption_lengths(512, 128, 0.15, 3.0) == (568, 85, 28)  # t5-base: T5's 568 -> 512 / 114
    noise = 0
    for index in range(100):
        sample = dataset[index]
        assert sample["input_ids"].shape == (model_cfg.source_length,)
        assert sample["labels"].shape == sample["decoder_input_ids"].shape == (model_cfg.target_length,)
        inputs = sample["input_ids"].tolist()
        targets = [t for t in sample["labels"].tolist() if t != -100]
        assert inputs[-1] == targets[-1] == t5_data.EOS and t5_data.PAD not in inputs
        assert sample["labels"].tolist() == targets + [-100] * (model_cfg.target_length - len(targets))
        assert sample["decoder_input_ids"].tolist() == ([0, *targets, *[0] * model_cfg.target_length]
                                                        )[:model_cfg.target_length]
        sentinels = [t for t in inputs if t > dataset.sentinel - 100]
        assert sentinels == [dataset.sentinel - i for i in range(len(sentinels))]  # <extra_id_0>, <extra_id_1>, ...
        assert targets[0] == dataset.sentinel  # the target starts with <extra_id_0>
        chunk = dataset.tokens[index * dataset.raw_length:(index + 1) * dataset.raw_length].tolist()
        assert _expand(inputs, targets, dataset.sentinel) == chunk
        noise += len(targets) - 1 - len(sentinels)
    assert abs(noise / (100 * dataset.raw_length) - 0.15) < 0.01


@pytest.mark.parametrize("recipe", ["bert", "t5"])
def test_same_seed_same_samples(recipe, cache_dir):
    first, _ = _dataset(recipe, cache_dir)
    again, _ = _dataset(recipe, cache_dir)
    other, _ = _dataset(recipe, cache_dir, seed=7)
    assert len(first) == len(again) == len(other) > 1000
    for index in (0, 5, len(first) - 1):
        assert all(torch.equal(first[index][k], again[index][k]) for k in first[index])
        assert all(torch.equal(first[index][k], first[index][k]) for k in first[index])  # no state kept
    assert any(not torch.equal(first[i]["input_ids"], other[i]["input_ids"]) for i in range(5))


def _cache_files(cache: Path) -> list[Path]:
    """The tokenizers' and token arrays' files in ``cache`` (not the locks, nor the memo of the files' digests)."""
    return sorted(f for f in cache.iterdir() if f.suffix != ".lock" and f.name != text.DIGESTS)


def _csv(path: Path, rows: int = 60) -> Path:
    """A CSV of ``rows`` short documents in the seeds' train_context.csv style."""
    lines = ["id,title,text"] + [f'{i},row {i},"Row {i}: the quick brown fox jumps over the lazy dog, '
                                 f'and the dog sleeps."' for i in range(rows)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("recipe,train", [("bert", "wordpiece_tokenizer"), ("t5", "unigram_tokenizer")])
def test_second_prepare_reuses_the_cache(recipe, train, tmp_path, monkeypatch):
    """A small CSV (the caching does not depend on the source): the second prepare neither reads the text
    nor trains the vocabulary again, and leaves the cache files as they were."""
    module = bert_data if recipe == "bert" else t5_data
    model_cfg = _conf(recipe, "model", "toy.yaml")
    cache = tmp_path / "cache"
    data_cfg = _data_cfg(recipe, "files", cache, files=[str(_csv(tmp_path / "train_context.csv"))])
    prepared = module.prepare(data_cfg, model_cfg)
    files = _cache_files(cache)
    assert sorted(f.suffix for f in files) == [".json", ".npy"]  # the tokenizer and the tokens, nothing left over
    stamps = [f.stat().st_mtime_ns for f in files]

    def no_training(*args, **kwargs):
        raise AssertionError("the vocabulary was trained again")

    monkeypatch.setattr(module, train, no_training)
    monkeypatch.setattr("recipes.text.read_texts", no_training)
    assert module.prepare(data_cfg, model_cfg) == prepared
    assert _cache_files(cache) == files
    assert [f.stat().st_mtime_ns for f in files] == stamps
    # A different model vocabulary is another tokenizer.
    monkeypatch.undo()
    module.prepare(data_cfg, OmegaConf.merge(model_cfg, {"vocab_size": 800}))
    assert len(_cache_files(cache)) == 4


_TRAIN_SMALL = """
import merak, hashlib
from recipes.bert.data import wordpiece_tokenizer
from recipes.t5.data import unigram_tokenizer
from recipes.text import first_chars, python_docs_texts
texts = first_chars(python_docs_texts(), 150_000)
print(*(hashlib.sha256(train(texts, size).to_str().encode()).hexdigest()
        for train, size in ((wordpiece_tokenizer, 600), (unigram_tokenizer, 500))))
"""


@pytest.mark.timeout(120)
def test_vocabulary_training_is_the_same_in_every_process(capsys):
    """The trainers iterate hash maps seeded per process; the recipes make the result independent
    of that, so nodes that each train on the same text get the same ids (this process and another)."""
    other = subprocess.run([sys.executable, "-c", _TRAIN_SMALL], cwd=REPO, capture_output=True, text=True,
                           timeout=100, check=True).stdout.split()
    exec(compile(_TRAIN_SMALL, "<train-small>", "exec"), {})
    here = capsys.readouterr().out.split()
    assert len(here) == 2 and here == other


def test_csv_files_source(tmp_path):
    csv = _csv(tmp_path / "train_context.csv")
    for recipe in ("bert", "t5"):
        cfg = {"files": [str(csv)]}
        dataset, model_cfg = _dataset(recipe, tmp_path / "cache", name="files", **cfg)
        assert len(dataset) > 10
        words = dataset.tokenizer().decode(dataset.tokens[:60].tolist())
        assert "quick brown fox" in words.lower() and "row 0" in words.lower()
        sample = dataset[1]
        assert sample["input_ids"].max() < model_cfg.vocab_size
    module_problems = bert_data.check_data(_data_cfg("bert", "files", tmp_path, files=[str(tmp_path / "no.csv")]))
    assert module_problems == [f"data file not found: {tmp_path / 'no.csv'} (data.files)"]
    with pytest.raises(ValueError, match="data.text_column='body' is not a column"):
        _dataset("t5", tmp_path / "cache2", name="files", files=[str(csv)], text_column="body")


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """No dataset can be loaded from the hub, whatever this machine has cached."""
    import datasets.config
    import huggingface_hub.constants

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
        monkeypatch.setattr(datasets.config, name, True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")


@pytest.mark.parametrize("recipe", ["gpt", "bert", "t5"])
def test_hub_offline_names_the_dataset_and_suggests_files(recipe, offline_hub, tmp_path):
    module = __import__(f"recipes.{recipe}.data", fromlist=["data"])
    data_cfg = _data_cfg(recipe, "hub", tmp_path / "cache")
    assert data_cfg.name == "wikitext" and data_cfg.config == "wikitext-103-raw-v1"
    assert module.check_data(data_cfg) == []
    with pytest.raises(ConfigError) as error:
        module.prepare(data_cfg, _conf(recipe, "model", "toy.yaml"))
    message = str(error.value)
    assert "'wikitext' (config 'wikitext-103-raw-v1')" in message and "offline" in message
    assert "data=files" in message
    assert module.check_data(OmegaConf.merge(data_cfg, {"name": None})) == [
        "data.source=hub needs data.name (a datasets.load_dataset name, e.g. wikitext)"]


@pytest.mark.timeout(60)
def test_hub_offline_fails_before_workers_start(offline_hub, tmp_path, monkeypatch):
    """merak.run of the bert recipe raises ConfigError in this process before any worker exists (train.py's
    exit status and one-line message for such an error: tests/recipes/test_console.py)."""
    monkeypatch.setenv("MERAK_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ConfigError) as error:
        run_in_process("bert", ["model=toy", "data=hub"], tmp_path / "run")
    message = str(error.value)
    assert "cannot load the dataset 'wikitext' (config 'wikitext-103-raw-v1')" in message and "data=files" in message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_unknown_source_is_reported():
    for module in (bert_data, t5_data):
        problems = module.check_data(OmegaConf.create({"source": "c4", "seed": 1}))
        assert problems == ["unknown data.source='c4'; use python_docs, files, hub or synthetic"]
