"""data.tokenizer: the causal-LM text data with the offline GPT-2 BPE or any Hugging Face tokenizer.

Offline only (conftest sets HF_HUB_OFFLINE=1): the Hugging Face tokenizer is a small BPE trained
here and saved as a tokenizer directory, as `save_pretrained` writes one.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf
from train_py import run_in_process

from merak.config import ConfigError
from recipes import text_tokenizer
from recipes.gpt import data

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = ["The quick brown fox jumps over the lazy dog.", "def main(): return 0", "A third document."]


def _tokenizer_dir(folder: Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE of ``vocab_size`` tokens (``<eos>`` among them) saved as a tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(DOCUMENTS * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>").save_pretrained(str(folder))
    return folder


def _data_cfg(tmp_path: Path, **overrides):
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():  # written once: the token cache's name depends on the file's time
        corpus.write_text("\n".join(DOCUMENTS) + "\n", encoding="utf-8")
    base = OmegaConf.load(REPO / "recipes/gpt/conf/data/files.yaml")
    return OmegaConf.merge(base, {"files": [str(corpus)], "cache_dir": str(tmp_path / "cache")}, overrides)


def _model_cfg(vocab_size: int):
    return OmegaConf.merge(OmegaConf.load(REPO / "recipes/gpt/conf/model/toy.yaml"), {"vocab_size": vocab_size})


def test_default_is_the_offline_gpt2_bpe_with_its_old_cache(tmp_path):
    """No tokenizer setting, gpt2 and openai-community/gpt2 are one vocabulary and one token cache."""
    tokenizer = text_tokenizer.load(None)
    assert tokenizer.encoder().encode("Hello world").ids == [15496, 995]
    assert (tokenizer.vocab_size, tokenizer.separator, tokenizer.key) == (50257, data.END_OF_TEXT, "gpt2-bpe")
    without = _data_cfg(tmp_path)
    del without["tokenizer"]  # data configs written before data.tokenizer existed
    paths = {data.prepare(cfg, _model_cfg(50257)) for cfg in
             (without, _data_cfg(tmp_path), _data_cfg(tmp_path, tokenizer="openai-community/gpt2"))}
    assert len(paths) == 1
    tokens = np.load(paths.pop())
    assert (tokens == data.END_OF_TEXT).sum() == len(DOCUMENTS)


def test_hugging_face_tokenizer_by_path(tmp_path):
    folder = _tokenizer_dir(tmp_path / "tok")
    tokenizer = text_tokenizer.load(str(folder))
    assert tokenizer.vocab_size == 300 and tokenizer.separator == 0  # <eos>, the first special token
    tokens = np.load(data.prepare(_data_cfg(tmp_path, tokenizer=str(folder)), _model_cfg(300)))
    assert tokens.max() < 300 and (tokens == 0).sum() == len(DOCUMENTS)
    assert tokens[-1] == 0
    # Another tokenizer at the same path gets its own token cache.
    other = _tokenizer_dir(tmp_path / "tok", vocab_size=280)
    again = data.prepare(_data_cfg(tmp_path, tokenizer=str(other)), _model_cfg(300))
    assert np.load(again).max() < 280


def test_vocabulary_larger_than_the_model_names_the_fix(tmp_path):
    folder = _tokenizer_dir(tmp_path / "tok")
    with pytest.raises(ConfigError, match=r"model.vocab_size=200 is smaller than the vocabulary of data.tokenizer="
                                          r".* \(300 tokens\): set model.vocab_size=300"):
        data.prepare(_data_cfg(tmp_path, tokenizer=str(folder)), _model_cfg(200))


def test_tokenizer_that_cannot_load_names_the_offline_choices(tmp_path):
    with pytest.raises(ConfigError, match=r"data.tokenizer='meta-llama/Llama-3.2-1B': .*offline .*"
                                          r"data.tokenizer=/path/to/tokenizer\) or the offline default "
                                          r"data.tokenizer=gpt2"):
        text_tokenizer.load("meta-llama/Llama-3.2-1B")
    with pytest.raises(ConfigError, match="no such directory"):
        text_tokenizer.load(str(tmp_path / "missing"))


def test_a_local_tokenizer_directory_that_cannot_load_says_why_even_offline(tmp_path, monkeypatch):
    """Offline or not, a local directory is read from disk: the Hugging Face cache is beside the point."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "tok").mkdir()
    with pytest.raises(ConfigError, match=r"data.tokenizer='.*tok': transformers.AutoTokenizer cannot load it "
                                          r"\((OSError|ValueError)") as refused:
        text_tokenizer.load(str(tmp_path / "tok"))
    assert "Hugging Face cache" not in str(refused.value)


@pytest.mark.recipe
@pytest.mark.timeout(120)
def test_recipe_trains_with_a_tokenizer_directory(tmp_path, cache_dir):
    """The gpt recipe (in this process, one process) trains with a local tokenizer whose vocabulary sizes
    the model."""
    folder = _tokenizer_dir(tmp_path / "tok")
    summary = run_in_process("gpt", ["model=toy", "model.vocab_size=300", f"data.tokenizer={folder}",
                                     "parallel=single", "trainer.max_steps=2",
                                     "trainer.per_device_train_batch_size=2", "trainer.gradient_accumulation_steps=2"],
                             tmp_path / "run")
    assert summary == json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["first_loss"] == pytest.approx(np.log(300), rel=0.1)
