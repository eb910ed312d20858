"""How the tensors of a point-to-point group travel; the pipeline's send/receive semantics in one place.

A transport posts one *group* of sends and receives (``(tensor, global peer rank)`` each) and returns
the works of the sends and of the receives. Messages between two ranks are matched by posting order
alone, per direction: tags are not used for payloads, since NCCL has none.

* ``batched`` (NCCL): one ``batch_isend_irecv``. NCCL runs a group as one, and a send only completes
  when the peer's matching receive runs: two neighbours that each post a send to the other outside one
  group wait on each other forever.
* ``posted`` (gloo): each send and receive posted on its own; gloo sends complete without the peer.
* ``rendezvous``: gloo given NCCL's semantics, for tests (``MERAK_P2P_RENDEZVOUS=1``). A group runs
  as one, blocking the caller until every operation in it has met its partner: a send completes only
  once the peer's matching receive has run (the receiver acknowledges each payload), so operations with
  one peer run in the order they were posted, sends and receives alike. A pattern that deadlocks on
  NCCL deadlocks here too, and fails at the process group's timeout instead of passing.

The CPU side channel that carries descriptions (:mod:`merak.distributed.p2p`) is gloo in every mode,
buffered as gloo is (with NCCL it is the group's gloo half).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist

# gloo matches by (source, tag): the side channel and the acknowledgements keep apart from payloads.
PAYLOAD_TAG = 0
HEADER_TAG = 1
ACK_TAG = 2
RENDEZVOUS_ENV = "MERAK_P2P_RENDEZVOUS"
TRANSPORTS = ("batched", "posted", "rendezvous")

Messages = Sequence[tuple[torch.Tensor, int]]


class Transport(Protocol):
    """Posts one group of payload sends and receives."""

    def post(self, sends: Messages, recvs: Messages) -> tuple[list, list]:
        """Post ``sends`` and ``recvs`` as one group; return (send works, receive works)."""
        ...


class _Done:
    """A work that has already completed (the rendezvous transport finishes its groups in ``post``)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class BatchedTransport:
    """One ``batch_isend_irecv`` per group (NCCL)."""

    def __init__(self, group=None) -> None:
        self.group = group

    def post(self, sends: Messages, recvs: Messages) -> tuple[list, list]:
        ops = [dist.P2POp(dist.isend, t, peer, self.group, PAYLOAD_TAG) for t, peer in sends] + \
              [dist.P2POp(dist.irecv, t, peer, self.group, PAYLOAD_TAG) for t, peer in recvs]
        if not ops:
            return [], []
        works = dist.batch_isend_irecv(ops)
        return works[:len(sends)], works[len(sends):]


class PostedTransport:
    """Each send and receive posted on its own (gloo, whose sends complete without the peer)."""

    def __init__(self, group=None) -> None:
        self.group = group

    def post(self, sends: Messages, recvs: Messages) -> tuple[list, list]:
        return ([dist.isend(t, peer, group=self.group, tag=PAYLOAD_TAG) for t, peer in sends],
                [dist.irecv(t, peer, group=self.group, tag=PAYLOAD_TAG) for t, peer in recvs])


class RendezvousTransport:
    """gloo with NCCL's semantics (see the module docstring); blocks until the whole group has met."""

    def __init__(self, group=None) -> None:
        self.group = group

    def post(self, sends: Messages, recvs: Messages) -> tuple[list, list]:
        sent = [dist.isend(t, peer, group=self.group, tag=PAYLOAD_TAG) for t, peer in sends]
        arriving = [dist.irecv(t, peer, group=self.group, tag=PAYLOAD_TAG) for t, peer in recvs]
        for work in arriving:
            work.wait()
        acks = [dist.isend(torch.ones(1, dtype=torch.uint8), peer, group=self.group, tag=ACK_TAG)
                for _, peer in recvs]
        for _, peer in sends:  # each send completes when its receive has run
            dist.recv(torch.empty(1, dtype=torch.uint8), peer, group=self.group, tag=ACK_TAG)
        for work in sent + acks:
            work.wait()
        return [_Done() for _ in sends], [_Done() for _ in recvs]


def transport_name(device: torch.device, name: str | None = None) -> str:
    """``name``, else ``rendezvous`` when ``$MERAK_P2P_RENDEZVOUS`` is set to 1, else ``batched`` on CUDA
    (NCCL) and ``posted`` elsewhere (gloo)."""
    if name is None:
        if os.environ.get(RENDEZVOUS_ENV, "0") == "1":
            return "rendezvous"
        return "batched" if torch.device(device).type == "cuda" else "posted"
    if name not in TRANSPORTS:
        raise ValueError(f"unknown point-to-point transport {name!r}; choose one of {', '.join(TRANSPORTS)}")
    return name


def make_transport(device: torch.device, group=None, name: str | None = None) -> Transport:
    """The transport called ``name`` (see :func:`transport_name`)."""
    chosen = transport_name(device, name)
    if chosen == "rendezvous" and torch.device(device).type == "cuda":
        raise ValueError(f"{RENDEZVOUS_ENV}=1 emulates NCCL on gloo; it needs CPU tensors")
    return {"batched": BatchedTransport, "posted": PostedTransport, "rendezvous": RendezvousTransport}[chosen](group)
