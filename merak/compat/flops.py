"""FLOP counting that also sees attention on the CPU.

``torch.utils.flop_counter`` prices the fused attention kernels of CUDA (flash, memory-efficient,
cuDNN) but not the CPU's flash kernel, so a model counted on real CPU tensors lost its attention
FLOPs while the same model counted on meta tensors (where attention decomposes into matrix products)
kept them: the two disagreed on where a pipeline should be cut. :func:`flop_counter` prices the CPU
kernel, forward and backward, with torch's own formulas for the CUDA ones.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

_aten = torch.ops.aten


def _attention(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _attention_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                        **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# Given the operands' shapes (FlopCounterMode passes shapes to formulas it did not register itself).
CPU_ATTENTION_FORMULAS = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _attention,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward,
}


def flop_counter() -> FlopCounterMode:
    """A silent ``FlopCounterMode`` that also counts the CPU's fused attention."""
    return FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FORMULAS)
