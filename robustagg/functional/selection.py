"""Column-chunked order statistics shared by the coordinate-wise kernels.

Fast path (:func:`order_statistics`): the columns of ``x`` are cut into chunks of ``k`` columns
whose scratch copies stay in the CPU cache; each chunk goes through a comparator network
(:mod:`robustagg.functional.network`) as ``2 * len(network)`` elementwise ``minimum``/``maximum``
calls on whole rows of the chunk. Values are only moved, never rounded, so the order statistics
are bitwise those of a full sort. On CPU float32/float64 the calls are NumPy ufuncs on zero-copy
views (``Tensor.numpy()``), which cost less per call than torch's; other dtypes and CUDA tensors
use the same torch calls (``torch.minimum(a, b, out=...)``), with larger chunks on CUDA.

Reference (:func:`sorted_columns_chunks`): ``torch.sort`` of each column chunk; kept for the
readable reference kernels and for tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from .network import selection_network

__all__ = ["sorted_columns_chunks", "CHUNK_ELEMENTS", "Backend", "Chunk", "order_statistics", "chunk_columns"]

#: Elements per chunk (n * columns) of the reference sort; ~4 MiB of float32.
CHUNK_ELEMENTS = 1 << 20

#: Bytes of scratch rows per chunk on CPU (tuned on a 512 KiB-L2 / 32 MiB-L3 core: smaller chunks
#: pay more per-call overhead, larger ones fall out of cache; 1-3 MiB measured within 5 %).
CPU_CHUNK_BYTES = 1 << 21
#: Elements of scratch per chunk on CUDA (kernel-launch overhead dominates small chunks).
CUDA_CHUNK_ELEMENTS = 1 << 24

#: Use the torch backend everywhere (tests run the CUDA code path on CPU with it).
FORCE_TORCH = False

Array = Any  # numpy.ndarray on the NumPy backend, torch.Tensor otherwise


class Backend:
    """Elementwise ``out=`` operations on 1-D rows: NumPy ufuncs on CPU float32/64, torch otherwise.

    Args:
        x: the tensor whose dtype and device pick the backend.
    """

    def __init__(self, x: torch.Tensor) -> None:
        self.numpy = x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and not FORCE_TORCH
        xp: Any = np if self.numpy else torch
        self.minimum, self.maximum = xp.minimum, xp.maximum
        self.add, self.subtract, self.multiply, self.divide = xp.add, xp.subtract, xp.multiply, xp.divide
        self.abs = xp.abs
        self.less_equal = xp.less_equal  # with a floating ``out``: 1.0 where true, 0.0 elsewhere

    def view(self, t: torch.Tensor) -> Array:
        """``t`` as this backend's array, sharing memory (no copy)."""
        return t.detach().numpy() if self.numpy else t

    def copy(self, dst: Array, src: Array) -> None:
        """``dst[...] = src``."""
        if self.numpy:
            np.copyto(dst, src)
        else:
            dst.copy_(src)

    def empty(self, rows: int, cols: int, like: torch.Tensor) -> Array:
        """An uninitialised ``(rows, cols)`` scratch array of ``like``'s dtype and device."""
        return self.view(torch.empty(rows, cols, dtype=like.dtype, device=like.device))


