"""Trust-weighted rules: FLTrust (a trusted server update) and FoolsGold (per-worker history).

Both weigh each row by a score computed from cosine similarities (one uncentred float64 Gram
matrix, :mod:`~robustagg.functional.cosine`: for FLTrust of the rows and ``g0``, for FoolsGold of
the histories) and return ``sum_i a_i x_i`` for float64 ``a``. FLTrust needs only the norms and
the products with ``g0``, an ``O(nd)`` computation, but the compiled Gram kernel of the ``n + 1``
rows is faster at ``n = 20`` than a chunked float64 pass through torch (measured at ``d = 10^7``:
0.3 s against 13 s on a loaded 2-core machine).
"""

from __future__ import annotations

import torch

from .cosine import combine, cosine_from_gram, norms_from_gram, unit_gram
from .gram import gram

__all__ = ["fltrust_coefficients", "fltrust", "foolsgold_alpha", "foolsgold_coefficients", "foolsgold",
           "history_gram"]


def fltrust_coefficients(x: torch.Tensor, trusted: torch.Tensor) -> torch.Tensor:
    """FLTrust's coefficients (Cao, Fang, Liu, Gong, NDSS 2021, Eq. 4-6 and Alg. 2).

    Trust score ``TS_i = ReLU(cos(x_i, g0))``; every row is rescaled to the trusted update's norm,
    ``x_i ||g0|| / ||x_i||``; the output is ``sum_i TS_i x_i ||g0||/||x_i|| / sum_i TS_i``, so
    ``a_i = TS_i ||g0|| / (||x_i|| sum_j TS_j)``. Every ``TS_i = 0`` (or ``g0 = 0``): all 0.

    Args:
        x: ``(n, d)`` finite rows (the clients' updates).
        trusted: ``(d,)`` the server's update on its root data set ``g0``.

    Returns:
        ``(n,)`` float64 coefficients.
    """
    n = x.shape[0]
    g, s = unit_gram(x, trusted.reshape(1, -1).to(x.dtype))  # raises NonFiniteInputError on NaN/inf rows
    norms = norms_from_gram(g, s)
    ts = cosine_from_gram(g)[:n, n].clamp(min=0.0)
    total = float(ts.sum())
    a = torch.zeros(n, dtype=torch.float64, device=g.device)
    if not total > 0:
        return a
    pos = ts > 0
    a[pos] = ts[pos] * (norms[n] / norms[:n][pos]) / total
    return a


def fltrust(x: torch.Tensor, trusted: torch.Tensor) -> torch.Tensor:
    """FLTrust aggregate; see :func:`fltrust_coefficients`. Norm at most ``||g0||``."""
    return combine(x, fltrust_coefficients(x, trusted))


def foolsgold_alpha(g: torch.Tensor, kappa: float = 1.0) -> torch.Tensor:
    """FoolsGold's learning rates from the Gram matrix of the histories (Fung, Yoon, Beschastnikh, RAID 2020, Alg. 1).

    As the authors' code (``foolsgold.py``: ``cs = cosine_similarity(H) - I``): ``cs_ij = cos(H_i, H_j)``
    for ``i != j`` and ``cs_ii = 0``; ``v_i = max_j cs_ij``, the diagonal included, so ``v_i >= 0``;
    pardoning: ``cs_ij *= v_i / v_j`` where ``v_j > v_i``; ``alpha_i = 1 - max_j cs_ij`` (diagonal
    included) clipped to [0, 1]; ``alpha /= max alpha``; ``alpha = 1`` becomes 0.99;
    ``alpha_i = kappa (ln(alpha_i / (1 - alpha_i)) + 0.5)`` clipped to [0, 1]. A history with no
    positive cosine has ``v_i = 0``: pardoning scales its cosines by 0 and it keeps weight 1 (the
    least sybil-like worker). Every ``alpha = 0`` before the rescaling (each history has a perfect
    twin): all 0 (the authors' code divides 0 by 0).

    Args:
        g: ``(n, n)`` float64 Gram matrix of the histories.
        kappa: confidence of the logit (> 0).

    Returns:
        ``(n,)`` float64 in [0, 1].
    """
    cs = cosine_from_gram(g).fill_diagonal_(0.0)
    v = cs.max(dim=1).values
    pardon = v[None, :] > v[:, None]  # (i, j): v_j > v_i >= 0, so v_j > 0
    cs = torch.where(pardon, cs * (v[:, None] / torch.where(pardon, v[None, :], torch.ones_like(cs))), cs)
    alpha = (1.0 - cs.max(dim=1).values).clamp(0.0, 1.0)
    top = float(alpha.max())
    if not top > 0:
        return torch.zeros_like(alpha)
    alpha = alpha / top
    alpha = torch.where(alpha == 1.0, torch.full_like(alpha, 0.99), alpha)
    with torch.no_grad():
        logit = kappa * (torch.log(alpha / (1.0 - alpha)) + 0.5)  # alpha = 0 gives -inf, clipped to 0
    return torch.nan_to_num(logit, nan=0.0, posinf=1.0, neginf=0.0).clamp(0.0, 1.0)


def history_gram(x: torch.Tensor, history: torch.Tensor | None) -> torch.Tensor:
    """Float64 Gram matrix of ``history + x`` without forming the sum (``None``: of ``x``).

    From the Gram of ``[x; history]``: ``G = G_xx + G_xh + G_hx + G_hh`` (one pass over each).
    """
    if history is None:
        return unit_gram(x)[0]
    n = x.shape[0]
    big = gram(x, None, history.to(device=x.device, dtype=x.dtype))
    return big[:n, :n] + big[:n, n:] + big[n:, :n] + big[n:, n:]


def foolsgold_coefficients(x: torch.Tensor, history: torch.Tensor | None, kappa: float = 1.0) -> torch.Tensor:
    """FoolsGold's coefficients: ``alpha / sum(alpha)`` for the histories ``history + x`` (all 0 if every alpha is 0).

    Args:
        x: ``(n, d)`` this step's rows; history: ``(n, d)`` sum of the earlier rows of the same
            workers (row ``i`` = worker ``i``), or ``None`` at the first step.
    """
    alpha = foolsgold_alpha(history_gram(x, history), kappa)
    total = float(alpha.sum())
    return alpha / total if total > 0 else alpha


def foolsgold(x: torch.Tensor, history: torch.Tensor | None, kappa: float = 1.0) -> torch.Tensor:
    """FoolsGold aggregate ``sum_i alpha_i x_i / sum_i alpha_i``; see :func:`foolsgold_alpha` (history not updated)."""
    return combine(x, foolsgold_coefficients(x, history, kappa))
