"""The text recipes' data caches (recipes/text.py) follow the files' content and survive damage.

In-process and small: a few lines of local text, the gpt recipe's offline GPT-2 BPE and a bert
WordPiece vocabulary trained on them, each test with its own cache folder.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from recipes import text, text_tokenizer
from recipes.bert import data as bert_data
from recipes.gpt import data as gpt_data

REPO = Path(__file__).resolve().parents[2]
OLD = "the cat sat on the mat\nand the dog slept by the door\n"
NEW = "the dog ran in the fog\nbut the cat hid under a tree.\n"
assert len(OLD) == len(NEW)


@pytest.fixture(autouse=True)
def hf_datasets_cache(tmp_path, monkeypatch) -> Path:
    """Where ``datasets`` keeps its own cache by default (~/.cache/huggingface/datasets), here private."""
    import datasets.config

    folder = tmp_path / "hf-datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", folder)
    return folder


def _conf(recipe: str, *parts: str):
    return OmegaConf.load(REPO / "recipes" / recipe / "conf" / Path(*parts))


def _files_cfg(recipe: str, cache: Path, *files: Path):
    return OmegaConf.merge(_conf(recipe, "data", "files.yaml"),
                           {"cache_dir": str(cache), "files": [str(f) for f in files]})


def _gpt_tokens(data_cfg) -> np.ndarray:
    return np.array(np.load(gpt_data.prepare(data_cfg, _conf("gpt", "model", "toy.yaml")), mmap_mode="r"))


def _expected_gpt_tokens(content: str) -> np.ndarray:
    encoder = text_tokenizer.load("gpt2").encoder()
    return text.tokenize(encoder, [line for line in content.split("\n") if line], separator=gpt_data.END_OF_TEXT)


def _rewrite_keeping_size_and_mtime(path: Path, content: str) -> None:
    """Edit ``path`` as a copy with ``cp -p`` / ``rsync -t`` / ``tar x`` would: same size, mtime restored."""
    before = path.stat()
    path.write_text(content)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def _damage_warnings(caplog) -> list[str]:
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    return [m for m in messages if "damaged cache" in m]


def test_an_edit_with_the_same_size_and_mtime_is_tokenized_again(tmp_path, hf_datasets_cache):
    path = tmp_path / "train.txt"
    path.write_text(OLD)
    data_cfg = _files_cfg("gpt", tmp_path / "cache", path)
    assert np.array_equal(_gpt_tokens(data_cfg), _expected_gpt_tokens(OLD))
    _rewrite_keeping_size_and_mtime(path, NEW)
    assert np.array_equal(_gpt_tokens(data_cfg), _expected_gpt_tokens(NEW))
    # datasets' own cache is inside data.cache_dir and gone once read: nothing in ~/.cache/huggingface.
    assert not hf_datasets_cache.exists() or not any(hf_datasets_cache.iterdir())
    assert not list((tmp_path / "cache").glob("datasets-*"))


def test_the_digest_memo_saves_reading_the_file_and_misses_after_an_edit(tmp_path, monkeypatch):
    """The content digest is memoised by the file's stat, ctime included (which cp -p cannot restore)."""
    monkeypatch.setattr(text, "RACY_NS", 0)  # memoise files written a moment ago (this test's)
    path = tmp_path / "train.txt"
    path.write_text(OLD)
    cache = tmp_path / "cache"
    data_cfg = _files_cfg("gpt", cache, path)
    prepared = gpt_data.prepare(data_cfg, _conf("gpt", "model", "toy.yaml"))
    memo = json.loads((cache / text.DIGESTS).read_text())
    assert list(memo) == [os.path.realpath(path)]

    real_sha256 = text._sha256

    def no_reading(name):
        raise AssertionError(f"{name} was read again")

    monkeypatch.setattr(text, "_sha256", no_reading)
    assert gpt_data.prepare(data_cfg, _conf("gpt", "model", "toy.yaml")) == prepared
    ctime = path.stat().st_ctime_ns
    time.sleep(0.05)  # past the file system's timestamp granularity, so the edit's ctime differs
    _rewrite_keeping_size_and_mtime(path, NEW)
    assert path.stat().st_ctime_ns != ctime
    monkeypatch.setattr(text, "_sha256", real_sha256)
    assert np.array_equal(_gpt_tokens(data_cfg), _expected_gpt_tokens(NEW))


def test_a_damaged_digest_memo_is_dropped(tmp_path, caplog):
    path = tmp_path / "train.txt"
    path.write_text(OLD)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / text.DIGESTS).write_text('{"/a": {"stat": [1, 2')
    with caplog.at_level(logging.WARNING):
        tokens = _gpt_tokens(_files_cfg("gpt", cache, path))
    assert np.array_equal(tokens, _expected_gpt_tokens(OLD))
    warnings = _damage_warnings(caplog)
    assert len(warnings) == 1 and str(cache / text.DIGESTS) in warnings[0]


@pytest.mark.parametrize("keep", [0, 3, 60, 0.5], ids=["empty", "magic", "header", "half"])
def test_a_damaged_token_cache_is_named_dropped_and_rebuilt(keep, tmp_path, caplog):
    path = tmp_path / "train.txt"
    path.write_text(OLD)
    data_cfg = _files_cfg("gpt", tmp_path / "cache", path)
    prepared = gpt_data.prepare(data_cfg, _conf("gpt", "model", "toy.yaml"))
    original = np.array(np.load(prepared))
    size = os.path.getsize(prepared)
    os.truncate(prepared, int(size * keep) if isinstance(keep, float) else keep)
    with caplog.at_level(logging.WARNING):
        assert gpt_data.prepare(data_cfg, _conf("gpt", "model", "toy.yaml")) == prepared
    warnings = _damage_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"damaged cache {prepared} (") and warnings[0].endswith("): rebuilding")
    assert "allow_pickle" not in warnings[0]
    assert np.array_equal(np.load(prepared), original)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        gpt_data.prepare(data_cfg, _conf("gpt", "model", "toy.yaml"))
    assert not _damage_warnings(caplog)  # rebuilt: the next run trusts it


def test_a_damaged_tokenizer_cache_is_named_dropped_and_rebuilt(tmp_path, caplog):
    path = tmp_path / "train.txt"
    path.write_text((OLD + NEW) * 20)
    model_cfg = _conf("bert", "model", "toy.yaml")
    data_cfg = _files_cfg("bert", tmp_path / "cache", path)
    prepared = json.loads(bert_data.prepare(data_cfg, model_cfg))
    vocabulary = Path(prepared["tokenizer"]).read_text()
    tokens = np.array(np.load(prepared["tokens"]))
    Path(prepared["tokenizer"]).write_text(vocabulary[:len(vocabulary) // 2])
    with caplog.at_level(logging.WARNING):
        again = json.loads(bert_data.prepare(data_cfg, model_cfg))
    assert again == prepared
    warnings = _damage_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"damaged cache {prepared['tokenizer']} (") and warnings[0].endswith("): rebuilding")
    assert Path(prepared["tokenizer"]).read_text() == vocabulary
    assert np.array_equal(np.load(prepared["tokens"]), tokens)
