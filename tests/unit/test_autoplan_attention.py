"""merak.autoplan.attention: attention on meta saves for backward what the run's device saves."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from merak.autoplan.attention import KERNELS, attention_on, takes_fused_kernel

BATCH, HEADS, SEQ, HEAD_DIM = 2, 4, 8, 16


def _inputs(device: str, *, kv_heads: int = HEADS, dims: int = 4, dtype=torch.float32):
    shape = (BATCH, HEADS, SEQ, HEAD_DIM)[4 - dims:]
    kv_shape = (BATCH, kv_heads, SEQ, HEAD_DIM)[4 - dims:]
    return [torch.randn(s, device=device, dtype=dtype, requires_grad=True) for s in (shape, kv_shape, kv_shape)]


CASES = {  # name: (input options, call options with "mask": its shape and whether it requires grad)
    "plain": ({}, {}),
    "causal": ({}, {"is_causal": True}),
    "additive mask": ({}, {"mask": ((BATCH, 1, SEQ, SEQ), False)}),
    "learned bias": ({}, {"mask": ((BATCH, HEADS, SEQ, SEQ), True)}),
    "dropout": ({}, {"dropout_p": 0.1}),
    "grouped query": ({"kv_heads": 2}, {"enable_gqa": True}),
    "three dimensions": ({"dims": 3}, {}),
    "bfloat16": ({"dtype": torch.bfloat16}, {}),
}


def _call(device: str, case: str):
    input_options, call_options = CASES[case]
    query, key, value = _inputs(device, **input_options)
    options = dict(call_options)
    mask = options.pop("mask", None)
    if mask is not None:
        shape, learned = mask
        mask = torch.zeros(shape, device=device, dtype=query.dtype, requires_grad=learned)
    return (query, key, value), {"attn_mask": mask, **options}


def _saved_shapes(run) -> list[tuple[int, ...]]:
    """Shapes of the storages autograd saves while ``run`` runs (each once)."""
    seen: dict[int, tuple[int, ...]] = {}

    def pack(tensor):
        base = tensor if tensor._base is None else tensor._base
        seen[id(base)] = tuple(base.shape)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sorted(seen.values())


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_kernel_chosen_is_the_cpu_dispatchers(case):
    args, kwargs = _call("cpu", case)
    chosen = torch._fused_sdp_choice(*args, kwargs["attn_mask"], kwargs.get("dropout_p", 0.0),
                                     kwargs.get("is_causal", False), enable_gqa=kwargs.get("enable_gqa", False))
    assert takes_fused_kernel("cpu", *args, **kwargs) == (chosen != torch.nn.attention.SDPBackend.MATH.value)


@pytest.mark.parametrize("case", sorted(CASES))
def test_meta_attention_saves_what_cpu_attention_saves(case):
    torch.manual_seed(0)
    args, kwargs = _call("cpu", case)
    on_cpu = _saved_shapes(lambda: F.scaled_dot_product_attention(*args, **kwargs))
    meta_args, meta_kwargs = _call("meta", case)
    on_meta = _saved_shapes(lambda: attention_on("cpu", *meta_args, **meta_kwargs))
    assert on_meta == on_cpu
    # Meta itself would have saved the probabilities of the math path wherever the CPU fuses.
    if takes_fused_kernel("cpu", *args, **kwargs):
        assert (BATCH, HEADS, SEQ, SEQ) in _saved_shapes(lambda: F.scaled_dot_product_attention(*meta_args,
                                                                                                   **meta_kwargs))
        assert (BATCH, HEADS, SEQ, SEQ) not in on_meta


@pytest.mark.parametrize("case", ["dropout", "learned bias"])
def test_cuda_kernels_fuse_with_dropout_and_a_learned_bias(case):
    args, kwargs = _call("meta", case)
    assert takes_fused_kernel("cuda", *args, **kwargs)
    shapes = _saved_shapes(lambda: attention_on("cuda", *args, **kwargs))
    assert (BATCH, HEADS, SEQ) in shapes  # the log-sum-exp per query row, not the probabilities ...
    assert shapes.count((BATCH, HEADS, SEQ, SEQ)) == (1 if case == "learned bias" else 0)  # ... but the bias


def test_three_dimensional_inputs_take_the_math_path_on_cuda():
    args, kwargs = _call("meta", "three dimensions")
    assert not takes_fused_kernel("cuda", *args, **kwargs)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("case", ["plain", "learned bias", "three dimensions"])
def test_a_named_kernel_overrides_the_devices_choice(device, case):
    args, kwargs = _call("meta", case)
    probabilities = (*args[0].shape[:-1], SEQ)
    math = _saved_shapes(lambda: attention_on(device, *args, **kwargs, kernel="math"))
    fused = _saved_shapes(lambda: attention_on(device, *args, **kwargs, kernel="fused"))
    assert probabilities in math
    if case == "three dimensions":  # no fused kernel takes them: the math path whatever is asked
        assert fused == math
    else:
        assert fused.count(probabilities) == (1 if case == "learned bias" else 0)  # a learned bias is kept
        assert (BATCH, HEADS, SEQ) in fused  # the log-sum-exp per query row


def test_an_unknown_kernel_is_refused():
    args, kwargs = _call("meta", "plain")
    assert KERNELS == ("auto", "fused", "math")
    with pytest.raises(ValueError, match="choose one of auto, fused, math"):
        attention_on("cpu", *args, **kwargs, kernel="flash")
