"""Coordinate-wise kernels: mean, median, trimmed mean, MeaMed.

All kernels take ``x`` of shape ``(n, d)`` (any floating dtype, any device) and return ``(d,)`` of
the same dtype and device. They never mutate ``x`` and never return a view of it. Inputs are
assumed finite (the rule classes check that first). ``rows`` (optional) restricts a kernel to
those rows of ``x`` without copying them (Bulyan uses it on its selected rows).

Fast paths (used by the rules) get their order statistics from a pruned comparator network run on
cache-sized column chunks (:func:`~robustagg.functional.selection.order_statistics`): no sort, no
``(n, d)`` temporary. Each has a readable ``*_reference`` next to it (a ``torch.sort`` of column
chunks), and the tests compare the two on random inputs with ties and duplicates.

Exactness: order statistics are bitwise those of a sort, so the median is bitwise equal to its
reference. Averages (trimmed mean, MeaMed) average exactly the same values as the reference, in
another order: the results differ only by float summation order, at most ``(m - 1)`` units in the
last place of the largest kept magnitude for ``m`` averaged values (tests use ``rtol=0``,
``atol = 4 m eps max|x|``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .selection import order_statistics, sorted_columns_chunks

__all__ = ["mean", "coordinate_median", "trimmed_mean", "meamed", "coordinate_median_reference",
           "trimmed_mean_reference", "meamed_reference"]


def mean(x: torch.Tensor) -> torch.Tensor:
    """Arithmetic mean of the rows: ``(1/n) sum_i x_i``. Shape ``(n, d) -> (d,)``."""
    return x.mean(dim=0)


def _rows(x: torch.Tensor, rows: Sequence[int] | None) -> int:
    return x.shape[0] if rows is None else len(rows)


def _accumulator(x: torch.Tensor, o: Any, acc: list[torch.Tensor]) -> Any:
    """Where to sum a chunk: ``o`` itself, or a float32 row for float16/bfloat16 (as ``torch.mean``)."""
    if x.dtype in (torch.float32, torch.float64):
        return o
    if not acc:  # the first chunk is the widest
        acc.append(torch.empty(o.shape[0], dtype=torch.float32, device=x.device))
    return acc[0][:o.shape[0]]


def coordinate_median(x: torch.Tensor, rows: Sequence[int] | None = None) -> torch.Tensor:
    """Coordinate-wise median; for even ``n`` the average of the two middle values.

    ``torch.median`` returns the lower middle for even n; this kernel does not. The two middles
    are added then halved in the input dtype, exactly as :func:`coordinate_median_reference`.
    Shape ``(n, d) -> (d,)``.
    """
    n = _rows(x, rows)
    lo, hi = (n - 1) // 2, n // 2
    out = torch.empty(x.shape[1], dtype=x.dtype, device=x.device)
    for ch in order_statistics(x, (lo, hi), rows=rows):
        be, o = ch.be, ch.be.view(out)[ch.cols]
        if lo == hi:
            be.copy(o, ch.s[lo])
        else:
            be.add(ch.s[lo], ch.s[hi], out=o)
            be.multiply(o, 0.5, out=o)
    return out


def coordinate_median_reference(x: torch.Tensor) -> torch.Tensor:
    """Reference for :func:`coordinate_median`: sort each column chunk, take the middle(s)."""
    n = x.shape[0]
    lo, hi = (n - 1) // 2, n // 2
    out = torch.empty(x.shape[1], dtype=x.dtype, device=x.device)
    for cols, s in sorted_columns_chunks(x, lo, hi):
        if lo == hi:
            out[cols].copy_(s[lo])
        else:
            torch.add(s[lo], s[hi], out=out[cols]).mul_(0.5)
    return out


def trimmed_mean(x: torch.Tensor, f: int, rows: Sequence[int] | None = None) -> torch.Tensor:
    """Coordinate-wise trimmed mean: drop the ``f`` largest and ``f`` smallest, average the rest.

    Requires ``n > 2f`` (the class checks ``n >= 2f + 1``). The kept ``n - 2f`` values are summed
    in the input dtype, then divided by ``n - 2f``. Shape ``(n, d) -> (d,)``.
    """
    n = _rows(x, rows)
    if f == 0:
        return x.mean(dim=0) if rows is None else x[torch.as_tensor(list(rows), device=x.device)].mean(dim=0)
    middle = range(f, n - f)
    out = torch.empty(x.shape[1], dtype=x.dtype, device=x.device)
    acc_row: list[torch.Tensor] = []
    for ch in order_statistics(x, (), group=middle, rows=rows):
        be, o = ch.be, ch.be.view(out)[ch.cols]
        acc = _accumulator(x, o, acc_row)
        be.copy(acc, ch.s[f])
        for p in middle[1:]:
            be.add(acc, ch.s[p], out=acc)
        be.divide(acc, len(middle), out=acc)
        if acc is not o:
            be.copy(o, acc)
    return out


def trimmed_mean_reference(x: torch.Tensor, f: int) -> torch.Tensor:
    """Reference for :func:`trimmed_mean`: sort each column chunk, average the middle rows."""
    n = x.shape[0]
    if f == 0:
        return x.mean(dim=0)
    out = torch.empty(x.shape[1], dtype=x.dtype, device=x.device)
    for cols, s in sorted_columns_chunks(x, f, n - f - 1):
        torch.mean(s[f:n - f], dim=0, out=out[cols])
    return out


def meamed(x: torch.Tensor, f: int, rows: Sequence[int] | None = None) -> torch.Tensor:
    """Mean around the median: per coordinate, average the ``n - f`` values closest to the median.

    The median is the even-n average of the two middle values, and distances to it are computed in
    float64 (exact for float32/16 inputs), so values at equal distance tie exactly; among them the
    lowest row index is kept first. Shape ``(n, d) -> (d,)``.

    Method: with ``w = n - f`` and the column sorted as ``s_0 <= ... <= s_{n-1}``, the kept values
    are a window ``s_a..s_{a+w-1}`` (``0 <= a <= f``), and the largest kept distance is
    ``delta = min_a max(|s_a - m|, |s_{a+w-1} - m|)``. Only the positions ``0..f`` and
    ``w-1..n-1`` are needed exactly (positions ``f..w-1`` are kept whatever ``a`` is). The output
    sums the values with distance ``<= delta``; a column where more than ``w`` values qualify
    (a tie at the boundary) is recomputed by :func:`meamed_reference`, which breaks it by row index.
    """
    n = _rows(x, rows)
    w = n - f
    if f == 0:
        return trimmed_mean(x, 0, rows)
    lo, hi = (n - 1) // 2, n // 2
    always = list(range(f, w))                      # kept for every window
    masked = [p for p in range(n) if not f <= p < w]  # kept iff their distance is <= delta
    zone = sorted(set(range(0, f + 1)) | set(range(w - 1, n)))  # ends of every candidate window
    exact = sorted(set(zone) | {lo, hi})
    out = torch.empty(x.shape[1], dtype=x.dtype, device=x.device)
    fix: list[torch.Tensor] = []
    scratch64: list = []
    acc_row: list[torch.Tensor] = []
    for ch in order_statistics(x, exact, group=[p for p in always if p not in exact], rows=rows, extra=2):
        be, s, o = ch.be, ch.s, ch.be.view(out)[ch.cols]
        width = ch.cols.stop - ch.cols.start
        if not scratch64:  # float64 rows: the median, delta, one distance per zone position
            buf = be.empty(len(zone) + 2, width, torch.empty(0, dtype=torch.float64, device=x.device))
            scratch64.extend(buf[i] for i in range(len(zone) + 2))
        med, delta = scratch64[0][:width], scratch64[1][:width]
        dist = {p: scratch64[2 + i][:width] for i, p in enumerate(zone)}
        be.copy(med, s[lo])
        be.add(med, s[hi], out=med)  # exact in float64 for float32/16 inputs
        be.multiply(med, 0.5, out=med)
        for p in zone:
            be.copy(dist[p], s[p])
            be.subtract(dist[p], med, out=dist[p])
            be.abs(dist[p], out=dist[p])
        be.maximum(dist[0], dist[w - 1], out=delta)
        for a in range(1, f + 1):
            be.maximum(dist[a], dist[a + w - 1], out=med)  # med is free from here on
            be.minimum(delta, med, out=delta)
        mask, count = ch.tmp
        acc = _accumulator(x, o, acc_row)
        if always:
            be.copy(acc, s[always[0]])
            for p in always[1:]:
                be.add(acc, s[p], out=acc)
        else:
            be.multiply(s[0], 0.0, out=acc)
        be.multiply(acc, 0.0, out=count)
        for p in masked:
            be.less_equal(dist[p], delta, out=mask)  # 1.0 where kept
            be.add(count, mask, out=count)
            be.multiply(mask, s[p], out=mask)
            be.add(acc, mask, out=acc)
        be.divide(acc, w, out=acc)
        if acc is not o:
            be.copy(o, acc)
        ties = torch.as_tensor(count, device=x.device) > (w - len(always))
        if bool(ties.any()):
            fix.append(ties.nonzero().flatten() + ch.cols.start)
    if fix:  # boundary ties: the reference breaks them by row index
        cols = torch.cat(fix)
        sub = x.index_select(1, cols)
        if rows is not None:
            sub = sub[torch.as_tensor(list(rows), device=x.device)]
        out[cols] = meamed_reference(sub, f)
    return out


def meamed_reference(x: torch.Tensor, f: int) -> torch.Tensor:
    """Reference for :func:`meamed`: float64 median and distances, stable sort, mean of the first ``n - f``."""
    n = x.shape[0]
    keep = n - f
    if f == 0:
        return x.mean(dim=0)
    lo, hi = (n - 1) // 2, n // 2
    out = torch.empty(x.shape[1], dtype=x.dtype, device=x.device)
    chunk = max(1, (1 << 20) // max(n, 1))
    for start in range(0, x.shape[1], chunk):
        cols = slice(start, min(start + chunk, x.shape[1]))
        block = x[:, cols]
        # Median and distances in float64: exact for float32/16 inputs, so values at equal distance
        # (e.g. copies of a middle value for even n) tie exactly and the lowest row wins.
        s = torch.sort(block.double(), dim=0).values
        dist = (block.double() - (s[lo] + s[hi]) * 0.5).abs_()
        order = torch.sort(dist, dim=0, stable=True).indices[:keep]
        torch.mean(torch.gather(block, 0, order), dim=0, out=out[cols])
    return out
