"""Coordinate-wise kernels: mean, median, trimmed mean, MeaMed.

All kernels take ``x`` of shape ``(n, d)`` (any floating dtype, any device) and return ``(d,)`` of
the same dtype and device. They never mutate ``x`` and never return a view of it. Inputs are
assumed finite (the rule classes check that first).

Order statistics are computed on column chunks so that the temporaries stay at most a few
megabytes whatever ``d`` is (no full ``(n, d)`` sort copy).
"""

from __future__ import annotations

import torch

from .selection import sorted_columns_chunks

__all__ = ["mean", "coordinate_median", "trimmed_mean", "meamed"]


def mean(x: torch.Tensor) -> torch.Tensor:
    """Arithmetic mean of the rows: ``(1/n) sum_i x_i``. Shape ``(n, d) -> (d,)``."""
    return x.mean(dim=0)


def coordinate_median(x: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise median; for even ``n`` the average of the two middle values.

    ``torch.median`` returns the lower middle for even n; this kernel does not.
    Shape ``(n, d) -> (d,)``.
    """
    n = x.shape[0]
    lo, hi = (n - 1) // 2, n // 2
    out = torch.empty(x.shape[1], dtype=x.dtype, device=x.device)
    for cols, s in sorted_columns_chunks(x, lo, hi):
        if lo == hi:
            out[cols].copy_(s[lo])
        else:
            torch.add(s[lo], s[hi], out=out[cols]).mul_(0.5)
    return out


def trimmed_mean(x: torch.Tensor, f: int) -> torch.Tensor:
    """Coordinate-wise trimmed mean: drop the ``f`` largest and ``f`` smallest, average the rest.

    Requires ``n > 2f`` (the class checks ``n >= 2f + 1``). Shape ``(n, d) -> (d,)``.
    """
    n = x.shape[0]
    if f == 0:
        return x.mean(dim=0)
    out = torch.empty(x.shape[1], dtype=x.dtype, device=x.device)
    for cols, s in sorted_columns_chunks(x, f, n - f - 1):
        torch.mean(s[f:n - f], dim=0, out=out[cols])
    return out


def meamed(x: torch.Tensor, f: int) -> torch.Tensor:
    """Mean around the median: per coordinate, average the ``n - f`` values closest to the median.

    The median is the even-n average of the two middle values. Among values at equal distance from
    the median, the lowest row index is kept first. Shape ``(n, d) -> (d,)``.
    """
    n = x.shape[0]
    keep = n - f
    if f == 0:
        return x.mean(dim=0)
    med = coordinate_median(x)
    out = torch.empty(x.shape[1], dtype=x.dtype, device=x.device)
    chunk = max(1, (1 << 20) // max(n, 1))
    for start in range(0, x.shape[1], chunk):
        cols = slice(start, min(start + chunk, x.shape[1]))
        block = x[:, cols]
        dist = (block - med[cols]).abs_()
        order = torch.sort(dist, dim=0, stable=True).indices[:keep]
        torch.mean(torch.gather(block, 0, order), dim=0, out=out[cols])
    return out
