"""Covariance-based rules computed in the ``(n, n)`` Gram space: SMEA, CAF, DnC.

Every quantity these rules need from the ``d x d`` covariance of (a weighted subset of) the rows is
a function of the rows' float64 Gram matrix ``G`` (:func:`~robustagg.functional.gram.robust_gram`),
so no ``(d, d)`` matrix and no ``(n, n, d)`` temporary is ever formed:

- rows centred on a weighted mean ``mu = sum_j w_j x_j`` (``sum w = 1``) have the Gram matrix
  ``K = P G P^T`` with ``P = I - 1 w^T``; it does not depend on the centre of ``G``;
- the weighted covariance ``Sigma = sum_i w_i (x_i - mu)(x_i - mu)^T`` has the same non-zero
  eigenvalues as ``M = W^{1/2} K W^{1/2}`` (``W = diag(w)``); for an eigenpair ``(lam, u)`` of ``M``
  the unit eigenvector of ``Sigma`` is ``v = Y^T W^{1/2} u / sqrt(lam)`` (``Y``: the centred rows), and
  the squared projections are ``<x_i - mu, v>^2 = (K W^{1/2} u)_i^2 / lam``.

The top eigenpair of the ``(n, n)`` matrix is computed exactly (``torch.linalg.eigh`` in float64),
which is what a power iteration on ``Sigma`` converges to; there is no iteration count or
stopping tolerance to choose. When the top eigenvalue is repeated, any unit vector of its
eigenspace is a top eigenvector: CAF and DnC then use the one ``eigh`` returns (SMEA only needs the
eigenvalue).
"""

from __future__ import annotations

import math

import torch

from .distance import mean_of_rows
from .gram import gram, robust_gram

__all__ = ["top_eigenpair", "smea_select", "smea", "caf_weights", "caf", "dnc_coordinates", "dnc_scores",
           "dnc_select", "dnc", "rank_with_ties"]

#: DnC scores closer than this fraction of the largest score are ties (lowest index first).
DNC_TIE_RTOL = 1e-9
#: CAF weights (which start at 1) at or below this are set to 0: a row tied with the largest tau is
#: zeroed even when rounding leaves it ``1 - tau_i / tau_max = 1e-16``.
CAF_ZERO = 1e-9
#: Subsets per batched eigenvalue call of SMEA.
SMEA_BATCH = 256


