"""Keep glibc from returning large tensor buffers to the kernel after every free.

On CPU, activations such as GPT-2's logits (4 x 128 x 50257 floats = 100 MB
per microbatch) exceed glibc's mmap threshold, so every allocation is a fresh
mmap whose pages the kernel must fault in and zero, and every free unmaps
them again. Training then spends a large share of its time in the kernel.
Raising the mmap and trim thresholds keeps freed buffers in the heap for the
next microbatch; the price is that the process keeps its peak memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_SETTINGS = ((_M_MMAP_THRESHOLD, 1 << 30), (_M_TRIM_THRESHOLD, (1 << 31) - 1), (_M_TOP_PAD, 64 << 20))


def keep_freed_memory() -> bool:
    """Raise glibc's mmap/trim thresholds in this process; False where glibc is not the allocator."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    applied = all(mallopt(option, value) == 1 for option, value in _SETTINGS)
    logger.debug("glibc malloc thresholds raised: %s", applied)
    return applied
