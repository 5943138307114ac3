"""Each row's share in an aggregate, for suppression metrics (``rule.weights(x)``).

Shares are float64 ``(n,)`` tensors. For coordinate-wise rules the share of row i is the average
over coordinates of the weight its value gets in that coordinate's output (ties resolved by the
stable sort order, lowest index first); for selection rules it is the selection weight.
"""

from __future__ import annotations

import torch

__all__ = ["order_statistic_weights", "selection_weights", "meamed_weights"]


def order_statistic_weights(x: torch.Tensor, positions: list[int], per_position: float) -> torch.Tensor:
    """Average over coordinates of ``per_position`` for each row sitting at one of ``positions``
    in its column's stable sort order. ``(n, d) -> (n,)`` float64."""
    n, d = x.shape
    counts = torch.zeros(n, dtype=torch.float64, device=x.device)
    chunk = max(1, (1 << 20) // n)
    pos = torch.tensor(positions, dtype=torch.long, device=x.device)
    for s in range(0, d, chunk):
        idx = torch.sort(x[:, s:s + chunk], dim=0, stable=True).indices.index_select(0, pos)
        counts += torch.bincount(idx.flatten(), minlength=n).to(torch.float64)
    return counts * per_position / d


def meamed_weights(x: torch.Tensor, f: int, median: torch.Tensor) -> torch.Tensor:
    """Shares for MeaMed: each kept value (the ``n - f`` closest to the median) weighs ``1/(n - f)``."""
    n, d = x.shape
    keep = n - f
    counts = torch.zeros(n, dtype=torch.float64, device=x.device)
    chunk = max(1, (1 << 20) // n)
    for s in range(0, d, chunk):
        dist = (x[:, s:s + chunk] - median[s:s + chunk]).abs()
        idx = torch.sort(dist, dim=0, stable=True).indices[:keep]
        counts += torch.bincount(idx.flatten(), minlength=n).to(torch.float64)
    return counts / (keep * d)


def selection_weights(n: int, chosen: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """``1/len(chosen)`` on the chosen row indices, 0 elsewhere."""
    w = torch.zeros(n, dtype=torch.float64, device=device)
    w[chosen.to(w.device)] = 1.0 / chosen.numel()
    return w
