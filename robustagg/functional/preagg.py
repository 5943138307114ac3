"""Pre-aggregation kernels that need no distances: bucketing, static clipping, ARC."""

from __future__ import annotations

import math

import torch

__all__ = ["bucketing", "clipping", "clipping_factors", "arc", "arc_factors", "row_norms"]


def row_norms(x: torch.Tensor) -> torch.Tensor:
    """Euclidean norm of every row, computed in float64 (no overflow for float32 inputs): ``(n,)``."""
    return torch.linalg.vector_norm(x, dim=1, dtype=torch.float64)


def bucketing(x: torch.Tensor, s: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Bucketing (Karimireddy, He, Jaggi, ICLR 2022): ``(n, d) -> (ceil(n/s), d)`` bucket means.

    Rows are permuted by ``torch.randperm(n, generator=generator)`` (CPU generator), split into
    buckets of ``s`` consecutive rows (the last may be smaller) and each bucket is averaged.
    """
    n = x.shape[0]
    perm = torch.randperm(n, generator=generator).to(x.device)
    return torch.stack([x[perm[i:i + s]].mean(dim=0) for i in range(0, n, s)])


def _scale_rows(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return x * factor.to(x.dtype)[:, None]


def clipping_factors(x: torch.Tensor, tau: float) -> torch.Tensor:
    """Per-row factors ``min(1, tau / ||x_i||)`` of static clipping, float64 ``(n,)``."""
    norms = row_norms(x)
    return torch.where(norms > tau, tau / norms.clamp(min=torch.finfo(torch.float64).tiny), torch.ones_like(norms))


def clipping(x: torch.Tensor, tau: float) -> torch.Tensor:
    """Static clipping: ``x_i * min(1, tau / ||x_i||)`` (zero rows stay zero). ``(n, d) -> (n, d)``."""
    return _scale_rows(x, clipping_factors(x, tau))


def arc_factors(x: torch.Tensor, f: int) -> torch.Tensor:
    """Per-row scale factors of ARC, float64 ``(n,)`` (1 for rows left unchanged)."""
    n = x.shape[0]
    k = min(math.floor(2 * f * (n - f) / n), n - 1) if n else 0
    norms = row_norms(x)
    factor = torch.ones_like(norms)
    if k <= 0:
        return factor
    order = torch.sort(norms, descending=True, stable=True).indices
    threshold = norms[order[k]]
    big = order[:k]
    factor[big] = torch.where(norms[big] > threshold, threshold / norms[big], torch.ones_like(norms[big]))
    return factor


def arc(x: torch.Tensor, f: int) -> torch.Tensor:
    """Adaptive Robust Clipping (Allouah et al., 2024): ``(n, d) -> (n, d)``.

    With ``k = floor(2 (f/n) (n - f))``, the ``k`` rows of largest norm are scaled down to the norm
    of the ``(k+1)``-th largest; the other rows are unchanged.
    """
    return _scale_rows(x, arc_factors(x, f))
