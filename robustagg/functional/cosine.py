"""Cosine similarities and norm clipping from one float64 Gram matrix, shared by the similarity rules.

SignGuard, ClippedClustering, FLAME, FLTrust and FoolsGold judge rows by their direction (cosine
similarity) and rescale them by their norm. Every cosine and norm follows from the *uncentred*
Gram matrix ``G = X X^T`` (:func:`~robustagg.functional.gram.gram`, one pass over ``x``, float64,
so float32 products are exact)::

    ||x_i|| = sqrt(G_ii),    cos(x_i, x_j) = G_ij / sqrt(G_ii G_jj)

and the output of every such rule is ``sum_i a_i x_i`` for float64 coefficients ``a``, formed once
(:func:`combine`). No ``(n, n, d)`` or ``(n, d)`` temporary is made.

Zero rows have no direction: their cosine with every row (themselves included) is 0.
"""

from __future__ import annotations

import math

import torch

from .._tensor import check_finite
from .gram import gram

__all__ = ["unit_gram", "norms_from_gram", "cosine_from_gram", "cosine_distance_from_gram", "median",
           "clip_factors", "combine"]


def unit_gram(x: torch.Tensor, extra: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """Uncentred float64 Gram matrix of ``s * [x; extra]`` and the power of two ``s``.

    ``s = 1`` unless a float64 entry overflows (finite float64 rows beyond ~1e154): then ``s`` brings
    the largest magnitude to ~2^400, an exact rescaling. Cosines and norm *ratios* do not depend
    on ``s``; norms are ``sqrt(G_ii) / s``.

    Args:
        x: ``(n, d)`` finite rows, any float dtype and device.
        extra: optional ``(e, d)`` rows appended after ``x`` (e.g. a trusted server update).

    Returns:
        ``((n + e, n + e) float64 on x.device, s)``.

    Raises:
        NonFiniteInputError: a row holds NaN or inf (seen on the Gram diagonal).
    """
    g = gram(x, None, extra)
    if bool(torch.isfinite(g).all()):
        return g, 1.0
    check_finite(x)
    if extra is not None:
        check_finite(extra, "extra")
    top = float(x.abs().max()) if extra is None else max(float(x.abs().max()), float(extra.abs().max()))
    s = math.ldexp(1.0, 400 - math.frexp(top)[1])
    return gram(x.double() * s, None, None if extra is None else extra.double() * s), s


def norms_from_gram(g: torch.Tensor, s: float = 1.0) -> torch.Tensor:
    """Row norms ``sqrt(G_ii) / s``: ``(m,)`` float64."""
    return torch.diagonal(g).clamp(min=0.0).sqrt() / s


def cosine_from_gram(g: torch.Tensor) -> torch.Tensor:
    """``(m, m)`` float64 cosines ``G_ij / sqrt(G_ii G_jj)``, clamped to [-1, 1]; 0 where a row is zero.

    The diagonal is 1 for non-zero rows (an exact duplicate of a row has cosine exactly 1).
    """
    sq = torch.diagonal(g).clamp(min=0.0)
    denom = (sq[:, None] * sq[None, :]).sqrt()
    cos = torch.where(denom > 0, g / denom.clamp(min=torch.finfo(torch.float64).tiny), torch.zeros_like(g))
    return cos.clamp_(-1.0, 1.0)


def cosine_distance_from_gram(g: torch.Tensor) -> torch.Tensor:
    """``(m, m)`` float64 cosine distances ``1 - cos`` in [0, 2] with an exactly zero diagonal (symmetric)."""
    dist = 1.0 - cosine_from_gram(g)
    dist = (dist + dist.T) * 0.5
    dist.fill_diagonal_(0.0)
    return dist.clamp_(min=0.0)


def median(v: torch.Tensor, *, lower: bool = False) -> float:
    """Median of a 1-D float64 tensor.

    Even length: the mean of the two middle values, as ``numpy.median``, or with ``lower=True`` the
    lower of the two, as ``torch.median``.
    """
    s = torch.sort(v).values
    m = s.numel()
    if m % 2 or lower:
        return float(s[(m - 1) // 2])
    return float((s[m // 2 - 1] + s[m // 2]) / 2)


def clip_factors(norms: torch.Tensor, tau: float) -> torch.Tensor:
    """``min(1, tau / ||x_i||)`` per row (1 for zero rows): ``(n,)`` float64."""
    return torch.where(norms > tau, tau / norms.clamp(min=torch.finfo(torch.float64).tiny), torch.ones_like(norms))


def combine(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``sum_i a_i x_i`` as a new ``(d,)`` tensor of ``x``'s dtype (one pass over ``x``)."""
    return a.to(device=x.device, dtype=x.dtype) @ x