def top_eigenpair(m: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Largest eigenvalue and a unit eigenvector of a symmetric float64 ``(n, n)`` matrix.

    Returns:
        ``(lam, u)``: ``lam`` clamped at 0 (a covariance has no negative eigenvalue; rounding can
        give ``-1e-17``), ``u`` an ``(n,)`` float64 unit vector.
    """
    vals, vecs = torch.linalg.eigh((m + m.T) * 0.5)
    return max(float(vals[-1]), 0.0), vecs[:, -1]


def _centred(g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``P G P^T`` with ``P = I - 1 w^T``: the Gram matrix of the rows minus ``sum_j w_j x_j``."""
    gw = g @ w
    return g - gw[:, None] - gw[None, :] + (w @ gw)


# --- SMEA ------------------------------------------------------------------------------------------------
def _kept(left: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept rows (increasing, ``(c, n - f)``) and their 0/1 float64 indicator ``(c, n)`` for left-out sets ``(c, f)``."""
    mask = torch.ones(left.shape[0], n, dtype=torch.bool)
    mask.scatter_(1, left, False)
    return mask.nonzero()[:, 1].view(left.shape[0], -1), mask.to(torch.float64)


def _smea_lower_bounds(g: torch.Tensor, ind: torch.Tensor, k: int) -> torch.Tensor:
    """Lower bounds on ``lambda_max(Sigma_S)`` for the subsets with indicators ``ind`` ``(c, n)``.

    With ``K = H G_SS H`` (``Sigma_S = K / k``): ``lambda_max >= tr(K) / (k (k - 1))`` (at most
    ``k - 1`` non-zero eigenvalues) and ``lambda_max >= max_{i in S} K_ii / k`` (``Sigma_S`` dominates
    each ``(x_i - mu_S)(x_i - mu_S)^T / k``). Both from ``ind @ G`` in ``O(c n^2)``, no gather.
    """
    diag = torch.diagonal(g)
    wg = ind @ g
    block = (wg * ind).sum(dim=1)  # 1_S^T G 1_S
    trace = ind @ diag - block / k
    kii = diag - 2.0 * wg / k + (block / (k * k))[:, None]
    lb = torch.where(ind > 0, kii, 0.0).max(dim=1).values / k  # where, not a product: 0 * inf is NaN
    if k > 1:
        lb = torch.maximum(lb, trace / (k * (k - 1)))
    return lb * (1.0 - 1e-9)  # a margin for rounding: a bound must never exceed the exact value


def smea_select(g: torch.Tensor, f: int) -> torch.Tensor:
    """Indices of the ``n - f`` rows whose covariance has the smallest largest eigenvalue (SMEA's subset).

    For a subset S of ``k = n - f`` rows, ``lambda_max(Sigma_S)`` with
    ``Sigma_S = (1/k) sum_{i in S} (x_i - mu_S)(x_i - mu_S)^T`` is the largest eigenvalue of
    ``(1/k) H G_SS H`` (``H = I - 11^T / k``, the centring, applied elementwise). Exact search with
    pruning: every subset gets a cheap lower bound (:func:`_smea_lower_bounds`); subsets are
    evaluated (batched ``eigvalsh``, :data:`SMEA_BATCH` at a time) in increasing order of that bound
    until the next bound exceeds the best value found. Among subsets with the same smallest value
    the lexicographically first wins.

    Args:
        g: ``(n, n)`` float64 Gram matrix of the rows (any centre).
        f: number of rows left out, ``0 <= f < n``.

    Returns:
        ``(n - f,)`` long tensor of row indices, increasing (CPU).
    """
    n = g.shape[0]
    k = n - f
    g = g.cpu()
    if f == 0:
        return torch.arange(n)
    left = torch.combinations(torch.arange(n), r=f)
    lb = torch.cat([_smea_lower_bounds(g, _kept(left[i:i + 16384], n)[1], k)
                    for i in range(0, left.shape[0], 16384)])
    order = torch.sort(lb, stable=True).indices
    best: tuple[int, ...] = tuple(range(k))
    best_val = math.inf
    for start in range(0, order.numel(), SMEA_BATCH):
        chunk = order[start:start + SMEA_BATCH]
        if float(lb[chunk[0]]) > best_val:
            break  # every remaining subset's bound exceeds the best value: none can beat or tie it
        kept, _ = _kept(left[chunk], n)
        sub = g[kept[:, :, None], kept[:, None, :]]
        row = sub.mean(dim=2, keepdim=True)
        sub = (sub - row - row.transpose(1, 2) + sub.mean(dim=(1, 2), keepdim=True)) / k
        lam = torch.linalg.eigvalsh((sub + sub.transpose(1, 2)) * 0.5)[:, -1]
        j = int(torch.argmin(lam))
        val = float(lam[j])
        if val <= best_val:
            ties = [tuple(r) for r in kept[lam == val].tolist()]
            cand = min(ties)
            best = cand if val < best_val else min(best, cand)
            best_val = val
    return torch.tensor(best, dtype=torch.long)


def smea(x: torch.Tensor, f: int) -> torch.Tensor:
    """Smallest Maximum Eigenvalue Averaging (Allouah et al., ICML 2023): ``(n, d) -> (d,)``.

    The mean of the ``n - f`` rows chosen by :func:`smea_select`. Cost: one Gram pass, ``C(n, f)``
    lower bounds, and small eigenvalue problems of size ``n - f`` for the subsets the bounds do
    not rule out (all of them in the worst case).
    """
    return mean_of_rows(x, smea_select(robust_gram(x), f))


# --- CAF -------------------------------------------------------------------------------------------------
def caf_weights(g: torch.Tensor, f: int) -> torch.Tensor:
    """Convex weights ``a`` (``(n,)`` float64) of CAF's output ``sum_i a_i x_i``, from the rows' Gram matrix.

    Filter (Allouah, Guerraoui, Stephan, ICML 2025): start with ``c = 1``; at each iterate take the
    weighted mean ``mu_c = sum c_i x_i / sum c``, the top eigenpair ``(lam, v)`` of the weighted
    covariance ``Sigma_c = sum c_i (x_i - mu_c)(x_i - mu_c)^T / sum c``, and remember ``mu_c`` if ``lam``
    is the smallest seen so far; then ``tau_i = <x_i - mu_c, v>^2`` and
    ``c_i <- c_i (1 - tau_i / max_{j: c_j > 0} tau_j)``, which zeroes at least one row (weights at or
    below :data:`CAF_ZERO` become 0, so that rows tied with the largest ``tau`` all go). Iterate while
    ``sum c > n - 2f`` (the first iterate, the plain mean, is always a candidate) and stop early when
    ``lam = 0``. At most ``n`` iterates.

    Args:
        g: ``(n, n)`` float64 Gram matrix of the rows (any centre).
        f: declared Byzantine bound (``2f < n`` for a meaningful filter).

    Returns:
        ``(n,)`` float64 non-negative weights summing to 1 (the best iterate's ``c / sum c``).
    """
    n = g.shape[0]
    c = torch.ones(n, dtype=torch.float64, device=g.device)
    best_w, best_lam = c / n, math.inf
    for _ in range(n):
        total = float(c.sum())
        w = c / total
        k = _centred(g, w)
        root = w.sqrt()
        lam, u = top_eigenpair(root[:, None] * k * root[None, :])
        if lam < best_lam:
            best_lam, best_w = lam, w
        if lam <= 0.0 or not total > n - 2 * f:
            break
        tau = (k @ (root * u)) ** 2 / lam
        tau_max = float(tau[c > 0].max())
        if not tau_max > 0.0:
            break
        c = c * (1.0 - tau / tau_max)
        c[c <= CAF_ZERO] = 0.0
        if not float(c.sum()) > n - 2 * f:
            break
    return best_w


def caf(x: torch.Tensor, f: int) -> torch.Tensor:
    """Covariance-bound Agnostic Filter (Allouah, Guerraoui, Stephan, ICML 2025): ``(n, d) -> (d,)``.

    ``sum_i a_i x_i`` with ``a`` from :func:`caf_weights`; one Gram pass and one weighted sum over ``x``.
    """
    a = caf_weights(robust_gram(x), f)
    return a.to(dtype=x.dtype, device=x.device) @ x


# --- DnC -------------------------------------------------------------------------------------------------
def dnc_coordinates(d: int, b: int, generator: torch.Generator) -> torch.Tensor:
    """``min(b, d)`` distinct coordinates of ``range(d)``, uniformly at random, sorted (CPU long).

    When ``4b >= d`` the first ``b`` entries of ``torch.randperm(d, generator=generator)``. Otherwise
    ``torch.randint`` draws (about ``b + 2b^2/d``, topped up if needed) give a set of distinct
    values whose law is invariant under relabelling the coordinates, and a uniform ``b``-subset of
    that set (``randperm`` of its size) is therefore a uniform ``b``-subset of ``range(d)``; no
    ``(d,)`` permutation is formed (80 MB at ``d = 1e7``). Deterministic given the generator state.
    """
    b = min(b, d)
    if 4 * b >= d:
        return torch.sort(torch.randperm(d, generator=generator)[:b]).values
    found = torch.unique(torch.randint(0, d, (b + 2 * b * b // d + 64,), generator=generator))
    while found.numel() < b:
        found = torch.unique(torch.cat([found, torch.randint(0, d, (b,), generator=generator)]))
    pick = torch.randperm(found.numel(), generator=generator)[:b]
    return torch.sort(found[pick]).values


def dnc_scores(x: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """DnC outlier scores on the columns ``cols``: ``s_i = <x_i[cols] - mu, v>^2`` (``(n,)`` float64).

    ``mu`` is the rows' mean on those columns and ``v`` the top right singular vector of the
    centred ``(n, b)`` submatrix ``C``; with ``(lam, u)`` the top eigenpair of ``C C^T``,
    ``C v = sqrt(lam) u``, so ``s_i = lam u_i^2``. Only the ``(n, b)`` gathered columns are copied.
    """
    sub = x[:, cols.to(x.device)].to(torch.float64)
    sub -= sub.mean(dim=0)
    lam, u = top_eigenpair(gram(sub))
    return lam * u * u


def rank_with_ties(scores: torch.Tensor, rtol: float = DNC_TIE_RTOL) -> torch.Tensor:
    """Row indices by increasing score, where scores within ``rtol * max|score|`` of their neighbour tie.

    Sorted scores are cut into runs wherever consecutive values differ by more than the tolerance;
    inside a run rows are ordered by index. Exact ties in exact arithmetic (symmetric inputs) are
    thus broken by the lowest index whatever the rounding of the eigenvector, as every other rule
    here breaks ties.
    """
    order = torch.sort(scores, stable=True).indices
    s = scores[order]
    tol = rtol * float(s.abs().max()) if s.numel() else 0.0
    run = torch.zeros_like(order)
    run[1:] = torch.cumsum((s[1:] - s[:-1] > tol).long(), dim=0)
    n = scores.numel()
    return order[torch.argsort(run * n + order)]


def dnc_select(x: torch.Tensor, f: int, b: int, iterations: int, c: float,
               generator: torch.Generator) -> torch.Tensor:
    """Rows DnC keeps (Shejwalkar & Houmansadr, NDSS 2021, Algorithm 2), as an increasing long tensor.

    Each of the ``iterations`` rounds draws ``b`` coordinates (:func:`dnc_coordinates`), scores the
    rows (:func:`dnc_scores`) and keeps the ``n - r`` lowest scores, ``r = min(floor(c f), n - 1)``
    (lowest index first on ties, :func:`rank_with_ties`). The result is the intersection of the kept sets; when it is empty,
    the rows kept in the most rounds (see ``docs/conventions.md``).
    """
    n, d = x.shape
    r = min(math.floor(c * f), n - 1)
    count = torch.zeros(n, dtype=torch.long)
    for _ in range(iterations):
        scores = dnc_scores(x, dnc_coordinates(d, b, generator)).cpu()
        count[rank_with_ties(scores)[:n - r]] += 1
    return torch.nonzero(count == count.max()).flatten()


def dnc(x: torch.Tensor, f: int, b: int, iterations: int, c: float, generator: torch.Generator) -> torch.Tensor:
    """Divide-and-Conquer (Shejwalkar & Houmansadr, NDSS 2021): mean of the rows :func:`dnc_select` keeps."""
    return mean_of_rows(x, dnc_select(x, f, b, iterations, c, generator))
