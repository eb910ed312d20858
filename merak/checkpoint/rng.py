"""Random-number generator states as JSON (python, numpy, torch CPU and CUDA), never pickled."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_all(seed: int) -> None:
    """Seed Python's, numpy's and torch's (CPU and every CUDA device's) global generators, so two runs
    with the same seed draw the same numbers (and save the same states) wherever user code draws."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def capture_rng() -> dict:
    version, state, gauss = random.getstate()
    kind, keys, position, has_gauss, cached = np.random.get_state()
    out = {"python": [version, list(state), gauss],
           "numpy": [kind, keys.tolist(), int(position), int(has_gauss), float(cached)],
           "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return out


def restore_rng(saved: dict) -> None:
    version, state, gauss = saved["python"]
    random.setstate((version, tuple(state), gauss))
    kind, keys, position, has_gauss, cached = saved["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached))
    torch.set_rng_state(torch.tensor(saved["torch"], dtype=torch.uint8))
    if "cuda" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in saved["cuda"]])
