"""Scaled-dot-product attention as the run's device computes it, on meta: what it saves for backward.

The planner profiles a model on meta, where ``scaled_dot_product_attention`` always takes the math path:
it saves the ``[batch, heads, S, S]`` attention probabilities. The devices merak trains on take a fused
kernel where they can (flash attention on CPU unless dropout is on; flash, memory-efficient or cuDNN
attention on CUDA), which saves only the inputs, the output and one log-sum-exp per query row: the
probabilities would be counted as activations the runs never hold.

The kernel may also be named (``merak-plan --attention``): ``fused`` prices a fused kernel wherever one takes
the inputs (four-dimensional ones, as on CUDA), ``math`` the math path everywhere (a run that disables the
fused kernels, or a device without them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# How a captured graph calls attention: torch.export keeps the aten op, torch.fx the functional.
ATTENTION_TARGETS = frozenset({torch.ops.aten.scaled_dot_product_attention.default,
                               F.scaled_dot_product_attention})

# How the planner chooses the kernel: as the target device would (auto), or named.
KERNELS = ("auto", "fused", "math")

_FUSED_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_MATH = torch.nn.attention.SDPBackend.MATH


def _stand_in(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A CPU tensor of ``tensor``'s shape, dtype and ``requires_grad`` that holds one row (every dimension but
    the last has stride 0): enough for the CPU dispatcher to choose a kernel, whatever the real size."""
    if tensor is None:
        return None
    strides = (0,) * (tensor.dim() - 1) + (1,) if tensor.dim() else ()
    stand_in = torch.empty_strided(tuple(tensor.shape), strides, dtype=tensor.dtype)
    return stand_in.requires_grad_() if tensor.requires_grad and tensor.is_floating_point() else stand_in


def takes_fused_kernel(device_type: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                       scale: float | None = None, enable_gqa: bool = False) -> bool:
    """Whether attention with these arguments runs a fused kernel on ``device_type`` ("cpu": as the CPU
    dispatcher chooses; "cuda": four-dimensional inputs, which flash, memory-efficient or cuDNN attention
    take whatever the dtype, mask or dropout)."""
    if device_type == "cuda":
        return query.dim() == 4
    choice = torch._fused_sdp_choice(_stand_in(query), _stand_in(key), _stand_in(value), _stand_in(attn_mask),
                                     dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    return choice != _MATH.value


def _fused(kernel: str, device_type: str, query, key, value, attn_mask, dropout_p, is_causal, scale,
           enable_gqa) -> bool:
    if kernel not in KERNELS:
        raise ValueError(f"attention kernel {kernel!r}: choose one of {', '.join(KERNELS)}")
    if kernel == "math":
        return False
    if kernel == "fused":
        return query.dim() == 4  # what every fused kernel takes (as on CUDA)
    return takes_fused_kernel(device_type, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def attention_on(device_type: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                 scale: float | None = None, enable_gqa: bool = False, *, kernel: str = "auto") -> torch.Tensor:
    """``scaled_dot_product_attention`` (on any device, meta included) saving for backward what it saves on
    ``device_type``: through the CPU's fused kernel where that device takes a fused one (a CUDA kernel saves
    the same inputs, output and log-sum-exp), else through the math path. ``kernel`` (:data:`KERNELS`):
    ``auto`` as ``device_type`` chooses, ``fused`` or ``math`` as named."""
    if _fused(kernel, device_type, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        # The CPU kernel takes no gradient for the mask (CUDA's memory-efficient one does): a learned bias is
        # fed detached, which saves the same bytes; the profile never runs backward.
        mask = attn_mask.detach() if attn_mask is not None and attn_mask.requires_grad else attn_mask
        output, _ = _FUSED_CPU(query, key, value, dropout_p, is_causal, attn_mask=mask, scale=scale)
        return output
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
