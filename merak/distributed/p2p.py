"""Point-to-point transfer of pytrees between pipeline stages.

Any pytree (tensors, tuples, lists, dicts, ints, floats, strings, None) can
cross a stage boundary. Each transfer starts with a two-integer header; when
the structure, a dtype, a shape or a non-tensor value differs from the
previous transfer on the same channel, the header announces a new description
(JSON, never pickle) that follows it. So shapes may change from one
microbatch to the next and are renegotiated, never silently reused, while the
steady state costs one 16-byte message per transfer.

Sends are posted asynchronously and return their pending works; receives
block until the payload is complete.
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
    """

    def __init__(self, device: torch.device, group=None) -> None:
        self.device = device
        self.group = group
        self._send_channels: dict[tuple[int, int], Channel] = {}
        self._recv_channels: dict[tuple[int, int], Channel] = {}

    def _channel(self, table: dict[tuple[int, int], Channel], peer: int, tag: int) -> Channel:
        return table.setdefault((peer, tag), Channel())

    def post_send(self, payload, peer: int, tag: int = 0) -> list:
        """Start sending ``payload`` to global rank ``peer``; return the works to wait on.

        Transfers with different tags are separate channels (gloo matches by tag;
        NCCL ignores tags, so there the order of posts must agree on both sides).
        The caller must keep ``payload`` unchanged until the works complete.
        """
        channel = self._channel(self._send_channels, peer, tag)
        description, tensors = _describe(payload)
        changed = description != channel.last_description
        encoded = description.encode() if changed else b""
        header = torch.tensor([int(changed), len(encoded)], dtype=torch.int64)
        messages = [header]
        if changed:
            messages.append(torch.frombuffer(bytearray(encoded), dtype=torch.uint8))
            channel.last_description = description
        messages.extend(_wire_tensor(t) for t in tensors)
        # Header and description travel on the CPU for gloo; NCCL needs device tensors.
        return [dist.isend(m.to(self.device) if m.device != self.device else m, peer, group=self.group, tag=tag)
                for m in messages]

    def recv(self, peer: int, tag: int = 0):
        """Receive the next pytree with ``tag`` from global rank ``peer`` (blocking)."""
        channel = self._channel(self._recv_channels, peer, tag)
        header = torch.empty(2, dtype=torch.int64, device=self.device)
        dist.recv(header, peer, group=self.group, tag=tag)
        changed, length = (int(v) for v in header.tolist())
        if changed:
            encoded = torch.empty(length, dtype=torch.uint8, device=self.device)
            dist.recv(encoded, peer, group=self.group, tag=tag)
            description = json.loads(bytes(encoded.cpu().tolist()).decode())
            channel.layout = {
                "spec": pytree.treespec_loads(description["spec"]),
                "leaves": description["leaves"],
            }
        elif channel.layout is None:
            raise RuntimeError(f"received a payload from rank {peer} before its description")
        layout = channel.layout
        leaves, pending = [], []
        for note in layout["leaves"]:
            if "tensor" not in note:
                leaves.append(note["value"])
                continue
            dtype_name, shape, requires_grad = note["tensor"]
            dtype = _DTYPES[dtype_name]
            wire_dtype = torch.uint8 if dtype == torch.bool else dtype
            buffer = torch.empty(shape, dtype=wire_dtype, device=self.device)
            pending.append(dist.irecv(buffer, peer, group=self.group, tag=tag))
            leaves.append(buffer.view(torch.bool) if dtype == torch.bool else buffer)
        for work in pending:
            work.wait()
        # A leaf that was part of the sender's autograd graph starts a graph here,
        # so backward can return its gradient.
        for note, leaf in zip(layout["leaves"], leaves):
            if "tensor" in note and note["tensor"][2]:
                leaf.requires_grad_(True)
        return pytree.tree_unflatten(leaves, layout["spec"])
