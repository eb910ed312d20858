"""Cross-entropy of half-precision logits in float32 chunks: the numbers of a float32 copy, without the copy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from merak.tensor_parallel import cross_entropy as ce


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunked_loss_and_gradient_equal_a_float32_copy(monkeypatch, dtype):
    monkeypatch.setattr(ce, "CHUNK_BYTES", 4 * 97 * 7)  # 7 rows a chunk: 37 rows make 6 chunks, the last short
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(37, 97, generator=generator)).to(dtype).requires_grad_(True)
    labels = torch.randint(0, 97, (37,), generator=generator)
    labels[[3, 10, 36]] = -100
    reference_logits = logits.detach().clone().requires_grad_(True)

    loss = ce.cross_entropy(logits, labels)
    expected = F.cross_entropy(reference_logits.float(), labels, ignore_index=-100)
    (2.5 * loss).backward()
    (2.5 * expected).backward()

    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    assert logits.grad.dtype == dtype
    torch.testing.assert_close(logits.grad.float(), reference_logits.grad.float(), rtol=1e-2, atol=1e-4)
    assert logits.grad[[3, 10, 36]].abs().sum() == 0  # ignored rows get no gradient


def test_float32_logits_keep_the_plain_loss():
    logits = torch.randn(5, 11, requires_grad=True)
    labels = torch.tensor([1, 2, -100, 4, 5])
    assert torch.equal(ce.cross_entropy(logits, labels), F.cross_entropy(logits, labels, ignore_index=-100))


def test_the_recipes_losses_take_half_precision_outputs_as_they_are():
    from recipes.bert.model import masked_lm_loss
    from recipes.gpt.model import causal_lm_loss
    from recipes.t5.model import seq2seq_loss
    from recipes.vision.loss import cross_entropy_loss

    for loss_fn in (causal_lm_loss, masked_lm_loss, seq2seq_loss, cross_entropy_loss):
        assert getattr(loss_fn, "accepts_half_precision", False), loss_fn.__qualname__
