"""Pre-aggregation kernels that need no distances: bucketing, static clipping, ARC.

Each reads ``x`` about twice (row norms, then the scaled or summed rows) and writes its ``(m, d)``
output once, into memory backed by huge pages (``empty_rows`` in ``robustagg.functional._alloc``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ._alloc import empty_rows

__all__ = ["bucketing", "clipping", "clipping_factors", "clipping_factors_from_norms", "arc", "arc_factors",
           "arc_factors_from_norms", "row_norms"]


def row_norms(x: torch.Tensor) -> torch.Tensor:
    """Euclidean norm of every row, computed in float64 (no overflow for float32 inputs): ``(n,)``.

    Float32/16 rows are converted to float64 by column chunks of at most 4 MiB and an eighth of the
    input (a whole-tensor conversion would need twice the input's memory).
    """
    if x.dtype == torch.float64:
        return torch.linalg.vector_norm(x, dim=1)
    n, d = x.shape
    budget = min(1 << 22, max(1 << 18, x.numel() * x.element_size() // 8))  # bytes; small for small inputs
    k = max(1, min(d, budget // (8 * max(n, 1))))
    buf = torch.empty(n, k, dtype=torch.float64, device=x.device)
    sq = torch.zeros(n, dtype=torch.float64, device=x.device)
    for start in range(0, d, k):
        block = buf[:, :min(k, d - start)]
        block.copy_(x[:, start:start + k])
        if x.device.type == "cpu":
            b = block.numpy()
            sq += torch.from_numpy(np.einsum("ij,ij->i", b, b))
        else:
            sq += torch.linalg.vecdot(block, block, dim=1)
    return sq.sqrt_()


def bucketing(x: torch.Tensor, s: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Bucketing (Karimireddy, He, Jaggi, ICLR 2022): ``(n, d) -> (ceil(n/s), d)`` bucket means.

    Rows are permuted by ``torch.randperm(n, generator=generator)`` (CPU generator), split into
    buckets of ``s`` consecutive rows (the last may be smaller) and each bucket is averaged.
    """
    n = x.shape[0]
    perm = torch.randperm(n, generator=generator).to(x.device)
    if x.dtype not in (torch.float32, torch.float64):  # torch.mean sums half types in float32
        return torch.stack([x[perm[i:i + s]].mean(dim=0) for i in range(0, n, s)])
    out = empty_rows((math.ceil(n / s), x.shape[1]), x)
    for b, start in enumerate(range(0, n, s)):
        rows = perm[start:start + s].tolist()
        if len(rows) == 1:
            out[b].copy_(x[rows[0]])
            continue
        torch.add(x[rows[0]], x[rows[1]], out=out[b])  # the bucket's sum without a gathered copy
        for r in rows[2:]:
            out[b].add_(x[r])
        out[b].div_(len(rows))
    return out


def _scale_rows(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return torch.mul(x, factor.to(x.dtype)[:, None], out=empty_rows(x.shape, x))


def clipping_factors(x: torch.Tensor, tau: float) -> torch.Tensor:
    """Per-row factors ``min(1, tau / ||x_i||)`` of static clipping, float64 ``(n,)``."""
    return clipping_factors_from_norms(row_norms(x), tau)


def clipping_factors_from_norms(norms: torch.Tensor, tau: float) -> torch.Tensor:
    """Static clipping factors from float64 row norms ``(n,)``."""
    return torch.where(norms > tau, tau / norms.clamp(min=torch.finfo(torch.float64).tiny), torch.ones_like(norms))


def clipping(x: torch.Tensor, tau: float) -> torch.Tensor:
    """Static clipping: ``x_i * min(1, tau / ||x_i||)`` (zero rows stay zero). ``(n, d) -> (n, d)``."""
    return _scale_rows(x, clipping_factors(x, tau))


def arc_factors(x: torch.Tensor, f: int) -> torch.Tensor:
    """Per-row scale factors of ARC, float64 ``(n,)`` (1 for rows left unchanged)."""
    return arc_factors_from_norms(row_norms(x), f)


def arc_factors_from_norms(norms: torch.Tensor, f: int) -> torch.Tensor:
    """ARC scale factors from float64 row norms ``(n,)``."""
    n = norms.shape[0]
    k = min(math.floor(2 * f * (n - f) / n), n - 1) if n else 0
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
