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
from fractions import Fraction

import torch

from . import exact as E
from .distance import first_copies, mean_of_rows
from .gram import gram, gram_to_sq_dist, robust_gram

__all__ = ["top_eigenpair", "smea_select", "smea", "caf_weights", "caf", "dnc_coordinates", "dnc_scores",
           "dnc_select", "dnc", "rank_with_ties"]

#: DnC scores closer than this fraction of the largest score are ties (lowest index first).
DNC_TIE_RTOL = 1e-9
#: CAF weights (which start at 1) at or below this are set to 0: a row tied with the largest tau is
#: zeroed even when rounding leaves it ``1 - tau_i / tau_max = 1e-16``.
CAF_ZERO = 1e-9
#: Subsets per batched eigenvalue call of SMEA.
SMEA_BATCH = 256
#: SMEA: a subset's float64 top eigenvalue is within this fraction of the largest squared row norm
#: of the subset (about the Gram matrix's centre) of the exact value; subsets within these slacks of
#: the best are compared in exact arithmetic. Rounding of a float64 Gram matrix over d columns is
#: at most about d 2^-53 of it (1e-9 at d = 10^7), of the eigenvalue problem 1e-14.
SMEA_TIE_RTOL = 1e-8


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


def _smea_lower_bounds(g: torch.Tensor, ind: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower bounds on ``lambda_max(Sigma_S)`` and tie slacks of the subsets with indicators ``ind`` ``(c, n)``.

    With ``K = H G_SS H`` (``Sigma_S = K / k``): ``lambda_max >= tr(K) / (k (k - 1))`` (at most
    ``k - 1`` non-zero eigenvalues) and ``lambda_max >= max_{i in S} K_ii / k`` (``Sigma_S`` dominates
    each ``(x_i - mu_S)(x_i - mu_S)^T / k``). The slack is :data:`SMEA_TIE_RTOL` ``max_{i in S} G_ii``.
    All from ``ind @ G`` in ``O(c n^2)``, no gather.
    """
    diag = torch.diagonal(g)
    wg = ind @ g
    block = (wg * ind).sum(dim=1)  # 1_S^T G 1_S
    trace = ind @ diag - block / k
    kii = diag - 2.0 * wg / k + (block / (k * k))[:, None]
    lb = torch.where(ind > 0, kii, 0.0).max(dim=1).values / k  # where, not a product: 0 * inf is NaN
    if k > 1:
        lb = torch.maximum(lb, trace / (k * (k - 1)))
    slack = SMEA_TIE_RTOL * torch.where(ind > 0, diag, 0.0).max(dim=1).values
    return lb * (1.0 - 1e-9), slack  # a margin for rounding: a bound must never exceed the exact value


def _smea_exact_first(cands: list[tuple[tuple[int, ...], float, float]], g: torch.Tensor,
                      x: torch.Tensor | None) -> tuple[int, ...]:
    """The first subset of ``cands`` whose covariance has the smallest top eigenvalue, in exact arithmetic.

    ``cands``: ``(subset, lo, hi)`` in increasing subset order, ``(lo, hi)`` an interval holding the
    subset's top eigenvalue (its float64 value minus and plus the slack). Subsets that hold the same
    rows up to bitwise-equal copies (``x`` given) tie without arithmetic: only the first of each
    such class is compared, by :mod:`~robustagg.functional.exact` on ``x``'s values (without ``x``:
    on ``g``'s, taken as exact).
    """
    if x is not None:
        first = first_copies(x, gram_to_sq_dist(g), torch.diagonal(g))
        classes: dict[tuple[int, ...], tuple[tuple[int, ...], float, float]] = {}
        for c in cands:
            classes.setdefault(tuple(sorted(first[i] for i in c[0])), c)
        cands = sorted(classes.values())
    if len(cands) == 1:
        return cands[0][0]
    rows = sorted({i for c, _, _ in cands for i in c})
    pos = {r: p for p, r in enumerate(rows)}
    exact, e = E.exact_gram(x[rows]) if x is not None else E.exact_matrix(g[rows][:, rows])
    k = len(cands[0][0])
    scale = Fraction(k ** 3) / Fraction(2) ** e  # eigenvalues of centred_block = scale * those of Sigma_S
    polys = [E.charpoly(E.centred_block(exact, tuple(pos[i] for i in c))) for c, _, _ in cands]
    guesses = [(Fraction(lo) * scale, Fraction(hi) * scale) for _, lo, hi in cands]
    best = 0
    for j in range(1, len(cands)):
        if E.compare_top_roots(polys[j], polys[best], guesses[j], guesses[best]) < 0:  # the first stays on ties
            best = j
    return cands[best][0]


def smea_select(g: torch.Tensor, f: int, x: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the ``n - f`` rows whose covariance has the smallest largest eigenvalue (SMEA's subset).

    For a subset S of ``k = n - f`` rows, ``lambda_max(Sigma_S)`` with
    ``Sigma_S = (1/k) sum_{i in S} (x_i - mu_S)(x_i - mu_S)^T`` is the largest eigenvalue of
    ``(1/k) H G_SS H`` (``H = I - 11^T / k``, the centring, applied elementwise). Exact search with
    pruning: every subset gets a cheap lower bound (:func:`_smea_lower_bounds`); subsets are
    evaluated (batched ``eigvalsh``, :data:`SMEA_BATCH` at a time) in increasing order of that
    bound until it rules out every remaining subset.

    Among subsets with the same smallest value the lexicographically first wins, decided in exact
    arithmetic: a float64 value is within the slack :data:`SMEA_TIE_RTOL` ``max_{i in S} G_ii`` of
    the exact one (the rounding of the Gram matrix and of ``eigvalsh`` is far smaller), so every
    subset within the slacks of the best is compared exactly (:mod:`~robustagg.functional.exact`):
    exact ties go to the first, and a difference below rounding is still ordered right.

    Args:
        g: ``(n, n)`` float64 Gram matrix of the rows (any centre).
        f: number of rows left out, ``0 <= f < n``.
        x: the ``(n, d)`` rows ``g`` was computed from; near ties are decided on their exact
            values (without it, on ``g``'s float64 values taken as exact).

    Returns:
        ``(n - f,)`` long tensor of row indices, increasing (CPU).
    """
    n = g.shape[0]
    k = n - f
    g = g.cpu()
    if f == 0:
        return torch.arange(n)
    left = torch.combinations(torch.arange(n), r=f)
    parts = [_smea_lower_bounds(g, _kept(left[i:i + 16384], n)[1], k) for i in range(0, left.shape[0], 16384)]
    lb, slack = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    floor = lb - slack  # no subset's float64 value minus its slack is below this
    order = torch.sort(floor, stable=True).indices
    upper = math.inf  # the smallest value plus its slack so far: the exact best is at most this
    near: list[tuple[tuple[int, ...], float, float]] = []  # (subset, value - slack, value + slack)
    for start in range(0, order.numel(), SMEA_BATCH):
        chunk = order[start:start + SMEA_BATCH]
        if float(floor[chunk[0]]) > upper:
            break  # every remaining subset is above the best by more than the slacks
        kept, _ = _kept(left[chunk], n)
        sub = g[kept[:, :, None], kept[:, None, :]]
        row = sub.mean(dim=2, keepdim=True)
        sub = (sub - row - row.transpose(1, 2) + sub.mean(dim=(1, 2), keepdim=True)) / k
        lam = torch.linalg.eigvalsh((sub + sub.transpose(1, 2)) * 0.5)[:, -1]
        hi = lam + slack[chunk]
        upper = min(upper, float(hi.min()))
        near += [(tuple(r), a, b) for r, a, b in zip(kept.tolist(), (lam - slack[chunk]).tolist(), hi.tolist())
                 if a <= upper]
    cands = sorted(c for c in near if c[1] <= upper)
    return torch.tensor(cands[0][0] if len(cands) == 1 else _smea_exact_first(cands, g, x), dtype=torch.long)


def smea(x: torch.Tensor, f: int) -> torch.Tensor:
    """Smallest Maximum Eigenvalue Averaging (Allouah et al., ICML 2023): ``(n, d) -> (d,)``.

    The mean of the ``n - f`` rows chosen by :func:`smea_select` (near ties decided on ``x``'s exact
    values). Cost: one Gram pass, ``C(n, f)`` lower bounds, and small eigenvalue problems of size
    ``n - f`` for the subsets the bounds do not rule out (all of them in the worst case).
    """
    return mean_of_rows(x, smea_select(robust_gram(x), f, x))


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
