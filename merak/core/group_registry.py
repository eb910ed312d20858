"""The named tensor-parallel groups that merak's collective operators run on.

The operators (``torch.ops.merak.*``) take plain arguments, so they name their
group (``"tp"``, and ``"tp_overlap"``, the second copy the sub-pipelined
overlap uses) instead of holding it. Each worker registers its groups here when
it builds them (``merak.init``); planning before launch registers *simulated*
groups, which keep shapes but send nothing.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

TP_GROUP = "tp"
OVERLAP_GROUP = "tp_overlap"


@dataclass(frozen=True)
class TPGroup:
    """A registered tensor-parallel group and this rank's place in it.

    ``group`` None with ``size`` > 1 is a *simulated* group: the collectives
    keep shapes but do not communicate (graph capture and cost measurement
    before launch, where no process group exists).
    """

    group: object
    rank: int
    size: int

    @property
    def simulated(self) -> bool:
        return self.group is None and self.size > 1


_GROUPS: dict[str, TPGroup] = {}
_THREAD = threading.local()


def register_group(name: str, group, *, rank: int, size: int) -> None:
    """Make ``group`` known to the operators under ``name`` (``group`` None: simulated, see TPGroup)."""
    _GROUPS[name] = TPGroup(group=group, rank=rank, size=size)


def unregister_groups() -> None:
    """Forget every registered group (on shutdown)."""
    _GROUPS.clear()


def resolve_name(name: str) -> str:
    """The group this thread uses for ``name`` (see :func:`groups_renamed`)."""
    return getattr(_THREAD, "renames", {}).get(name, name)


@contextlib.contextmanager
def groups_renamed(renames: dict[str, str]):
    """Within this block, on this thread only, operators naming group ``a`` use group ``renames[a]``.

    The sub-pipelined overlap runs the second half of a microbatch on another
    thread with its own copy of the tensor-parallel group, so the two halves'
    collectives can never be matched with each other across ranks.
    """
    previous = getattr(_THREAD, "renames", {})
    _THREAD.renames = {**previous, **renames}
    try:
        yield
    finally:
        _THREAD.renames = previous


def get_group(name: str) -> TPGroup:
    """The group registered under ``name``; a clear error when the worker never registered it."""
    name = resolve_name(name)
    try:
        return _GROUPS[name]
    except KeyError:
        raise RuntimeError(f"tensor-parallel group {name!r} is not registered: call merak.init(dp, tp, pp) "
                           "before running a tensor-parallel model") from None


def group_size(name: str) -> int:
    """Size of group ``name`` (1 when none is registered)."""
    entry = _GROUPS.get(name)
    return entry.size if entry is not None else 1


@contextlib.contextmanager
def groups_kept():
    """Within this block groups may be registered (planning a layout in the launching process); on
    exit the registry is as it was, so that process never becomes a worker of the layout it planned."""
    saved = dict(_GROUPS)
    try:
        yield
    finally:
        _GROUPS.clear()
        _GROUPS.update(saved)


@contextlib.contextmanager
def simulated_groups():
    """Within this block every registered group is simulated: shapes as usual, no messages.

    Used to run a tensor-parallel model once for its FLOPs and boundary shapes
    without every rank having to take part.
    """
    saved = dict(_GROUPS)
    _GROUPS.update({name: TPGroup(group=None, rank=e.rank, size=e.size) for name, e in saved.items()})
    try:
        yield
    finally:
        _GROUPS.clear()
        _GROUPS.update(saved)
