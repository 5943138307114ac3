"""Compiled (Numba) kernel of the per-step metrics' float64 moments (:func:`robustagg.metrics.step_metrics`) on CPU.

One pass over the honest rows of ``x`` ``(n, d)`` and the aggregate ``(d,)``, in blocks of columns
(a block's float64 honest mean stays in cache): the honest mean ``mu_j = (sum_{i in H} x_ij) / h``
(the rows added in index order; ``torch.mean(dim=0)`` adds seven or more rows in another order, so
the two means can differ in the last bit), each honest row's
``sum_j (x_ij - mu_j)^2``, and ``sum_j (F_j - mu_j)^2``, ``sum_j mu_j^2``, ``sum_j F_j^2``,
``sum_j F_j mu_j``. Every value is converted to float64 before it is used (float32 differences and
products are then exact); the sums over columns run in vector lanes (``reassoc``), so they differ
from torch's float64 reductions of the same numbers only by float64 rounding (about ``1e-16``
relative per term). Non-finite values propagate as IEEE says (``reassoc`` only).

Compiled on first use (about 1 s per signature; ``cache=True`` keeps the machine code in
``__pycache__`` beside this file); :func:`robustagg.functional.gram.warm_up` loads it ahead of time.
"""

from __future__ import annotations

import numba as nb
import numpy as np

#: Columns per block: the block's float64 honest mean stays in L1 while the honest rows stream through.
BLOCK = 1024


@nb.njit(cache=True, nogil=True, boundscheck=False, fastmath={"reassoc"})
def moments(x: np.ndarray, honest: np.ndarray, agg: np.ndarray, row_dev: np.ndarray) -> np.ndarray:
    """``[sum (F - mu)^2, sum mu^2, sum F^2, sum F mu]`` (float64 ``(4,)``); ``row_dev[k]`` (float64,
    ``(h,)``, overwritten) = ``sum_j (x[honest[k], j] - mu_j)^2``. ``x`` ``(n, d)`` C-contiguous,
    ``honest`` int64 row indices (at least one), ``agg`` ``(d,)``."""
    n, d = x.shape
    h = honest.shape[0]
    mu = np.empty(BLOCK, np.float64)
    out = np.zeros(4, np.float64)
    row_dev[:] = 0.0
    for s in range(0, d, BLOCK):
        w = min(BLOCK, d - s)
        mu[:w] = 0.0
        for k in range(h):
            row = x[honest[k], s:s + w]
            for j in range(w):
                mu[j] += np.float64(row[j])
        for j in range(w):
            mu[j] /= h
        for k in range(h):
            row = x[honest[k], s:s + w]
            acc = 0.0
            for j in range(w):
                t = np.float64(row[j]) - mu[j]
                acc += t * t
            row_dev[k] += acc
        a = agg[s:s + w]
        e = 0.0
        m2 = 0.0
        f2 = 0.0
        fm = 0.0
        for j in range(w):
            fj = np.float64(a[j])
            t = fj - mu[j]
            e += t * t
            m2 += mu[j] * mu[j]
            f2 += fj * fj
            fm += fj * mu[j]
        out[0] += e
        out[1] += m2
        out[2] += f2
        out[3] += fm
    return out
