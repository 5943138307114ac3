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
    sorted order (equal values share). ``(n, d) -> (n,)`` float64."""
    n, d = x.shape
    counts = torch.zeros(n, dtype=torch.float64, device=x.device)
    chunk = max(1, _CHUNK_ELEMENTS // n)
    kept = torch.zeros(n, 1, dtype=torch.float64, device=x.device)
    kept[positions] = per_position
    for s in range(0, d, chunk):
        values, order = torch.sort(x[:, s:s + chunk], dim=0, stable=True)
        counts += _credit_split_over_ties(values, order, kept.expand_as(values))
    return counts / d


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
