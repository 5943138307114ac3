"""Rules that rank the rows by one number and average the best ``n - f``: CGE and MoNNA.

CGE ranks by the row norm (origin-centred; :func:`~robustagg.functional.preagg.row_norms`, float64
by column chunks), MoNNA by the distance to one trusted row (one row of
:func:`~robustagg.functional.distance.pairwise_sq_distances`, from the float64 Gram pass: about 2x
the mean's time at n = 20, against 8x for per-coordinate float64 differences). Neither forms an
``(n, d)`` float64 copy or an ``(n, n, d)`` temporary; the output is
:func:`~robustagg.functional.distance.mean_of_rows` (one more read of ``x``).
"""

from __future__ import annotations

import torch

from .distance import mean_of_rows, pairwise_sq_distances
from .preagg import row_norms

__all__ = ["cge_select", "cge", "monna_select", "monna"]


def cge_select(x: torch.Tensor, f: int) -> torch.Tensor:
    """Indices of the ``n - f`` rows of smallest Euclidean norm (lowest index first on equal norms).

    Args:
        x: ``(n, d)`` finite floating rows; ``0 <= f < n``.
        f: number of largest-norm rows dropped.

    Returns:
        ``(n - f,)`` long tensor of row indices, in increasing norm, on ``x.device``.
    """
    norms = row_norms(x)  # float64, chunked for float32/16 inputs
    return torch.sort(norms, stable=True).indices[:x.shape[0] - f]


def cge(x: torch.Tensor, f: int) -> torch.Tensor:
    """Comparative Gradient Elimination (Gupta & Vaidya, PODC 2020): mean of the ``n - f`` smallest-norm rows.

    Shape ``(n, d) -> (d,)``, dtype and device of ``x``; requires ``0 <= f < n`` (the class checks
    ``n >= 2f + 1``). The paper's update sums the kept rows; this is their mean (see
    ``docs/conventions.md``).
    """
    return mean_of_rows(x, cge_select(x, f))


def monna_select(x: torch.Tensor, f: int, trusted: int) -> torch.Tensor:
    """Indices of the ``n - f`` rows nearest to row ``trusted``, the trusted row itself first.

    Squared distances ``||x_i - x_t||^2`` come from :func:`pairwise_sq_distances` (float64 Gram
    matrix, centred when the rows are near-identical; exactly zero for a bitwise copy of the
    trusted row). The trusted row is always kept; the other ``n - f - 1`` are the nearest among the
    rest, lowest index first on equal distances.

    Args:
        x: ``(n, d)`` finite floating rows; ``0 <= f < n``.
        f: declared Byzantine bound.
        trusted: index of the trusted row, ``0 <= trusted < n``.

    Returns:
        ``(n - f,)`` long tensor of row indices on ``x.device``.
    """
    n = x.shape[0]
    dist = pairwise_sq_distances(x)[trusted].clone()
    dist[trusted] = -1.0  # the trusted row first, whatever its ties
    return torch.sort(dist, stable=True).indices[:n - f]


def monna(x: torch.Tensor, f: int, trusted: int = 0) -> torch.Tensor:
    """MoNNA's aggregation (Farhadkhani et al., ICML 2023): mean of the ``n - f`` rows nearest to the trusted row.

    Shape ``(n, d) -> (d,)``; the trusted row counts among the ``n - f`` (see :func:`monna_select`).
    """
    return mean_of_rows(x, monna_select(x, f, trusted))
