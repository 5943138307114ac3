"""Compiled (Numba) kernel of the order-statistic shares (:func:`robustagg.functional.weights.order_statistic_weights`) on CPU.

For one credited range of sorted positions ``[p0, p1)`` whose boundary values per column are
``lo`` and ``hi`` (the exact order statistics at ``p0`` and ``p1 - 1``), row ``i`` earns in column
``j``:

- ``1`` when ``lo_j < x_ij < hi_j`` (strictly inside: its sorted position is inside the range);
- ``|[b, b + r) & [p0, p1)| / r`` when ``x_ij == lo_j``, where ``b`` values of the column are below
  ``lo_j`` and ``r`` are equal to it (the run of equal values occupies the sorted positions
  ``[b, b + r)``, and its credited positions are shared equally);
- the same with ``hi_j``'s run when ``x_ij == hi_j != lo_j`` (when ``lo_j == hi_j`` the one run was
  credited with ``lo_j``);
- ``0`` otherwise.

Blocks of columns, two passes of the rows over each (no ``(n, d)`` temporary): the first counts,
per column, the values below and equal to ``lo`` and ``hi``; the second credits every row. The
whole credits are counted in integers (exact); the shared ones are summed
in float64 (in vector lanes), so the result differs from an exact sum only by that rounding (about
``d * 1e-16`` relative). Comparisons are IEEE: ``-0.0 == 0.0``, as the sorted order has them.

Compiled on first use (about 1 to 2 s per signature; ``cache=True`` keeps the machine code in
``__pycache__`` beside this file); :func:`robustagg.functional.gram.warm_up` loads it ahead of time.
"""

from __future__ import annotations

import numba as nb
import numpy as np


#: Columns per block: the block's counters stay in L1 while the rows stream through it.
BLOCK = 512


@nb.njit(cache=True, nogil=True, boundscheck=False, fastmath={"reassoc"})
def credit_range(x: np.ndarray, lo: np.ndarray, hi: np.ndarray, p0: int, p1: int,
                 whole: np.ndarray, shared: np.ndarray) -> None:
    """Add each row's credit for the sorted positions ``[p0, p1)`` to ``whole`` (int64, full credits)
    and ``shared`` (float64, the shared credits of the boundary runs). ``x`` ``(n, c)`` C-contiguous,
    ``lo``, ``hi`` ``(c,)`` of ``x``'s dtype (the values at sorted positions ``p0`` and ``p1 - 1``).

    Blocks of :data:`BLOCK` columns; in each, the rows stream through twice (count, then credit)
    with branch-free comparisons (gradient values make every branch a coin toss) that vectorise;
    ``reassoc`` lets the float64 sum of the shared credits run in vector lanes."""
    n, c = x.shape
    below_a = np.empty(BLOCK, np.int32)
    equal_a = np.empty(BLOCK, np.int32)
    below_b = np.empty(BLOCK, np.int32)
    equal_b = np.empty(BLOCK, np.int32)
    part_a = np.empty(BLOCK, np.float64)
    part_b = np.empty(BLOCK, np.float64)
    for s in range(0, c, BLOCK):
        w = min(BLOCK, c - s)
        a = lo[s:s + w]
        b = hi[s:s + w]
        below_a[:w] = 0
        equal_a[:w] = 0
        below_b[:w] = 0
        equal_b[:w] = 0
        for i in range(n):
            row = x[i, s:s + w]
            for j in range(w):
                v = row[j]
                below_a[j] += np.int32(v < a[j])
                equal_a[j] += np.int32(v == a[j])
                below_b[j] += np.int32(v < b[j])
                equal_b[j] += np.int32(v == b[j])
        for j in range(w):
            run = max(equal_a[j], 1)
            part_a[j] = (min(below_a[j] + run, p1) - max(below_a[j], p0)) / run
            if a[j] == b[j]:
                part_b[j] = 0.0  # one run, credited with lo
            else:
                run = max(equal_b[j], 1)
                part_b[j] = (min(below_b[j] + run, p1) - max(below_b[j], p0)) / run
        for i in range(n):
            row = x[i, s:s + w]
            full = np.int32(0)
            frac = 0.0
            for j in range(w):
                v = row[j]
                full += np.int32((v > a[j]) & (v < b[j]))
                frac += part_a[j] if v == a[j] else (part_b[j] if v == b[j] else 0.0)
            whole[i] += full
            shared[i] += frac
