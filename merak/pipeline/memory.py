"""Counting the activation memory a stage keeps for backward, on any device.

A saved-tensor hook sees every tensor autograd stores for backward; the
meter files its storage (by address, so views and reuse count once) under
the microbatch being computed, and forgets the microbatch when its backward
is done. Parameters are not activations and are skipped. Tensors kept by a
checkpointed region (its inputs) and received stage inputs are filed too.
The peak of the sum over microbatches in flight is the stage's peak
activation memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch.utils import _pytree as pytree


def _storage(tensor: torch.Tensor) -> tuple[int, int] | None:
    if tensor.device.type == "meta":
        return None
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class ActivationMeter:
    """Bytes of saved activations per microbatch in flight, and their peak.

    Args:
        parameters: The stage's parameters (never counted).
    """

    def __init__(self, parameters: Iterable[torch.Tensor]) -> None:
        # By storage object, not address: ZeRO-3 frees a parameter's storage and reallocates it where it runs.
        self._parameter_storages = {p.untyped_storage()._cdata for p in parameters if p.device.type != "meta"}
        self._kept: dict[object, dict[int, int]] = {}
        self._current: object | None = None
        self.peak_bytes = 0

    def _file(self, tensor: torch.Tensor) -> None:
        if self._current is None or not isinstance(tensor, torch.Tensor):
            return
        found = _storage(tensor)
        if found is not None and found[0] != 0 and tensor.untyped_storage()._cdata not in self._parameter_storages:
            self._kept.setdefault(self._current, {})[found[0]] = found[1]

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._file(tensor)
        return tensor

    @contextlib.contextmanager
    def saving(self, key: object) -> Iterator[None]:
        """File what autograd saves inside the block under ``key``."""
        previous, self._current = self._current, key
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
                yield
        finally:
            self._current = previous
            self.peak_bytes = max(self.peak_bytes, self.live_bytes())

    def keep(self, key: object, payload) -> None:
        """File the tensors of ``payload`` (e.g. received stage inputs) under ``key``."""
        previous, self._current = self._current, key
        for leaf in pytree.tree_leaves(payload):
            self._file(leaf)
        self._current = previous
        self.peak_bytes = max(self.peak_bytes, self.live_bytes())

    @property
    def current_key(self) -> object | None:
        """The key being filed under (None outside :meth:`saving`)."""
        return self._current

    def kept_storages(self, key: object) -> set[int]:
        """Addresses of the storages filed under ``key``."""
        return set(self._kept.get(key, {}))

    def release(self, key: object) -> None:
        """Forget ``key`` (its backward is done)."""
        self._kept.pop(key, None)

    def live_bytes(self) -> int:
        """Bytes filed under all microbatches in flight (a storage shared by two counts once)."""
        merged: dict[int, int] = {}
        for storages in self._kept.values():
            merged.update(storages)
        return sum(merged.values())

    def reset(self) -> None:
        """Start a new measurement (peak and filings)."""
        self._kept.clear()
        self.peak_bytes = 0


class NoMeter:
    """Stands in for :class:`ActivationMeter` when activations are not measured: nothing runs per
    saved tensor, and there is no peak to report (``peak_bytes`` is None)."""

    peak_bytes = None
    current_key = None

    def saving(self, key: object) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def keep(self, key: object, payload) -> None:
        pass

    def release(self, key: object) -> None:
        pass

    def reset(self) -> None:
        pass


# The meter of the step being run; StageModule reports checkpoint inputs to it.
_active: dict[str, ActivationMeter | None] = {"meter": None}


def note_kept(payload) -> None:
    """Called for tensors a checkpointed region keeps without autograd seeing them (its inputs)."""
    meter = _active["meter"]
    if meter is not None and meter.current_key is not None:
        meter.keep(meter.current_key, payload)



@contextlib.contextmanager
def active_meter(meter: ActivationMeter | None) -> Iterator[None]:
    """Make ``meter`` the one :func:`note_kept` reports to."""
    previous, _active["meter"] = _active["meter"], meter
    try:
        yield
    finally:
        _active["meter"] = previous
