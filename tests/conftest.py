"""Shared fixtures: offline settings, the toy GPT config and its prepared data."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite runs its files in parallel processes (pytest-xdist, one per core), and many tests launch
# more: each computes on one thread, as merak's own workers do. More compute threads than cores leave
# every process spin-waiting for the others' (OpenMP), several times slower than one thread each.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import merak  # noqa: E402,F401  (applies the torchvision fallback before transformers loads)

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """A private data cache, so tests never depend on (or pollute) the user's cache."""
    path = tmp_path_factory.mktemp("merak-cache")
    os.environ["MERAK_CACHE_DIR"] = str(path)
    return path


@pytest.fixture(scope="session")
def toy_model_cfg():
    from omegaconf import OmegaConf

    return OmegaConf.load(REPO / "recipes/gpt/conf/model/toy.yaml")


@pytest.fixture(scope="session")
def toy_tokens(cache_dir, toy_model_cfg) -> str:
    """Path of the tokenized offline corpus (python_docs) for the toy model."""
    from omegaconf import OmegaConf

    from recipes.gpt import data

    data_cfg = OmegaConf.create({"source": "python_docs", "files": None, "text_column": "text",
                                 "cache_dir": str(cache_dir)})
    return data.prepare(data_cfg, toy_model_cfg)


@pytest.fixture(scope="module", autouse=True)
def _one_capture_per_model(request):
    """Each test module captures a model once, as one run does (merak.trace.reuse): a later build of the
    same model, in this process or in a world forked from it, is rebuilt from the first graph. A module
    that tests the reuse itself sets ``REUSES_CAPTURES = False``."""
    from merak.trace.reuse import captures_reused

    with captures_reused() if getattr(request.module, "REUSES_CAPTURES", True) else contextlib.nullcontext():
        yield


@pytest.fixture(autouse=True)
def _process_state_as_found(monkeypatch):
    """Test files share pytest worker processes, and dist tests fork their worlds from them: each test
    leaves merak's process-wide state (tensor-parallel groups, the vocabulary-split loss, the plan of
    set_tp_layer_lists) as it found it."""
    from merak.tensor_parallel import seed_api
    from merak.tensor_parallel.options import tensor_parallel_state_kept

    monkeypatch.setitem(seed_api._USER_PLAN, "plan", seed_api._USER_PLAN["plan"])
    with tensor_parallel_state_kept():
        yield
