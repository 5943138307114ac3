"""Integrity and suppression metrics of one aggregation step (see the design note metrics.md).

The simulator knows which rows are honest, so every quantity is exact for the step's tensors.
Notation: ``H`` honest rows, ``mu_H`` their mean, ``V(H) = (1/|H|) sum_{i in H} ||x_i - mu_H||^2``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ._tensor import as_matrix
from .errors import ShapeError

__all__ = ["step_metrics", "kappa_hat", "honest_variance"]


def honest_variance(honest: torch.Tensor) -> float:
    """``V(H) = (1/|H|) sum_i ||x_i - mean(H)||^2`` of ``honest`` ``(h, d)``, computed in float64."""
    h64 = honest.double()
    return _variance(h64, h64.mean(dim=0))


def _variance(h64: torch.Tensor, mu: torch.Tensor) -> float:
    """:func:`honest_variance` given the float64 rows and their mean ``mu`` (computed once by the caller)."""
    return float(((h64 - mu) ** 2).sum(dim=1).mean())


def kappa_hat(aggregate: torch.Tensor, honest: torch.Tensor) -> float:
    """Empirical robustness coefficient ``||F(X) - mu_H||^2 / V(H)`` (Allouah et al., AISTATS 2023).

    Returns 0 when the aggregate equals ``mu_H`` exactly and ``inf`` when ``V(H) = 0`` but it does not.
    """
    h64 = honest.double()
    return _kappa(aggregate.double(), h64, h64.mean(dim=0))


def _kappa(agg: torch.Tensor, h64: torch.Tensor, mu: torch.Tensor) -> float:
    """:func:`kappa_hat` given the float64 aggregate, rows and honest mean."""
    err = float(((agg - mu) ** 2).sum())
    if err == 0.0:
        return 0.0
    var = _variance(h64, mu)
    return err / var if var > 0 else math.inf


def _compiled(x: torch.Tensor, aggregate: torch.Tensor) -> bool:
    """Whether :func:`step_metrics` takes the compiled CPU kernel (float32/float64 CPU tensors, d > 0)."""
    return (x.device.type == "cpu" and aggregate.device.type == "cpu" and x.shape[1] > 0
            and x.dtype in (torch.float32, torch.float64) and aggregate.dtype in (torch.float32, torch.float64))


def _moments_compiled(x: torch.Tensor, mask: torch.Tensor, aggregate: torch.Tensor) -> tuple[float, ...]:
    """``(kappa_hat, ||mu_H||, ||F||, ||F - mu_H||, <F, mu_H>)`` from one pass of the compiled kernel
    (:mod:`~robustagg.functional._moments_kernel`): the float64 values :func:`step_metrics` computes
    with torch elsewhere, to float64 rounding."""
    import numpy as np

    from .functional._moments_kernel import moments  # compiled on first use (Numba)

    honest = mask.nonzero().flatten().numpy().astype(np.int64)
    row_dev = np.empty(honest.shape[0], dtype=np.float64)
    err, m2, f2, fm = (float(v) for v in moments(np.ascontiguousarray(x.detach().numpy()), honest,
                              np.ascontiguousarray(aggregate.detach().numpy()), row_dev))
    var = float(row_dev.mean())
    kappa = 0.0 if err == 0.0 else (err / var if var > 0 else math.inf)
    return kappa, math.sqrt(m2), math.sqrt(f2), math.sqrt(err), fm


def step_metrics(aggregate: torch.Tensor, x: torch.Tensor, honest_mask: torch.Tensor,
                 weights: Optional[torch.Tensor] = None) -> dict[str, float]:
    """Per-step metrics of an aggregate against the honest mean.

    Args:
        aggregate: ``(d,)`` the rule's output F(X).
        x: ``(n, d)`` every submission of the step (honest and Byzantine).
        honest_mask: ``(n,)`` bool, True for honest rows (at least one).
        weights: optional ``(n,)`` share of every row in the aggregate (``rule.weights(x)``).

    Returns:
        ``agg/kappa_hat``, ``agg/dev_norm`` (``||F - mu_H|| / ||mu_H||``), ``agg/cosine`` (of F and
        mu_H), ``agg/retained`` (``<F, mu_H> / ||mu_H||^2``) and, with ``weights``,
        ``agg/byz_accepted`` (Byzantine share of the total weight) and ``agg/honest_weight/<i>`` for
        every honest row index i. Ratios with a zero denominator are ``nan``.

    Raises:
        ShapeError: mismatched shapes or no honest row.

    Float32/float64 CPU tensors take one pass of a compiled kernel
    (:mod:`~robustagg.functional._moments_kernel`); other devices and dtypes take torch's float64
    reductions. The two agree to float64 rounding (tested) wherever the squared norms stay inside
    float64's range (about 1e-154 < |value| < 1e154); beyond it the compiled path gives ``inf`` or
    ``nan`` where the torch path's float arithmetic raises.
    """
    x = as_matrix(x)
    mask = torch.as_tensor(honest_mask, dtype=torch.bool).cpu()
    if mask.shape != (x.shape[0],) or not bool(mask.any()):
        raise ShapeError(f"honest_mask must be a (n,)={x.shape[0]} bool tensor with at least one True; "
                         f"got shape {tuple(mask.shape)}.")
    if aggregate.shape != (x.shape[1],):
        raise ShapeError(f"aggregate must have shape ({x.shape[1]},); got {tuple(aggregate.shape)}.")
    if _compiled(x, aggregate):
        kappa, mu_norm, agg_norm, dev, dot = _moments_compiled(x, mask, aggregate)
    else:  # the honest rows, their mean and the aggregate in float64 once (kappa_hat and the norms share them)
        h64 = x[mask.to(x.device)].double()
        mu = h64.mean(dim=0)
        agg = aggregate.double()
        mu_norm = float(mu.norm())
        agg_norm = float(agg.norm())
        dev = float((agg - mu).norm())
        dot = float(agg @ mu)
        kappa = _kappa(agg, h64, mu)
    out = {
        "agg/kappa_hat": kappa,
        "agg/dev_norm": dev / mu_norm if mu_norm > 0 else math.nan,
        "agg/cosine": dot / (agg_norm * mu_norm) if agg_norm > 0 and mu_norm > 0 else math.nan,
        "agg/retained": dot / mu_norm**2 if mu_norm > 0 else math.nan,
    }
    if weights is not None:
        w = weights.double().cpu()
        total = float(w.sum())
        out["agg/byz_accepted"] = float(w[~mask].sum()) / total if total > 0 else math.nan
        shares = w.tolist()  # one conversion, not one per honest row
        for i in mask.nonzero().flatten().tolist():
            out[f"agg/honest_weight/{i}"] = shares[i]
    return out
