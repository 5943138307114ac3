"""Iterative kernels that live in the span of the rows: geometric median and centered clipping.

Both iterate a point ``z = sum_j a_j r_j`` that is an affine (here convex) combination of the input
rows ``r_j`` (plus one extra starting row). Every distance ``||x_i - z||`` then follows from one
float64 Gram matrix of the rows centred on a robust row::

    ||x_i - z||^2 = G_ii - 2 (G a)_i + a^T G a

so each iteration costs ``O(n^2)`` instead of a pass over ``(n, d)``; the output is formed once.
"""

from __future__ import annotations

import torch

from .distance import centered_gram, robust_center_row

__all__ = ["geometric_median", "geometric_median_coefficients", "centered_clipping",
           "centered_clipping_coefficients", "weiszfeld_coefficients"]


def _sq_dist_to_combination(g: torch.Tensor, a: torch.Tensor, rows: int) -> torch.Tensor:
    ga = g @ a
    return (torch.diagonal(g)[:rows] - 2.0 * ga[:rows] + a @ ga).clamp_(min=0.0)


def _combine(x: torch.Tensor, a: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
    n = x.shape[0]
    out = a[:n].to(x.dtype) @ x
    if extra is not None:
        out += a[n:].to(x.dtype) @ extra
    return out


def weiszfeld_coefficients(g: torch.Tensor, n: int, a0: torch.Tensor, nu: float, max_iter: int,
                           tol: float) -> tuple[torch.Tensor, int]:
    """Smoothed Weiszfeld on a Gram matrix; returns the final coefficients and iterations run.

    Update: ``beta_i = 1 / max(nu, ||z - x_i||)``, ``z <- sum beta_i x_i / sum beta_i``; stops after
    ``max_iter`` updates or when the objective ``sum_i ||z - x_i||`` changes by less than ``tol``
    relative to its previous value.
    """
    a = a0
    obj = _sq_dist_to_combination(g, a, n).sqrt().sum()
    it = 0
    for it in range(1, max_iter + 1):
        dist = _sq_dist_to_combination(g, a, n).sqrt()
        beta = 1.0 / dist.clamp(min=nu)
        a = torch.zeros_like(a)
        a[:n] = beta / beta.sum()
        new_obj = _sq_dist_to_combination(g, a, n).sqrt().sum()
        if abs(float(obj - new_obj)) <= tol * float(obj):
            break
        obj = new_obj
    return a, it


def geometric_median_coefficients(x: torch.Tensor, nu: float = 1e-6, max_iter: int = 100, tol: float = 1e-6,
                                  init: str = "mean") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Convex coefficients ``a`` with ``GM(x) = sum_j a_j r_j`` over the rows of ``x`` (then the start row).

    Returns:
        ``(a, extra)``: ``a`` float64 of length ``n`` (init "mean") or ``n + 1`` (init "zero", the
        last entry weighs the zero start row ``extra``).
    """
    n, d = x.shape
    extra = None if init == "mean" else torch.zeros(1, d, dtype=x.dtype, device=x.device)
    g = centered_gram(x, x[robust_center_row(x)], extra)
    a0 = torch.full((g.shape[0],), 1.0 / n, dtype=torch.float64, device=x.device)
    if extra is not None:
        a0.zero_()
        a0[n] = 1.0
    a, _ = weiszfeld_coefficients(g, n, a0, nu, max_iter, tol)
    return a, extra


def geometric_median(x: torch.Tensor, nu: float = 1e-6, max_iter: int = 100, tol: float = 1e-6,
                     init: str = "mean") -> torch.Tensor:
    """Geometric median ``argmin_z sum_i ||z - x_i||`` by smoothed Weiszfeld.

    Args:
        x: ``(n, d)`` finite rows.
        nu: smoothing floor on distances (> 0).
        max_iter: maximum number of Weiszfeld updates.
        tol: relative objective change below which iteration stops (0 runs all ``max_iter``).
        init: ``"mean"`` or ``"zero"``: the starting point.

    Returns:
        ``(d,)`` tensor, dtype and device of ``x``.
    """
    a, extra = geometric_median_coefficients(x, nu, max_iter, tol, init)
    return _combine(x, a, extra)


def centered_clipping_coefficients(x: torch.Tensor, tau: float, iterations: int,
                                   center: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Convex coefficients of centered clipping's output over ``[x_1..x_n, center]``: ``((n+1,), extra)``."""
    n, d = x.shape
    extra = center.to(dtype=x.dtype, device=x.device).reshape(1, d)
    g = centered_gram(x, x[robust_center_row(x)], extra)
    a = torch.zeros(n + 1, dtype=torch.float64, device=x.device)
    a[n] = 1.0
    for _ in range(iterations):
        dist = _sq_dist_to_combination(g, a, n).sqrt()
        clip = torch.where(dist > tau, tau / dist.clamp(min=torch.finfo(torch.float64).tiny), torch.ones_like(dist))
        # v_new = (1 - sum(c)/n) v + sum_i (c_i / n) x_i : a convex combination, coefficients stay >= 0.
        a = a * (1.0 - clip.sum() / n)
        a[:n] += clip / n
    return a, extra


def centered_clipping(x: torch.Tensor, tau: float, iterations: int, center: torch.Tensor) -> torch.Tensor:
    """Centered clipping (Karimireddy, He, Jaggi, ICML 2021).

    ``v <- v + (1/n) sum_i clip_tau(x_i - v)`` repeated ``iterations`` times from ``v = center``,
    with ``clip_tau(u) = u * min(1, tau / ||u||)`` (a zero ``u`` stays zero).

    Args:
        x: ``(n, d)`` finite rows.
        tau: clipping radius (> 0), in the units of the gradients.
        iterations: L >= 1.
        center: ``(d,)`` starting point (the previous aggregate; zero at the first call).
    """
    a, extra = centered_clipping_coefficients(x, tau, iterations, center)
    return _combine(x, a, extra)
