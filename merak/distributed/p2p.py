"""Point-to-point transfer of pytrees between pipeline stages.

Any pytree (tensors, tuples, lists, dicts, ints, floats, strings, None) can cross a stage boundary.
What crosses travels on two paths:

* **the description** (the structure, each tensor's dtype, shape and ``requires_grad``, the non-tensor
  values) goes over a CPU side channel: a two-integer header per transfer, followed by the description
  itself (JSON, never pickle) only when it differs from the previous one on the same channel. With
  NCCL the side channel is the process group's gloo half (``cpu:gloo,cuda:nccl``), so no device tensor
  is ever read on the host to learn what arrives: a receive costs no host-device synchronisation, and
  shapes may still change from one microbatch to the next;
* **the tensors** go over the :mod:`transport <merak.distributed.transports>` as one batched group per
  call of :meth:`PointToPoint.post`, matched on the wire by posting order alone (no tags: NCCL has none).

A receive returns its payload at once, its tensors still arriving: :meth:`Transfer.wait` (which the
executor calls just before the payload's first use) makes them usable, on NCCL without blocking the
host (the compute stream waits for the transfer).

On the CPU with gloo's own transport (``posted``), where every message costs host time and no device is
involved, a transfer is **one packed message**: the header and every tensor, aligned, in one byte
buffer of the size the receiver expects (the previous payload's on that channel). When the description
changed, the sender first fills the expected size with the header alone, then sends the description
and the new packed payload; the receiver reads the header from what arrived and follows.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from merak.distributed.transports import HEADER_TAG, PAYLOAD_TAG, PostedTransport, Transport, make_transport

_DTYPES = {str(dtype): dtype for dtype in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
)}


def _signature(payload) -> tuple[tuple, list[torch.Tensor]]:
    """A cheap comparable description of ``payload`` (structure, tensor metadata, plain values) and its
    tensors. Plain values keep their type: ``1``, ``1.0`` and ``True`` describe differently."""
    leaves, spec = pytree.tree_flatten(payload)
    tensors, notes = [], []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if str(leaf.dtype) not in _DTYPES:
                raise TypeError(f"cannot send a tensor of dtype {leaf.dtype} between stages")
            tensors.append(leaf)
            notes.append((str(leaf.dtype), tuple(leaf.shape), leaf.requires_grad))
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            notes.append((type(leaf).__name__, leaf))
        else:
            raise TypeError(
                f"cannot send a {type(leaf).__name__} between pipeline stages; stage outputs may "
                "hold tensors, numbers, strings and None inside tuples, lists and dicts"
            )
    return (spec, tuple(notes)), tensors


def _description_text(signature: tuple) -> bytes:
    spec, notes = signature
    leaves = [{"tensor": [note[0], list(note[1]), note[2]]} if len(note) == 3 else {"value": note[1]}
              for note in notes]
    return json.dumps({"spec": pytree.treespec_dumps(spec), "leaves": leaves}).encode()


HEADER_BYTES = 16  # two int64: "a description follows", its length
_ALIGN = 16  # every packed tensor starts at a multiple of this many bytes


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


def _packed_size(tensor_notes: Sequence[tuple[str, Sequence[int]]]) -> int:
    """Bytes of a packed payload: the header, then each tensor ``(dtype name, shape)`` aligned."""
    size = HEADER_BYTES
    for dtype_name, shape in tensor_notes:
        numel = 1
        for dim in shape:
            numel *= dim
        size += _aligned(numel * _DTYPES[dtype_name].itemsize)
    return size


def _pack(tensors: Sequence[torch.Tensor], size: int) -> torch.Tensor:
    """One byte buffer: a zero header (no description follows), then each tensor's bytes, aligned."""
    packed = torch.empty(size, dtype=torch.uint8)
    packed[:HEADER_BYTES].view(torch.int64).zero_()
    offset = HEADER_BYTES
    for tensor in tensors:
        data = _wire_tensor(tensor).reshape(-1).view(torch.uint8)
        packed[offset:offset + data.numel()].copy_(data)
        offset += _aligned(data.numel())
    return packed


def _wire_tensor(tensor: torch.Tensor) -> torch.Tensor:
    # Not every backend moves bool tensors; their bytes travel as uint8.
    tensor = tensor.detach().contiguous()
    return tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor


@dataclass
class _SendChannel:
    last: tuple | None = None
    size: int = HEADER_BYTES  # packed messages: what the receiver expects next


@dataclass
class _RecvChannel:
    layout: dict | None = field(default=None, repr=False)
    size: int = HEADER_BYTES  # packed messages: what the sender sends next


