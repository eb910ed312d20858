"""The vocabulary-parallel loss on half-precision logits: the float32 numbers, without a float32 copy.

Two gloo ranks each hold half of the vocabulary of bf16 logits; their loss and logit gradients equal
those of ``F.cross_entropy`` over the whole float32 logits, and nothing the loss keeps for backward is
a float32 tensor of the logits' size.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from merak.distributed import groups
from merak.distributed.launch import spawn_workers
from merak.tensor_parallel import cross_entropy as ce

pytestmark = pytest.mark.dist

ROWS, VOCAB = 37, 98


def _logits_and_labels():
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(ROWS, VOCAB, generator=generator)).to(torch.bfloat16)
    labels = torch.randint(0, VOCAB, (ROWS,), generator=generator)
    labels[[3, 10, 36]] = -100
    return logits, labels


def _rank_loss(out_dir: str) -> None:
    state = groups.init(tp=2, timeout_s=60)
    try:
        ce.CHUNK_BYTES = 4 * (VOCAB // 2) * 7  # 7 rows a chunk: 6 chunks, the last short
        logits, labels = _logits_and_labels()
        local = logits.chunk(2, dim=-1)[state.coordinates.tp].clone().requires_grad_(True)
        saved = []

        def keep(tensor):
            saved.append((tensor.dtype, tensor.numel()))
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            loss = ce.vocab_parallel_cross_entropy(local, labels, group="tp")
        (2.5 * loss).backward()
        torch.save({"loss": loss.detach(), "grad": local.grad, "saved": saved},
                   Path(out_dir) / f"rank{state.rank}.pt")
    finally:
        groups.shutdown()


@pytest.mark.timeout(120)
def test_vocab_parallel_half_precision_loss_equals_float32(tmp_path):
    spawn_workers(_rank_loss, world_size=2, args=(str(tmp_path),))
    logits, labels = _logits_and_labels()
    reference = logits.float().requires_grad_(True)
    expected = F.cross_entropy(reference, labels, ignore_index=-100)
    (2.5 * expected).backward()
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(got["loss"], expected.detach(), rtol=1e-6, atol=1e-6)
        assert got["grad"].dtype == torch.bfloat16
        torch.testing.assert_close(got["grad"].float(), reference.grad.chunk(2, dim=-1)[rank], rtol=1e-2, atol=1e-4)
        assert got["grad"][[3, 10, 36]].abs().sum() == 0
        # What the loss keeps: the bf16 logits and per-row numbers, never float32 logits.
        assert (torch.bfloat16, ROWS * VOCAB // 2) in got["saved"]
        assert all(not (dtype == torch.float32 and numel >= ROWS * VOCAB // 2) for dtype, numel in got["saved"])
