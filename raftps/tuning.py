"""Process-level tuning for a node.

A node allocates and frees multi-MB buffers for every push (receive buffers, optimizer
temporaries). glibc serves each one with a fresh mmap, so every push pays a page fault on each
of its pages. Raising the mmap threshold makes glibc reuse freed heap memory instead.
"""
from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def keep_large_buffers_on_the_heap(max_buffer: int = 1 << 30) -> bool:
    """Returns False where there is no glibc mallopt (musl, macOS): nothing changes there."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    # glibc caps M_MMAP_THRESHOLD at 32 MiB on 64-bit (HEAP_MAX); larger buffers still use mmap.
    ok = mallopt(M_MMAP_THRESHOLD, min(max_buffer, 32 << 20)) == 1
    return ok and mallopt(M_TRIM_THRESHOLD, 2 * min(max_buffer, 32 << 20) + (256 << 20)) == 1
