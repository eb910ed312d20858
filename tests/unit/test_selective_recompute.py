"""Selective recomputation (merak.pipeline.selective) in one process: a stage of GPT-2 blocks with
dropout on computes exactly what it computes without checkpointing, and keeps fewer activation bytes
than no recomputation but more than full recomputation, as merak's own activation meter counts them."""

from __future__ import annotations

import pytest
import torch
from tiny_models import GPT2BlockPart
from torch import nn
from transformers import GPT2Config

from merak.pipeline import memory, recompute
from merak.pipeline.recompute import StageRecomputation
from merak.pipeline.stage import StageModule

SEQ = 64
WIDTH = 32
NONE = StageRecomputation()
FULL = StageRecomputation(parts=2)
MATMULS = StageRecomputation(parts=2, saves="matmuls")
ATTENTION = StageRecomputation(parts=2, saves="attention")


def _stage(attention: str) -> StageModule:
    torch.manual_seed(0)
    config = GPT2Config(n_embd=WIDTH, n_head=4, n_positions=SEQ, resid_pdrop=0.1, attn_pdrop=0.1)
    config._attn_implementation = attention
    return StageModule([GPT2BlockPart(config), GPT2BlockPart(config)]).train()


def _run(options: StageRecomputation, attention: str = "eager"):
    """Forward and backward of one microbatch with dropout reseeded per part, as the executor runs it:
    the bytes kept after the forward, the FLOPs the backward recomputes, the output and the gradients."""
    stage = _stage(attention)
    stage.configure_checkpointing(options)
    hidden = torch.randn(4, SEQ, WIDTH, generator=torch.Generator().manual_seed(1), requires_grad=True)
    meter = memory.ActivationMeter(stage.parameters())
    with recompute.counting_recomputation() as work, memory.active_meter(meter), recompute.microbatch_seed(123), \
            meter.saving("microbatch"):
        out = stage(hidden)
    kept = meter.live_bytes()
    out.pow(2).sum().backward()
    return kept, work.flops, out.detach(), [p.grad for p in stage.parameters()] + [hidden.grad]


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("options", [MATMULS, ATTENTION], ids=["matmuls", "attention"])
def test_selective_recomputation_reproduces_dropout_and_gradients(options, attention):
    _, _, out, grads = _run(options, attention)
    _, _, expected_out, expected_grads = _run(NONE, attention)
    assert torch.equal(out, expected_out)
    for grad, expected in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("options", [MATMULS, ATTENTION], ids=["matmuls", "attention"])
def test_selective_keeps_less_than_none_and_more_than_full(options):
    kept, _, _, _ = _run(options)
    assert _run(FULL)[0] < kept < _run(NONE)[0]


def test_an_output_nothing_reads_is_not_kept():
    # A language model head: its logits leave the checkpointed part, and neither the recomputation nor
    # the matrix product's backward needs them, so only the part's input is kept, as with full recomputation.
    def run(options):
        torch.manual_seed(0)
        stage = StageModule([nn.Linear(8, 1000, bias=False)])  # matmul: mm, then _unsafe_view
        stage.configure_checkpointing(options)
        meter = memory.ActivationMeter(stage.parameters())
        with memory.active_meter(meter), meter.saving("microbatch"):
            logits = stage(torch.ones(2, 3, 8, requires_grad=True))
        logits.square().sum().backward()
        return meter.live_bytes(), stage.parts[0].weight.grad

    kept, grad = run(StageRecomputation(parts=1, saves="matmuls"))
    assert kept == run(StageRecomputation(parts=1))[0]
    torch.testing.assert_close(grad, run(NONE)[1])


def test_the_backward_recomputes_fewer_flops():
    recomputed = {name: _run(options)[1] for name, options in
                  [("none", NONE), ("full", FULL), ("matmuls", MATMULS), ("attention", ATTENTION)]}
    # Matrix products are what the FLOP counter counts: saving them all leaves nothing to recompute,
    # and the attention core holds only q @ k^T and p @ v.
    assert recomputed["none"] == recomputed["matmuls"] == 0
    assert 0 < recomputed["attention"] < recomputed["full"]


def test_a_saved_output_modified_in_place_is_recomputed():
    # The linear layer's output is saved, then overwritten by the in-place ReLU: the backward must not
    # read the overwritten copy (torch would refuse it); the policy recomputes it instead.
    def build():
        torch.manual_seed(0)
        return StageModule([nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8))])

    def grads(options):
        stage = build()
        stage.configure_checkpointing(options)
        stage(torch.ones(2, 8)).sum().backward()
        return [p.grad for p in stage.parameters()]

    for grad, expected in zip(grads(StageRecomputation(parts=1, saves="matmuls")), grads(NONE), strict=True):
        torch.testing.assert_close(grad, expected)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="selective_recompute='everything' is not one of matmuls, attention"):
        _stage("eager").configure_checkpointing(StageRecomputation(parts=1, saves="everything"))


class _TensorParallelMLP(nn.Module):
    """An MLP of merak's tensor-parallel linear operators (column then row parallel) on a group of one."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, hidden):
        ops = torch.ops.merak
        inner = ops.column_linear(hidden, self.up.weight, self.up.bias, "tp-test", False, "none", -1, False)
        return hidden + ops.row_linear(torch.nn.functional.gelu(inner), self.down.weight, self.down.bias, "tp-test",
                                       False, -1, False)


def test_tensor_parallel_linears_count_as_matrix_products():
    # With tp > 1 every linear layer is one of merak's operators, its collective inside: matmuls keeps their
    # outputs (the backward runs neither the product nor the collective again), as it keeps aten's.
    import merak.tensor_parallel.linear_ops  # noqa: F401  (registers the operators)
    from merak.core import group_registry

    group_registry.register_group("tp-test", None, rank=0, size=1)

    def run(options):
        torch.manual_seed(0)
        stage = StageModule([_TensorParallelMLP(), _TensorParallelMLP()])
        stage.configure_checkpointing(options)
        hidden = torch.randn(2, SEQ, WIDTH, generator=torch.Generator().manual_seed(1), requires_grad=True)
        meter = memory.ActivationMeter(stage.parameters())
        with recompute.counting_recomputation() as work, memory.active_meter(meter), meter.saving("microbatch"):
            out = stage(hidden)
        kept = meter.live_bytes()
        out.square().sum().backward()
        return kept, work.flops, [p.grad for p in stage.parameters()] + [hidden.grad]

    try:
        none, full, matmuls = run(NONE), run(FULL), run(MATMULS)
    finally:
        group_registry.unregister_groups()
    assert full[0] < matmuls[0] < none[0]
    assert matmuls[1] == 0 < full[1]  # nothing counted is recomputed
    for grad, expected in zip(matmuls[2], none[2], strict=True):
        torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-7)
