"""Iterative kernels that live in the span of the rows: geometric median and centered clipping.

Both iterate a point ``z = sum_j a_j r_j`` that is an affine (here convex) combination of the input
rows ``r_j`` (plus one extra starting row). Every distance ``||x_i - z||`` then follows from one
float64 Gram matrix of the rows (:func:`~robustagg.functional.gram.robust_gram`: one pass over
``x``, centred on a central row when the rows are near-identical relative to their norm)::

    ||x_i - z||^2 = G_ii - 2 (G a)_i + a^T G a

so each iteration costs ``O(n^2)`` instead of a pass over ``(n, d)``; the output ``a @ x`` is formed
once (one more pass). Geometric median with 8 iterations or centered clipping with 3 thus read
``x`` twice instead of 9 or 4 times.

The readable references :func:`geometric_median_reference` and :func:`centered_clipping_reference`
iterate on the ``(n, d)`` rows directly in float64. Both compute the same iterates in exact
arithmetic; in floating point the coefficients agree to about 1e-12 relatively, so the float32
outputs agree to a few units in the last place (tests: ``atol = 1e-5 max|x|``).
"""

from __future__ import annotations

import math

import torch

from .gram import robust_gram

__all__ = ["geometric_median", "geometric_median_coefficients", "centered_clipping", "scaled_gram",
           "centered_clipping_coefficients", "clipping_iterations", "weiszfeld_coefficients",
           "geometric_median_reference", "centered_clipping_reference"]


def _sq_dist_to_combination(g: torch.Tensor, a: torch.Tensor, rows: int) -> torch.Tensor:
    ga = g @ a
    return (torch.diagonal(g)[:rows] - 2.0 * ga[:rows] + a @ ga).clamp_(min=0.0)


