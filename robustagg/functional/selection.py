"""Column-chunked order statistics shared by the coordinate-wise kernels."""

from __future__ import annotations

from typing import Iterator

import torch

__all__ = ["sorted_columns_chunks", "CHUNK_ELEMENTS"]

#: Elements per chunk (n * columns); ~4 MiB of float32, small enough for the cache hierarchy.
CHUNK_ELEMENTS = 1 << 20


def sorted_columns_chunks(x: torch.Tensor, lo: int, hi: int) -> Iterator[tuple[slice, torch.Tensor]]:
    """Yield ``(cols, s)`` where ``s`` holds rows ``lo..hi`` (inclusive) of ``x[:, cols]`` sorted per column.

    Rows outside ``lo..hi`` of ``s`` are unspecified when a faster partial method is used; rows
    ``lo..hi`` are exactly the ``lo``-th..``hi``-th order statistics (0-based) of each column.

    Args:
        x: ``(n, d)`` floating tensor, finite.
        lo, hi: 0-based order statistics needed, ``0 <= lo <= hi < n``.
    """
    n, d = x.shape
    chunk = max(1, CHUNK_ELEMENTS // max(n, 1))
    for start in range(0, d, chunk):
        cols = slice(start, min(start + chunk, d))
        yield cols, torch.sort(x[:, cols], dim=0).values