def chunk_columns(n: int, d: int, x: torch.Tensor, scratch_rows: int) -> int:
    """Columns per chunk so that ``scratch_rows`` rows of scratch fit the cache (CPU) or a budget (CUDA).

    The scratch never exceeds an eighth (CPU) or a quarter (CUDA) of the input's own size beyond a
    small floor, so that small inputs keep a small footprint.
    """
    rows = max(scratch_rows, 1)
    if x.device.type == "cpu":
        budget = min(CPU_CHUNK_BYTES, max(1 << 18, n * d * x.element_size() // 8))
        k = budget // (rows * x.element_size())
        k = max(256, k - k % 64)
    else:
        k = max(1 << 10, min(CUDA_CHUNK_ELEMENTS, max(1 << 16, n * d // 4)) // rows)
    return max(1, min(k, d))  # at least 1: a (n, 0) input (an empty coordinate slice) yields no chunk


@dataclass
class Chunk:
    """One chunk of columns after the network.

    Attributes:
        cols: the chunk's columns in ``x``.
        s: ``s[p]`` is a row of the chunk's width; for every ``p`` in ``exact`` it holds the
            ``p``-th smallest value (0-based) of each column; the rows ``s[p]`` for ``p`` in
            ``group`` hold the group's order statistics in some order.
        tmp: ``extra`` scratch rows of the chunk's width, free for the kernel.
        be: the backend whose operations apply to these rows.
    """

    cols: slice
    s: list[Array]
    tmp: list[Array]
    be: Backend


def _run_network(rows: list[Array], network: Sequence[tuple[int, int]], pool: list[Array], be: Backend) -> None:
    # rows[p] starts as a read-only view of the input; the first comparator that touches p writes
    # its result into a free scratch row from ``pool`` (n + 1 rows always suffice).
    owned = [False] * len(rows)
    for i, j in network:
        a, b = rows[i], rows[j]
        low = pool.pop()
        be.minimum(a, b, out=low)
        if owned[j]:
            be.maximum(a, b, out=b)
            if owned[i]:
                pool.append(a)
        elif owned[i]:
            be.maximum(a, b, out=a)
            rows[j], owned[j] = a, True
        else:
            high = pool.pop()
            be.maximum(a, b, out=high)
            rows[j], owned[j] = high, True
        rows[i], owned[i] = low, True


def order_statistics(x: torch.Tensor, exact: Sequence[int], group: Sequence[int] = (),
                     rows: Sequence[int] | None = None, extra: int = 0) -> Iterator[Chunk]:
    """Chunks of ``x[rows]`` with the requested order statistics, by a pruned comparator network.

    Args:
        x: ``(n, d)`` finite floating tensor (never modified).
        exact: 0-based order statistics needed exactly.
        group: positions needed only as a multiset (e.g. the kept middle of a trimmed mean).
        rows: the rows of ``x`` to use (default all), without copying them.
        extra: number of additional scratch rows per chunk for the kernel (``Chunk.tmp``).

    Yields:
        :class:`Chunk` per column chunk, in order. The rows of a chunk are overwritten by the next.
    """
    idx = list(range(x.shape[0])) if rows is None else [int(r) for r in rows]
    n, d = len(idx), x.shape[1]
    be = Backend(x)
    net = selection_network(n, frozenset(exact), frozenset(group))
    k = chunk_columns(n, d, x, n + 1 + extra)
    scratch = be.empty(n + 1 + extra, k, x)
    xa = be.view(x)
    for start in range(0, d, k):
        stop = min(start + k, d)
        width = stop - start
        s = [xa[r, start:stop] for r in idx]
        pool = [scratch[i, :width] for i in range(n + 1)]
        _run_network(s, net, pool, be)
        yield Chunk(slice(start, stop), s, [scratch[n + 1 + i, :width] for i in range(extra)], be)


def sorted_columns_chunks(x: torch.Tensor, lo: int, hi: int) -> Iterator[tuple[slice, torch.Tensor]]:
    """Yield ``(cols, s)`` where ``s`` holds rows ``lo..hi`` (inclusive) of ``x[:, cols]`` sorted per column.

    Rows outside ``lo..hi`` of ``s`` are unspecified when a faster partial method is used; rows
    ``lo..hi`` are exactly the ``lo``-th..``hi``-th order statistics (0-based) of each column.

    Args:
        x: ``(n, d)`` floating tensor, finite.
        lo: first 0-based order statistic needed, ``0 <= lo <= hi``.
        hi: last 0-based order statistic needed, ``lo <= hi < n``.
    """
    n, d = x.shape
    chunk = max(1, CHUNK_ELEMENTS // max(n, 1))
    for start in range(0, d, chunk):
        cols = slice(start, min(start + chunk, d))
        yield cols, torch.sort(x[:, cols], dim=0).values
