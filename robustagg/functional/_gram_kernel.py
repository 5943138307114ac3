"""Compiled (Numba) kernel of :func:`robustagg.functional.gram.gram` on CPU.

The float64 Gram matrix of ``m`` rows of length ``d`` needs ``m (m + 1) / 2`` dot products of
length ``d``; for ``m = 20`` that is ~10 fused multiply-adds per input element, so on one core it
is compute-bound, not bandwidth-bound. A general BLAS ``syrk``/``gemm`` computes (nearly) the
full ``m x m`` product for such a small ``m``. This kernel computes only the upper triangle:

1. a column chunk of ``width`` coordinates is converted to float64 (minus the centre, if any)
   into a cache-resident buffer of ``m_pad = 4 ceil(m / 4)`` rows (zero padding);
2. register tiles of 2 x 4 dot products (8 independent accumulator chains, vectorised along the
   coordinates) cover the upper triangle block by block;
3. each chunk's partial sums are added to the float64 result.

Arithmetic: every product is exact (float32 values, or float64 values whose products round once
per fused multiply-add), and every entry is summed in the same order (the same lanes, the same
chunks), so identical rows give bitwise identical Gram entries; ``fastmath`` is limited to
``contract`` (FMA) and ``reassoc`` (lane-wise partial sums), so NaN and inf propagate as IEEE says.
The rounding differs from a BLAS product only at float64 rounding level (~1e-16 relative).

Compiled on first use, 2 to 3 s per signature (``cache=True`` keeps the machine code in
``__pycache__`` beside this file, so later processes load it in ~0.5 s including Numba's import);
:func:`robustagg.functional.gram.warm_up` does it ahead of time.
"""

from __future__ import annotations

import numba as nb
import numpy as np

_FASTMATH = {"contract", "reassoc"}


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _fill_rows(rows: np.ndarray, center: np.ndarray, buf: np.ndarray, first: int, start: int, width: int) -> None:
    """``buf[first + i, :width] = float64(rows[i, start:start + width]) - center[start:start + width]``."""
    has_center = center.shape[0] > 0
    for i in range(rows.shape[0]):
        row = rows[i, start:start + width]
        out = buf[first + i]
        if has_center:
            c = center[start:start + width]
            for k in range(width):
                out[k] = np.float64(row[k]) - c[k]
        else:
            for k in range(width):
                out[k] = np.float64(row[k])


@nb.njit(fastmath=_FASTMATH, cache=True, nogil=True, boundscheck=False)
def _tile(buf: np.ndarray, ib: int, jb: int, width: int, acc: np.ndarray) -> None:
    """``acc[ib:ib+2, jb:jb+4] += buf[ib:ib+2, :width] @ buf[jb:jb+4, :width].T``."""
    a0 = buf[ib]
    a1 = buf[ib + 1]
    b0 = buf[jb]
    b1 = buf[jb + 1]
    b2 = buf[jb + 2]
    b3 = buf[jb + 3]
    s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = 0.0
    for k in range(width):
        u0 = a0[k]
        u1 = a1[k]
        v0 = b0[k]
        v1 = b1[k]
        v2 = b2[k]
        v3 = b3[k]
        s00 += u0 * v0
        s01 += u0 * v1
        s02 += u0 * v2
        s03 += u0 * v3
        s10 += u1 * v0
        s11 += u1 * v1
        s12 += u1 * v2
        s13 += u1 * v3
    acc[ib, jb] += s00
    acc[ib, jb + 1] += s01
    acc[ib, jb + 2] += s02
    acc[ib, jb + 3] += s03
    acc[ib + 1, jb] += s10
    acc[ib + 1, jb + 1] += s11
    acc[ib + 1, jb + 2] += s12
    acc[ib + 1, jb + 3] += s13


@nb.njit(cache=True, nogil=True, boundscheck=False)
def gram_upper(x: np.ndarray, extra: np.ndarray, center: np.ndarray, chunk: int) -> np.ndarray:
    """Float64 Gram matrix of the rows of ``[x; extra]`` minus ``center`` (symmetric, ``(m, m)``).

    Args:
        x: ``(n, d)`` float32 or float64.
        extra: ``(e, d)`` float64 (``e`` may be 0).
        center: ``(d,)`` float64, or ``(0,)`` for no centre.
        chunk: coordinates per chunk (the float64 buffer holds ``m_pad x chunk`` values).
    """
    n, d = x.shape
    m = n + extra.shape[0]
    m_pad = (m + 3) // 4 * 4
    width_max = max(1, min(chunk, d))
    buf = np.zeros((m_pad, width_max), dtype=np.float64)
    acc = np.zeros((m_pad, m_pad), dtype=np.float64)
    for start in range(0, d, width_max):
        width = min(width_max, d - start)
        _fill_rows(x, center, buf, 0, start, width)
        _fill_rows(extra, center, buf, n, start, width)
        for ib in range(0, m_pad, 2):
            for jb in range(ib // 4 * 4, m_pad, 4):
                _tile(buf, ib, jb, width, acc)
    g = np.empty((m, m), dtype=np.float64)
    for i in range(m):
        for j in range(i, m):
            g[i, j] = acc[i, j]
            g[j, i] = acc[i, j]
    return g
