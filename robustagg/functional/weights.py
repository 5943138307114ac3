"""Each row's share in an aggregate, for suppression metrics (``rule.weights(x)``).

Shares are float64 ``(n,)`` tensors. For coordinate-wise rules the share of row i is the average
over coordinates of the weight its value gets in that coordinate's output; rows holding exactly
the same value in a coordinate split that value's weight equally (the output cannot tell them
apart, and many gradient coordinates are exactly 0 for every worker). For selection rules it is
the selection weight.
"""

from __future__ import annotations


import numpy as np
import torch

from .selection import Backend, order_statistics

__all__ = ["order_statistic_weights", "selection_weights", "meamed_weights"]

_CHUNK_ELEMENTS = 1 << 20


def _credit_split_over_ties(sorted_values: torch.Tensor, order: torch.Tensor, credit: torch.Tensor) -> torch.Tensor:
    """Per-row totals of ``credit`` ``(n, c)`` (given in sorted order), shared equally by equal values.

    Args:
        sorted_values: ``(n, c)`` each column sorted ascending.
        order: ``(n, c)`` the row index of each sorted entry.
        credit: ``(n, c)`` float64 credit of each sorted position.

    Returns:
        ``(n,)`` float64: for each row, the sum over columns of the mean credit of its run of equal values.
    """
    n, c = sorted_values.shape
    new_run = torch.ones_like(sorted_values, dtype=torch.long)
    new_run[1:] = (sorted_values[1:] != sorted_values[:-1]).long()
    run = new_run.cumsum(dim=0) - 1 + torch.arange(c, device=order.device) * n  # a global id per (column, run)
    flat = run.flatten()
    total = torch.zeros(n * c, dtype=torch.float64, device=order.device).index_add_(0, flat, credit.flatten())
    size = torch.zeros(n * c, dtype=torch.float64, device=order.device).index_add_(
        0, flat, torch.ones_like(credit).flatten())
    shared = (total / size.clamp(min=1.0))[flat]
    return torch.zeros(n, dtype=torch.float64, device=order.device).index_add_(0, order.flatten(), shared)


def _contiguous_runs(positions: list[int]) -> list[tuple[int, int]]:
    """``[(p0, p1), ...]``: the maximal half-open ranges that make up the set ``positions``."""
    runs: list[tuple[int, int]] = []
    for p in sorted(set(positions)):
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs


def order_statistic_weights(x: torch.Tensor, positions: list[int], per_position: float) -> torch.Tensor:
    """Average over coordinates of ``per_position`` for each row at one of ``positions`` of its
    column's ascending order; rows holding equal values share their run's credit equally.

    Credit is additive over positions, so ``positions`` is split into its maximal contiguous ranges
    and each range ``[p0, p1)`` is credited on its own. In one coordinate, with ``a`` and ``b`` the
    values at positions ``p0`` and ``p1 - 1``: a value strictly between them is credited in full, a
    value outside gets nothing, and the ``hi - lo`` rows equal to ``a`` (or ``b``), which occupy
    the sorted positions ``[lo, hi)``, share ``per_position * |[lo, hi) & [p0, p1)|`` equally.
    ``a`` and ``b`` come from the comparator network of
    :func:`~robustagg.functional.selection.order_statistics` (exact order statistics, no sort),
    ``lo`` and ``hi`` from two comparisons per row: ``O(n d)`` per range after the network, which
    is what makes the metric cheaper than the rule it measures (the median's one or two middles
    and the trimmed mean's ``f .. n - f - 1`` are one range; a rule that keeps the two extremes of
    the trimmed set, say, has two).

    Args:
        x: ``(n, d)`` finite floating rows (compared as given).
        positions: the credited sorted positions (0-based), each in ``[0, n)``; a position listed
            twice is credited once.
        per_position: the credit of each position (``1/(n - 2f)`` for the trimmed mean).

    Returns:
        ``(n,)`` float64 shares summing to ``len(set(positions)) * per_position`` (up to rounding).

    Raises:
        ValueError: ``positions`` is empty or has a position outside ``[0, n)``.

    Needs no (n, f) assumption of its own (the rule that calls it checks its requirement). Source:
    this project's suppression metric (``docs/metrics.md``); the ties convention is the project's.
    """
    n, d = x.shape
    if not positions or min(positions) < 0 or max(positions) >= n:
        raise ValueError(f"positions must be a non-empty list of sorted-order positions inside [0, {n}), got {positions}")
    runs = _contiguous_runs(positions)
    counts = torch.zeros(n, dtype=torch.float64, device=x.device)
    if d == 0:
        return counts
    ends = sorted({p for p0, p1 in runs for p in (p0, p1 - 1)})
    stats = {p: torch.empty(d, dtype=x.dtype, device=x.device) for p in ends}
    for chunk in order_statistics(x, exact=ends):
        for p, values in stats.items():
            values[chunk.cols] = torch.as_tensor(chunk.s[p])
    if Backend(x).numpy and x.dtype in (torch.float32, torch.float64):
        return _credit_compiled(x, runs, stats, per_position) / d
    step = max(1, _CHUNK_ELEMENTS // n)
    for s in range(0, d, step):
        block = x[:, s:s + step]
        for p0, p1 in runs:
            counts += _credit_one_range(block, stats[p0][s:s + step], stats[p1 - 1][s:s + step], p0, p1, per_position)
    return counts / d


def _credit_compiled(x: torch.Tensor, runs: list[tuple[int, int]], stats: dict[int, torch.Tensor],
                     per_position: float) -> torch.Tensor:
    """The CPU path of :func:`order_statistic_weights`: the compiled two-pass kernel
    (:mod:`~robustagg.functional._credit_kernel`) over the whole matrix, once per range: ``(n,)``
    float64 credit summed over the columns (not yet divided by ``d``)."""
    from ._credit_kernel import credit_range  # compiled on first use (Numba)

    xn = np.ascontiguousarray(x.detach().numpy())
    whole = np.zeros(x.shape[0], dtype=np.int64)
    shared = np.zeros(x.shape[0], dtype=np.float64)
    for p0, p1 in runs:
        credit_range(xn, np.ascontiguousarray(stats[p0].numpy()), np.ascontiguousarray(stats[p1 - 1].numpy()),
                     p0, p1, whole, shared)
    return torch.from_numpy(per_position * (whole.astype(np.float64) + shared))


def _f64(a: torch.Tensor) -> torch.Tensor:
    """``a`` as float64."""
    return a.to(torch.float64)


def _credit_one_range(block: torch.Tensor, lo_v: torch.Tensor, hi_v: torch.Tensor, p0: int, p1: int,
                      per_position: float) -> torch.Tensor:
    """``(n,)`` float64 per-row credit summed over the columns of ``block`` ``(n, c)`` for the sorted
    positions ``[p0, p1)``, whose first and last values per column are ``lo_v`` and ``hi_v`` ``(c,)``
    (tensors: the path of CUDA and other devices, and of dtypes the compiled CPU kernel does not take).

    A column whose run of values equal to ``lo`` starts at ``p0`` and whose run equal to ``hi`` ends
    at ``p1 - 1`` credits every value in ``[lo, hi]`` in full: one inclusive comparison. The run
    spills out of the range exactly when fewer than ``p0`` values are below ``lo`` (more than
    ``n - p0`` are ``>= lo``) or more than ``p1`` are ``<= hi``; only those columns take the
    run-sharing of :func:`_credit_spilling_runs`.
    """
    n = block.shape[0]
    ge = block >= lo_v
    le = block <= hi_v
    inside = ge & le
    spill = (ge.sum(0) > n - p0) | (le.sum(0) > p1)
    whole = inside.sum(1)
    if not bool(spill.any()):
        return per_position * _f64(whole)
    cols = spill.nonzero().squeeze(1)
    whole -= inside[:, cols].sum(1)  # integer counts: exact
    return per_position * _f64(whole) + _credit_spilling_runs(
        block[:, cols], lo_v[cols], hi_v[cols], p0, p1, per_position)


def _credit_spilling_runs(block: torch.Tensor, lo_v: torch.Tensor, hi_v: torch.Tensor, p0: int, p1: int,
                          per_position: float) -> torch.Tensor:
    """:func:`_credit_one_range` for any columns: a value strictly inside ``(lo, hi)`` in full, and
    the ``run`` rows equal to ``lo`` (or ``hi``), at sorted positions ``[below, below + run)``,
    ``per_position * |[below, below + run) & [p0, p1)| / run`` each."""
    counts = per_position * _f64(((block > lo_v) & (block < hi_v)).sum(1))
    for value, first in ((lo_v, True), (hi_v, False)):
        equal = block == value
        if not first:
            equal &= (lo_v != hi_v)  # a == b: the one run was credited with a
        below = (block < value).sum(0)
        run = equal.sum(0).clip(min=1)  # >= 1 but where a == b masked b's run out
        overlap = _f64((below + run).clip(max=p1) - below.clip(min=p0))
        counts = counts + _f64(equal) @ (per_position * overlap / _f64(run))
    return counts


def meamed_weights(x: torch.Tensor, f: int, median: torch.Tensor) -> torch.Tensor:
    """Shares for MeaMed: each kept value (the ``n - f`` closest to the median, lowest index first among
    equal distances) weighs ``1/(n - f)``; rows holding the same value share. ``(n, d) -> (n,)``."""
    n, d = x.shape
    keep = n - f
    counts = torch.zeros(n, dtype=torch.float64, device=x.device)
    chunk = max(1, _CHUNK_ELEMENTS // n)
    for s in range(0, d, chunk):
        block = x[:, s:s + chunk]
        near = torch.sort((block.double() - median[s:s + chunk].double()).abs(), dim=0, stable=True).indices[:keep]
        kept = torch.zeros(block.shape, dtype=torch.float64, device=x.device).scatter_(0, near, 1.0 / keep)
        values, order = torch.sort(block, dim=0, stable=True)
        counts += _credit_split_over_ties(values, order, kept.gather(0, order))
    return counts / d


def selection_weights(n: int, chosen: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """``1/len(chosen)`` on the chosen row indices, 0 elsewhere."""
    w = torch.zeros(n, dtype=torch.float64, device=device)
    w[chosen.to(w.device)] = 1.0 / chosen.numel()
    return w