class Transfer:
    """What one :meth:`PointToPoint.post` put on the wire.

    Attributes:
        received: the received payloads, in the order of the receives; their tensors are usable once
            :meth:`wait` returned.
        send_works: the works of the sends (payload tensors and headers); the sent payloads must stay
            unchanged until they complete.
    """

    def __init__(self, received: list, recv_works: list, send_works: list, grad_leaves: list[torch.Tensor],
                 buffers: Sequence[torch.Tensor] = ()) -> None:
        self.received = received
        self.send_works = send_works
        self._recv_works = recv_works
        self._grad_leaves = grad_leaves
        self._buffers = buffers  # packed messages in flight, alive as long as their works

    def wait(self) -> None:
        """Make the received tensors usable (on NCCL: the current stream waits, the host does not)."""
        for work in self._recv_works:
            work.wait()
        self._recv_works = []
        # A leaf that was part of the sender's autograd graph starts a graph here, so backward can
        # return its gradient (flagged only once the data is in: nothing in-place touches a leaf that
        # requires grad).
        for leaf in self._grad_leaves:
            leaf.requires_grad_(True)
        self._grad_leaves = []


class PointToPoint:
    """Sends and receives pytrees with other stages.

    Args:
        device: where received tensors are allocated.
        group: process group used for p2p (None: the default group); its CPU half carries descriptions.
        transport: how tensors travel (:func:`merak.distributed.transports.make_transport`): None picks
            ``rendezvous`` when ``MERAK_P2P_RENDEZVOUS=1``, else ``batched`` on CUDA (NCCL) and ``posted``
            on the CPU (gloo).
    """

    def __init__(self, device: torch.device, group=None, transport: str | Transport | None = None) -> None:
        self.device = torch.device(device)
        self.group = group
        self.transport = make_transport(self.device, group, transport) \
            if transport is None or isinstance(transport, str) else transport
        self._send_channels: dict[tuple[int, object], _SendChannel] = {}
        self._recv_channels: dict[tuple[int, object], _RecvChannel] = {}
        self.packed = isinstance(self.transport, PostedTransport) and self.device.type == "cpu"

    def post(self, sends: Sequence[tuple[object, int, object]], recvs: Sequence[tuple[int, object]]) -> Transfer:
        """Post sends and receives together, as one batched group.

        Args:
            sends: ``(payload, peer, channel)`` per payload to send to global rank ``peer``.
            recvs: ``(peer, channel)`` per payload to receive.

        ``channel`` is any label both sides give the same transfer (the executor's: its boundary and
        direction); it only keys the description cache. Matching is by posting order: the peer must post
        its receives (sends) from this rank in the order of these sends (receives).
        """
        if self.packed:
            return self._post_packed(sends, recvs)
        send_works, wire = [], []
        for payload, peer, channel in sends:
            signature, tensors = _signature(payload)
            state = self._send_channels.setdefault((peer, channel), _SendChannel())
            text = _description_text(signature) if signature != state.last else b""
            state.last = signature
            header = torch.tensor([int(bool(text)), len(text)], dtype=torch.int64)
            send_works.append(dist.isend(header, peer, group=self.group, tag=HEADER_TAG))
            if text:
                send_works.append(dist.isend(torch.frombuffer(bytearray(text), dtype=torch.uint8), peer,
                                             group=self.group, tag=HEADER_TAG))
            wire += [(_wire_tensor(t), peer) for t in tensors]
        layouts = [self._layout(peer, channel) for peer, channel in recvs]
        received, buffers, grad_leaves = [], [], []
        for layout, (peer, _) in zip(layouts, recvs):
            payload, tensors, needs_grad = self._buffers(layout)
            received.append(payload)
            buffers += [(t, peer) for t in tensors]
            grad_leaves += needs_grad
        sent, recv_works = self.transport.post(wire, buffers)
        return Transfer(received, recv_works, send_works + sent, grad_leaves, [t for t, _ in wire])

    def _post_packed(self, sends, recvs) -> Transfer:
        """:meth:`post` as one packed message per transfer (gloo on the CPU: see the module docstring)."""
        works, buffers = [], []
        for payload, peer, channel in sends:
            signature, tensors = _signature(payload)
            state = self._send_channels.setdefault((peer, channel), _SendChannel())
            if signature != state.last:
                text = _description_text(signature)
                notice = torch.zeros(state.size, dtype=torch.uint8)
                notice[:HEADER_BYTES].view(torch.int64).copy_(torch.tensor([1, len(text)]))
                description = torch.frombuffer(bytearray(text), dtype=torch.uint8)
                works += [dist.isend(notice, peer, group=self.group, tag=PAYLOAD_TAG),
                          dist.isend(description, peer, group=self.group, tag=PAYLOAD_TAG)]
                buffers += [notice, description]
                state.last = signature
                state.size = _packed_size([note[:2] for note in signature[1] if len(note) == 3])
            packed = _pack(tensors, state.size)
            works.append(dist.isend(packed, peer, group=self.group, tag=PAYLOAD_TAG))
            buffers.append(packed)
        received, grad_leaves = [], []
        for peer, channel in recvs:
            state = self._recv_channels.setdefault((peer, channel), _RecvChannel())
            packed = torch.empty(state.size, dtype=torch.uint8)
            dist.recv(packed, peer, group=self.group, tag=PAYLOAD_TAG)
            changed, length = packed[:HEADER_BYTES].view(torch.int64).tolist()
            if changed:
                text = torch.empty(length, dtype=torch.uint8)
                dist.recv(text, peer, group=self.group, tag=PAYLOAD_TAG)
                state.layout = self._parse(text)
                state.size = _packed_size([note["tensor"][:2] for note in state.layout["leaves"] if "tensor" in note])
                packed = torch.empty(state.size, dtype=torch.uint8)
                dist.recv(packed, peer, group=self.group, tag=PAYLOAD_TAG)
            elif state.layout is None:
                raise RuntimeError(f"received a payload from rank {peer} before its description")
            payload, needs_grad = self._unpack(packed, state.layout)
            received.append(payload)
            grad_leaves += needs_grad
        transfer = Transfer(received, [], works, grad_leaves, buffers)
        transfer.wait()  # nothing in flight: flags the leaves that require grad
        return transfer

    @staticmethod
    def _unpack(packed: torch.Tensor, layout: dict) -> tuple[object, list[torch.Tensor]]:
        """The payload of a packed message (its tensors copied out of ``packed``)."""
        leaves, needs_grad, offset = [], [], HEADER_BYTES
        for note in layout["leaves"]:
            if "tensor" not in note:
                leaves.append(note["value"])
                continue
            dtype_name, shape, requires_grad = note["tensor"]
            dtype = _DTYPES[dtype_name]
            wire = torch.uint8 if dtype == torch.bool else dtype
            size = _packed_size([(dtype_name, shape)]) - HEADER_BYTES
            count = 1
            for dim in shape:
                count *= dim
            # A copy of its own: views of one byte buffer as several dtypes could not be saved, and a
            # small tensor a stage keeps would hold the whole buffer.
            leaf = packed[offset:offset + count * wire.itemsize].view(wire).view(shape).clone()
            leaf = leaf.view(torch.bool) if dtype == torch.bool else leaf
            offset += size
            leaves.append(leaf)
            if requires_grad:
                needs_grad.append(leaf)
        return pytree.tree_unflatten(leaves, layout["spec"]), needs_grad

    @staticmethod
    def _parse(text: torch.Tensor) -> dict:
        description = json.loads(text.numpy().tobytes().decode())
        return {"spec": pytree.treespec_loads(description["spec"]), "leaves": description["leaves"]}

    def _layout(self, peer: int, channel) -> dict:
        """The next payload's layout from ``peer``: the header says whether a new description follows."""
        header = torch.empty(2, dtype=torch.int64)
        dist.recv(header, peer, group=self.group, tag=HEADER_TAG)
        changed, length = (int(v) for v in header)
        state = self._recv_channels.setdefault((peer, channel), _RecvChannel())
        if changed:
            text = torch.empty(length, dtype=torch.uint8)
            dist.recv(text, peer, group=self.group, tag=HEADER_TAG)
            state.layout = self._parse(text)
        elif state.layout is None:
            raise RuntimeError(f"received a payload from rank {peer} before its description")
        return state.layout

    def _buffers(self, layout: dict) -> tuple[object, list[torch.Tensor], list[torch.Tensor]]:
        """The payload (empty tensors to receive into, plain values as described), the wire buffers the
        tensors arrive in, and the tensors that require grad once arrived."""
        leaves, wire, needs_grad = [], [], []
        for note in layout["leaves"]:
            if "tensor" not in note:
                leaves.append(note["value"])
                continue
            dtype_name, shape, requires_grad = note["tensor"]
            dtype = _DTYPES[dtype_name]
            buffer = torch.empty(shape, dtype=torch.uint8 if dtype == torch.bool else dtype, device=self.device)
            wire.append(buffer)
            leaf = buffer.view(torch.bool) if dtype == torch.bool else buffer
            leaves.append(leaf)
            if requires_grad:
                needs_grad.append(leaf)
        return pytree.tree_unflatten(leaves, layout["spec"]), wire, needs_grad

    def post_send(self, payload, peer: int, channel: object = 0) -> list:
        """Send ``payload`` to global rank ``peer`` alone; return the works to wait on before it changes."""
        return self.post([(payload, peer, channel)], []).send_works

    def recv(self, peer: int, channel: object = 0):
        """Receive the next pytree from global rank ``peer`` alone, ready to use."""
        transfer = self.post([], [(peer, channel)])
        transfer.wait()
        return transfer.received[0]
