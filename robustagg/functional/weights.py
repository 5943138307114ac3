"""Each row's share in an aggregate, for suppression metrics (``rule.weights(x)``).

Shares are float64 ``(n,)`` tensors. For coordinate-wise rules the share of row i is the average
over coordinates of the weight its value gets in that coordinate's output; rows holding exactly
the same value in a coordinate split that value's weight equally (the output cannot tell them
apart, and many gradient coordinates are exactly 0 for every worker). For selection rules it is
the selection weight.
"""

from __future__ import annotations

import torch

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


def order_statistic_weights(x: torch.Tensor, positions: list[int], per_position: float) -> torch.Tensor:
    """Average over coordinates of ``per_position`` for each row at one of ``positions`` of its column's
    sorted order (equal values share). ``(n, d) -> (n,)`` float64.

    Definition: in each column, sort the values stably; position p earns ``per_position`` when
    ``p`` is in ``positions``, else 0; a run of equal values at positions ``[a, b)`` pools what its
    positions earn and each of its ``b - a`` rows gets ``pooled / (b - a)``; a row's share is the
    sum over columns divided by ``d``. The coordinate-wise median (``positions`` its middle one or
    two, ``per_position`` 1 or 1/2) and trimmed mean (``positions`` ``f .. n - f - 1``,
    ``per_position`` ``1 / (n - 2f)``) use it.

    The pooled credit of a run is the sequential float64 sum of its earning positions' credit
    (``pooled[k]``, a table over the number ``k`` of earning positions in the run) and each row's
    share is accumulated in the (sorted position, column) order of the chunk, so the result is
    bitwise that of :func:`_credit_split_over_ties` on the sorted chunk (the general form, which
    MeaMed's per-entry credit needs; tested in ``tests/test_weights.py``) without its two
    scatter-adds over every entry.

    Shape: ``x`` ``(n, d)`` finite, any floating dtype; ``positions`` distinct, in ``[0, n)``.
    """
    n, d = x.shape
    counts = torch.zeros(n, dtype=torch.float64, device=x.device)
    chunk = max(1, _CHUNK_ELEMENTS // n)
    earns = torch.zeros(n + 1, dtype=torch.long)  # earns[p]: earning positions among 0 .. p - 1
    earns[1:] = torch.zeros(n, dtype=torch.long).index_fill_(0, torch.tensor(positions, dtype=torch.long), 1).cumsum(0)
    pooled = [0.0]
    for _ in range(n):
        pooled.append(pooled[-1] + float(per_position))  # the sum index_add_ forms, one position at a time
    earns = earns.to(x.device)
    pooled_t = torch.tensor(pooled, dtype=torch.float64, device=x.device)
    for s in range(0, d, chunk):
        values, order = torch.sort(x[:, s:s + chunk], dim=0, stable=True)
        counts += _pooled_share(values, order, earns, pooled_t)
    return counts / d


def _pooled_share(sorted_values: torch.Tensor, order: torch.Tensor, earns: torch.Tensor,
                  pooled: torch.Tensor) -> torch.Tensor:
    """Per-row totals of each sorted entry's share of its run's pooled credit (see :func:`order_statistic_weights`).

    Args:
        sorted_values: ``(n, c)`` each column sorted ascending (finite).
        order: ``(n, c)`` the row index of each sorted entry.
        earns: ``(n + 1,)`` int64, the number of earning positions before each position.
        pooled: ``(n + 1,)`` float64, the pooled credit of a run holding k earning positions.

    Returns:
        ``(n,)`` float64, accumulated in flattened ``(position, column)`` order.
    """
    n, c = sorted_values.shape
    differs = sorted_values[1:] != sorted_values[:-1]  # (n - 1, c): a run ends between p and p + 1
    # each entry's run [start, end), one sweep down and one up the n positions (cheaper than cummax)
    start = torch.zeros((n, c), dtype=torch.long, device=order.device)
    for p in range(1, n):
        start[p] = torch.where(differs[p - 1], p, start[p - 1])
    end = torch.full((n, c), n, dtype=torch.long, device=order.device)
    for p in range(n - 2, -1, -1):
        end[p] = torch.where(differs[p], p + 1, end[p + 1])
    k = (earns.index_select(0, end.reshape(-1)) - earns.index_select(0, start.reshape(-1)))
    shared = pooled.index_select(0, k) / (end - start).reshape(-1).to(torch.float64)
    return torch.zeros(n, dtype=torch.float64, device=order.device).index_add_(0, order.reshape(-1), shared)


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