def _combine(x: torch.Tensor, a: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
    n = x.shape[0]
    out = a[:n].to(x.dtype) @ x
    if extra is not None:
        out += a[n:].to(x.dtype) @ extra
    return out


def scaled_gram(x: torch.Tensor, extra: torch.Tensor | None) -> tuple[torch.Tensor, float]:
    """:func:`~robustagg.functional.gram.robust_gram` of ``s * [x; extra]`` and the scale ``s``.

    ``s = 1`` unless a float64 entry overflows (finite float64 rows beyond ~1e154); then ``s`` is the
    power of two that brings the largest magnitude to ~2^400, an exact rescaling, and the iterates
    (convex coefficients, invariant to the scale once distance thresholds are scaled too) stay
    finite instead of turning into NaN. Costs one float64 copy of ``x`` in that case only. No
    assumption on ``n`` or ``f``: it serves the geometric median (Weiszfeld; Pillutla et al., IEEE
    TSP 2022) and centered clipping (Karimireddy et al., ICML 2021), whose thresholds ``nu`` and
    ``tau`` the callers multiply by ``s``.

    Args:
        x: ``(n, d)`` finite rows, any float dtype.
        extra: optional ``(e, d)`` extra rows (a start point or centre), or ``None``.

    Returns:
        ``(G, s)``: ``G`` the ``(n + e, n + e)`` float64 Gram matrix of ``s * [x; extra]`` (relative to
        the centre :func:`robust_gram` picks) and ``s`` a power of two (float).

    Raises:
        NonFiniteInputError: a row holds NaN or inf (from :func:`robust_gram`).
    """
    g = robust_gram(x, extra)
    if bool(torch.isfinite(g).all()):
        return g, 1.0
    top = float(x.abs().max()) if extra is None else max(float(x.abs().max()), float(extra.abs().max()))
    s = math.ldexp(1.0, 400 - math.frexp(top)[1])
    return robust_gram(x.double() * s, None if extra is None else extra.double() * s), s


def weiszfeld_coefficients(g: torch.Tensor, n: int, a0: torch.Tensor, nu: float, max_iter: int,
                           tol: float) -> tuple[torch.Tensor, int]:
    """Smoothed Weiszfeld on a Gram matrix; returns the final coefficients and iterations run.

    Update: ``beta_i = 1 / max(nu, ||z - x_i||)``, ``z <- sum beta_i x_i / sum beta_i``; stops after
    ``max_iter`` updates or when no distance ``||z - x_i||`` changes by more than ``tol`` relative to
    ``max(nu, previous distance)``. (A relative change of the objective ``sum_i ||z - x_i||`` is no
    stopping rule: it is quadratic in the error of ``z``, and one huge row's distance dominates it,
    so it stops far from the median, e.g. at 100 instead of 0.1 next to a 1e20 row.)
    """
    a = a0
    dist = _sq_dist_to_combination(g, a, n).sqrt()
    it = 0
    for it in range(1, max_iter + 1):
        beta = 1.0 / dist.clamp(min=nu)
        a = torch.zeros_like(a)
        a[:n] = beta / beta.sum()
        new_dist = _sq_dist_to_combination(g, a, n).sqrt()
        change = float(((new_dist - dist).abs() / dist.clamp(min=nu)).max())
        dist = new_dist
        if change <= tol:
            break
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
    g, s = scaled_gram(x, extra)
    a0 = torch.full((g.shape[0],), 1.0 / n, dtype=torch.float64, device=x.device)
    if extra is not None:
        a0.zero_()
        a0[n] = 1.0
    a, _ = weiszfeld_coefficients(g, n, a0, nu * s, max_iter, tol)
    return a, extra


def geometric_median(x: torch.Tensor, nu: float = 1e-6, max_iter: int = 100, tol: float = 1e-6,
                     init: str = "mean") -> torch.Tensor:
    """Geometric median ``argmin_z sum_i ||z - x_i||`` by smoothed Weiszfeld.

    Args:
        x: ``(n, d)`` finite rows.
        nu: smoothing floor on distances (> 0).
        max_iter: maximum number of Weiszfeld updates.
        tol: iteration stops when no distance ``||z - x_i||`` changes by more than ``tol`` relative
            to ``max(nu, its previous value)`` (0: only when none changes at all).
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
    g, s = scaled_gram(x, extra)
    return clipping_iterations(g, n, tau * s, iterations), extra


def clipping_iterations(g: torch.Tensor, n: int, tau: float, iterations: int) -> torch.Tensor:
    """Centered-clipping coefficients from the ``(n+1, n+1)`` Gram of ``[x_1..x_n, v0]`` (any centre)."""
    a = torch.zeros(n + 1, dtype=torch.float64, device=g.device)
    a[n] = 1.0
    for _ in range(iterations):
        dist = _sq_dist_to_combination(g, a, n).sqrt()
        clip = torch.where(dist > tau, tau / dist.clamp(min=torch.finfo(torch.float64).tiny), torch.ones_like(dist))
        # v_new = (1 - sum(c)/n) v + sum_i (c_i / n) x_i : a convex combination, coefficients stay >= 0.
        a = a * (1.0 - clip.sum() / n)
        a[:n] += clip / n
    return a


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


def geometric_median_reference(x: torch.Tensor, nu: float = 1e-6, max_iter: int = 100, tol: float = 1e-6,
                               init: str = "mean") -> torch.Tensor:
    """Reference for :func:`geometric_median`: the Weiszfeld loop on the rows, in float64.

    Each iteration computes ``||z - x_i||`` from the ``(n, d)`` differences (one pass per
    iteration), with the same update, start and stopping rule.
    """
    x64 = x.double()
    z = x64.mean(dim=0) if init == "mean" else torch.zeros_like(x64[0])
    dist = torch.linalg.vector_norm(x64 - z, dim=1)
    for _ in range(max_iter):
        beta = 1.0 / dist.clamp(min=nu)
        z = (beta / beta.sum()) @ x64
        new_dist = torch.linalg.vector_norm(x64 - z, dim=1)
        change = float(((new_dist - dist).abs() / dist.clamp(min=nu)).max())
        dist = new_dist
        if change <= tol:
            break
    return z.to(x.dtype)


def centered_clipping_reference(x: torch.Tensor, tau: float, iterations: int, center: torch.Tensor) -> torch.Tensor:
    """Reference for :func:`centered_clipping`: the clipping loop on the rows, in float64."""
    x64 = x.double()
    v = center.to(torch.float64).reshape(-1).clone()
    for _ in range(iterations):
        u = x64 - v
        norm = torch.linalg.vector_norm(u, dim=1)
        clip = torch.where(norm > tau, tau / norm.clamp(min=torch.finfo(torch.float64).tiny), torch.ones_like(norm))
        v = v + (clip[:, None] * u).mean(dim=0)
    return v.to(x.dtype)
