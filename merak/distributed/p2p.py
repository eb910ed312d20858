"""Point-to-point transfer of pytrees between pipeline stages.

Any pytree (tensors, tuples, lists, dicts, ints, floats, strings, None) can
cross a stage boundary. Each transfer starts with a two-integer header; when
the structure, a dtype, a shape or a non-tensor value differs from the
previous transfer on the same channel, the header announces a new description
(JSON, never pickle) that follows it. So shapes may change from one
microbatch to the next and are renegotiated, never silently reused, while the
steady state costs one 16-byte message per transfer.

Sends are posted asynchronously and return their pending works; receives
block until the payload is complete. :meth:`PointToPoint.exchange` sends and
receives together in three batched rounds (headers, descriptions, tensors),
each one ``batch_isend_irecv`` group: with NCCL, where a send and a receive
with the same peer share one stream, posting them separately could leave both
peers' sends waiting for receives queued behind them. (gloo does not need it,
and there the rounds cost a round trip per exchange.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

_DTYPES = {str(dtype): dtype for dtype in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
)}


def _describe(payload) -> tuple[str, list[torch.Tensor]]:
    leaves, spec = pytree.tree_flatten(payload)
    tensors, leaf_notes = [], []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if str(leaf.dtype) not in _DTYPES:
                raise TypeError(f"cannot send a tensor of dtype {leaf.dtype} between stages")
            tensors.append(leaf)
            leaf_notes.append({"tensor": [str(leaf.dtype), list(leaf.shape), leaf.requires_grad]})
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            leaf_notes.append({"value": leaf})
        else:
            raise TypeError(
                f"cannot send a {type(leaf).__name__} between pipeline stages; stage outputs may "
                "hold tensors, numbers, strings and None inside tuples, lists and dicts"
            )
    text = json.dumps({"spec": pytree.treespec_dumps(spec), "leaves": leaf_notes})
    return text, tensors


def _wire_tensor(tensor: torch.Tensor) -> torch.Tensor:
    # Not every backend moves bool tensors; their bytes travel as uint8.
    tensor = tensor.detach().contiguous()
    return tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor


@dataclass
class Channel:
    """One direction of traffic with one peer; remembers the last description."""

    last_description: str | None = None
    layout: dict | None = field(default=None, repr=False)


class PointToPoint:
    """Sends and receives pytrees with the neighbouring stages.

    Args:
        device: where received tensors are allocated.
        group: process group used for p2p (None: the default group).
        batched_exchange: whether a send and a receive with the same neighbour go through
            :meth:`exchange`'s batched rounds (the executor's choice for an ``Exchange``). NCCL needs
            them; with gloo, whose sends never wait on the peer, posting sends and then receiving
            saves a round trip per exchange. Default: batched on CUDA devices (NCCL).
    """

    def __init__(self, device: torch.device, group=None, batched_exchange: bool | None = None) -> None:
        self.device = device
        self.group = group
        self.batched_exchange = torch.device(device).type == "cuda" if batched_exchange is None else batched_exchange
        self._send_channels: dict[tuple[int, int], Channel] = {}
        self._recv_channels: dict[tuple[int, int], Channel] = {}

    def _channel(self, table: dict[tuple[int, int], Channel], peer: int, tag: int) -> Channel:
        return table.setdefault((peer, tag), Channel())

    def _outgoing(self, payload, peer: int, tag: int) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
        """The header, the description when it changed, and the tensors of one transfer, on the device."""
        channel = self._channel(self._send_channels, peer, tag)
        description, tensors = _describe(payload)
        changed = description != channel.last_description
        encoded = description.encode() if changed else b""
        # Header and description are made on the CPU; NCCL needs device tensors.
        header = torch.tensor([int(changed), len(encoded)], dtype=torch.int64).to(self.device)
        text = torch.frombuffer(bytearray(encoded), dtype=torch.uint8).to(self.device) if changed else None
        if changed:
            channel.last_description = description
        return header, text, [_wire_tensor(t) for t in tensors]

    def post_send(self, payload, peer: int, tag: int = 0) -> list:
        """Start sending ``payload`` to global rank ``peer``; return the works to wait on.

        Transfers with different tags are separate channels (gloo matches by tag;
        NCCL ignores tags, so there the order of posts must agree on both sides).
        The caller must keep ``payload`` unchanged until the works complete.
        """
        header, text, tensors = self._outgoing(payload, peer, tag)
        messages = [header, *([text] if text is not None else []), *tensors]
        return [dist.isend(m, peer, group=self.group, tag=tag) for m in messages]

    def exchange(self, sends, recvs) -> tuple[list, list]:
        """Send and receive together, in three batched rounds: headers, descriptions, tensors.

        Args:
            sends: ``(payload, peer, tag)`` for each payload to send.
            recvs: ``(peer, tag)`` for each payload to receive.

        Returns:
            The received payloads (in the order of ``recvs``) and the send works, which must
            complete before the sent payloads change (as with :meth:`post_send`).
        """
        outgoing = [self._outgoing(payload, peer, tag) for payload, peer, tag in sends]
        headers = [torch.empty(2, dtype=torch.int64, device=self.device) for _ in recvs]
        pending = self._batch([(h, peer, tag) for (h, _, _), (_, peer, tag) in zip(outgoing, sends)],
                              [(h, peer, tag) for h, (peer, tag) in zip(headers, recvs)])
        # Headers say which receives bring a new description, and how long it is.
        texts = [torch.empty(length, dtype=torch.uint8, device=self.device) if changed else None
                 for changed, length in (h.tolist() for h in headers)]
        pending += self._batch([(t, peer, tag) for (_, t, _), (_, peer, tag) in zip(outgoing, sends) if t is not None],
                               [(t, peer, tag) for t, (peer, tag) in zip(texts, recvs) if t is not None])
        layouts = [self._layout(peer, tag, text) for text, (peer, tag) in zip(texts, recvs)]
        buffers = [self._buffers(layout) for layout in layouts]
        pending += self._batch([(t, peer, tag) for (_, _, tensors), (_, peer, tag) in zip(outgoing, sends)
                                for t in tensors],
                               [(b, peer, tag) for (_, wire), (peer, tag) in zip(buffers, recvs) for b in wire])
        received = [self._assemble(layout, leaves) for layout, (leaves, _) in zip(layouts, buffers)]
        return received, pending

    def _batch(self, sends, recvs) -> list:
        """Post one batched round; wait for its receives; return its send works."""
        ops = [dist.P2POp(dist.isend, t, peer, self.group, tag) for t, peer, tag in sends] + \
              [dist.P2POp(dist.irecv, t, peer, self.group, tag) for t, peer, tag in recvs]
        if not ops:
            return []
        works = dist.batch_isend_irecv(ops)
        for work in works[len(sends):]:
            work.wait()
        return works[:len(sends)]

    def _layout(self, peer: int, tag: int, text: torch.Tensor | None) -> dict:
        """The receive channel's layout, replaced by the description in ``text`` when one came."""
        channel = self._channel(self._recv_channels, peer, tag)
        if text is not None:
            description = json.loads(bytes(text.cpu().tolist()).decode())
            channel.layout = {"spec": pytree.treespec_loads(description["spec"]), "leaves": description["leaves"]}
        elif channel.layout is None:
            raise RuntimeError(f"received a payload from rank {peer} before its description")
        return channel.layout

    def _buffers(self, layout: dict) -> tuple[list, list[torch.Tensor]]:
        """The payload's leaves (empty tensors to receive into, plain values as described) and
        the wire buffers the tensors arrive in."""
        leaves, wire = [], []
        for note in layout["leaves"]:
            if "tensor" not in note:
                leaves.append(note["value"])
                continue
            dtype_name, shape, _ = note["tensor"]
            dtype = _DTYPES[dtype_name]
            buffer = torch.empty(shape, dtype=torch.uint8 if dtype == torch.bool else dtype, device=self.device)
            wire.append(buffer)
            leaves.append(buffer.view(torch.bool) if dtype == torch.bool else buffer)
        return leaves, wire

    @staticmethod
    def _assemble(layout: dict, leaves: list):
        # A leaf that was part of the sender's autograd graph starts a graph here,
        # so backward can return its gradient.
        for note, leaf in zip(layout["leaves"], leaves):
            if "tensor" in note and note["tensor"][2]:
                leaf.requires_grad_(True)
        return pytree.tree_unflatten(leaves, layout["spec"])

    def recv(self, peer: int, tag: int = 0):
        """Receive the next pytree with ``tag`` from global rank ``peer`` (blocking)."""
        header = torch.empty(2, dtype=torch.int64, device=self.device)
        dist.recv(header, peer, group=self.group, tag=tag)
        changed, length = (int(v) for v in header.tolist())
        text = None
        if changed:
            text = torch.empty(length, dtype=torch.uint8, device=self.device)
            dist.recv(text, peer, group=self.group, tag=tag)
        layout = self._layout(peer, tag, text)
        leaves, wire = self._buffers(layout)
        for work in [dist.irecv(buffer, peer, group=self.group, tag=tag) for buffer in wire]:
            work.wait()
        return self._assemble(layout, leaves)
