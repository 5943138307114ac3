"""Allocation of large CPU outputs backed by transparent huge pages.

A fresh ``(n, d)`` result is mapped by the kernel page by page on first write: with 4 KiB pages
that costs more than computing it (about 20,000 page faults per 80 MB). :func:`empty_rows` asks
Linux to back such a buffer with 2 MiB pages (``madvise(MADV_HUGEPAGE)``, what PyTorch's
``THP_MEM_ALLOC_ENABLE=1`` does for every allocation). It is a hint: where it is not available the
buffer is an ordinary ``torch.empty``.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

import torch

__all__ = ["empty_rows"]

_MADV_HUGEPAGE = 14
_HUGE = 1 << 21
_MIN_BYTES = 1 << 23
_libc: Any = None


def _madvise_huge(ptr: int, nbytes: int) -> None:
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            _libc = False
    if not _libc:
        return
    start = (ptr + _HUGE - 1) & ~(_HUGE - 1)
    stop = (ptr + nbytes) & ~(_HUGE - 1)
    if stop > start:
        _libc.madvise(start, stop - start, _MADV_HUGEPAGE)  # a hint; failure leaves 4 KiB pages


def empty_rows(shape: tuple[int, ...] | torch.Size, like: torch.Tensor) -> torch.Tensor:
    """``torch.empty(shape)`` with ``like``'s dtype and device; huge pages for large CPU buffers on Linux."""
    out = torch.empty(tuple(shape), dtype=like.dtype, device=like.device)
    nbytes = out.numel() * out.element_size()
    if out.device.type == "cpu" and nbytes >= _MIN_BYTES and sys.platform.startswith("linux"):
        _madvise_huge(out.data_ptr(), nbytes)
    return out
