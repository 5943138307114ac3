"""Pairwise squared distances and the distance-based kernels: Krum, Multi-Krum, Bulyan, NNM, MDA.

Distances use the Gram identity ``||a - b||^2 = <a,a> + <b,b> - 2<a,b>`` on a float64 Gram matrix
accumulated in one pass over ``x`` (:func:`~robustagg.functional.gram.robust_gram`): uncentred when
that is precise, else **centred on a central row** (the row whose distance to the mean is the lower
median of those distances: with f < n/2 outliers it lies among the bulk of the rows), so that
near-identical rows of large norm keep their precision and a huge but finite Byzantine row (1e20
in float32) neither overflows nor drags the honest rows' precision away. Pairs whose float64
result is not finite (inputs beyond ~1e154) are recomputed directly with scaling, and bitwise-equal
rows get bitwise-equal distances (exact ties, broken by the lowest index as the rules define).

Readable references: :func:`pairwise_sq_distances_reference` (the robust centre from two extra
passes, ``torch.addmm`` in float64) and :func:`centered_gram_reference`. Selections made from the
fast distances equal those from the references except where two candidates' scores differ by less
than float64 rounding of the distances (about 1e-12 relatively). Ties between bitwise-identical
rows are always exact; candidates from different rows whose scores tie in exact arithmetic may be
split either way by rounding, in any implementation.

Outputs that average selected rows (Multi-Krum, NNM) sum exactly the rows the reference sums, in
another order (a 0/1 or ``1/k`` weight vector times ``x``): they differ only by summation order.
"""

from __future__ import annotations

import itertools
import math

import torch

from ._alloc import empty_rows
from .gram import gram_to_sq_dist, robust_gram

__all__ = ["robust_center_row", "pairwise_sq_distances", "krum_scores", "krum",
           "multi_krum", "bulyan_select", "bulyan", "nnm", "nnm_weights", "mda", "mda_select",
           "centered_gram_reference", "pairwise_sq_distances_reference", "mean_of_rows", "first_copies"]

#: Columns per chunk when casting to float64 for the Gram accumulation.
_GRAM_CHUNK_ELEMENTS = 1 << 20


def robust_center_row(x: torch.Tensor) -> int:
    """Index of the row whose squared distance to the row mean is the lower median of all of them."""
    n = x.shape[0]
    if n <= 2:
        return 0
    mu = x.mean(dim=0, dtype=torch.float64)
    r = torch.nan_to_num(_row_sq_dist_to(x, mu), nan=math.inf)
    return int(torch.sort(r, stable=True).indices[(n - 1) // 2])


def _row_sq_dist_to(x: torch.Tensor, point64: torch.Tensor) -> torch.Tensor:
    n, d = x.shape
    acc = torch.zeros(n, dtype=torch.float64, device=x.device)
    chunk = max(1, _GRAM_CHUNK_ELEMENTS // n)
    for s in range(0, d, chunk):
        block = x[:, s:s + chunk].double() - point64[s:s + chunk]
        acc += block.pow_(2).sum(dim=1)
    return acc


def centered_gram_reference(x: torch.Tensor, center: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
    """Reference for :func:`~robustagg.functional.gram.gram` with a centre: float64 ``torch.addmm`` over column chunks.

    Args:
        x: ``(n, d)`` rows.
        center: ``(d,)`` the centre ``c``.
        extra: optional ``(k, d)`` rows appended after ``x`` (without copying ``x``).

    Returns:
        ``(n + k, n + k)`` float64 Gram matrix of the (augmented) rows centred on ``c``.
    """
    n, d = x.shape
    m = n + (0 if extra is None else extra.shape[0])
    g = torch.zeros(m, m, dtype=torch.float64, device=x.device)
    c64 = center.to(torch.float64)
    chunk = max(1, _GRAM_CHUNK_ELEMENTS // m)
    for s in range(0, d, chunk):
        block = x[:, s:s + chunk] if extra is None else torch.cat([x[:, s:s + chunk], extra[:, s:s + chunk]])
        block = block.double() - c64[s:s + chunk]
        g.addmm_(block, block.T)
    return g


def pairwise_sq_distances(x: torch.Tensor) -> torch.Tensor:
    """Squared Euclidean distances between rows: ``(n, d) -> (n, n)`` float64, zero diagonal.

    Exact to float64 rounding relative to the distances themselves for near-identical rows; finite
    for any finite input (a true value beyond float64's range saturates at its largest finite
    value, ~1.8e308); bitwise-equal
    rows have bitwise-equal rows of distances. One pass over ``x`` (two for near-identical rows of
    large norm), see :func:`~robustagg.functional.gram.robust_gram`.
    """
    g = robust_gram(x)
    dist = gram_to_sq_dist(g)
    _fix_overflow(x, dist)
    _tie_exact_duplicates(x, dist, torch.diagonal(g))
    return dist


def pairwise_sq_distances_reference(x: torch.Tensor) -> torch.Tensor:
    """Reference for :func:`pairwise_sq_distances`: centred on :func:`robust_center_row`, ``addmm``."""
    c = x[robust_center_row(x)]
    g = centered_gram_reference(x, c)
    dist = gram_to_sq_dist(g)
    _fix_overflow(x, dist)
    _tie_exact_duplicates(x, dist, torch.diagonal(g))
    return dist


def _fix_overflow(x: torch.Tensor, dist: torch.Tensor) -> None:
    """Recompute, from the differences with scaling, the pairs whose float64 result is not finite."""
    bad = (~torch.isfinite(dist)).nonzero().tolist()
    for i, j in bad:
        if i < j:
            diff = x[i].double() - x[j].double()
            scale = diff.abs().max()
            val = (scale * scale * ((diff / scale) ** 2).sum()) if scale > 0 else diff.new_zeros(())
            dist[i, j] = dist[j, i] = torch.nan_to_num(val, nan=math.inf)


def first_copies(x: torch.Tensor, dist: torch.Tensor, sq_norms: torch.Tensor) -> list[int]:
    """For each row, the lowest index of a bitwise-equal row (itself when it has no earlier copy).

    Candidates are pairs whose squared distance ``dist`` (from the Gram identity) is within its
    rounding of zero (``1e-9 (G_ii + G_jj)``, ``sq_norms`` the Gram diagonal), confirmed with
    ``torch.equal``; a far outlier adds no candidates.
    """
    n = dist.shape[0]
    scale = torch.nan_to_num(sq_norms.to(dist.dtype), nan=math.inf, posinf=math.inf)
    near = (dist <= 1e-9 * (scale[:, None] + scale[None, :])).triu_(diagonal=1)
    first = list(range(n))
    for i, j in near.nonzero().tolist():
        if first[i] == i and first[j] == j and torch.equal(x[i, :256], x[j, :256]) and torch.equal(x[i], x[j]):
            first[j] = i
    return first


def _tie_exact_duplicates(x: torch.Tensor, dist: torch.Tensor, sq_norms: torch.Tensor) -> None:
    """Give bitwise-equal rows distance 0 and the distances of their first copy (exact ties, in place).

    Rounding in the Gram identity can differ between two copies of a row; tie-breaks by lowest index
    (Krum, Bulyan, NNM) need the copies to tie exactly (copies found by :func:`first_copies`).
    """
    n = dist.shape[0]
    first = first_copies(x, dist, sq_norms)
    copies = [j for j in range(n) if first[j] != j]
    if copies:
        rep = torch.tensor(first, device=dist.device)
        idx = torch.tensor(copies, device=dist.device)
        dist[idx] = dist[rep[idx]]
        dist[:, idx] = dist[:, rep[idx]]
        dist[rep[:, None] == rep[None, :]] = 0.0


def krum_scores(dist: torch.Tensor, f: int, candidates: torch.Tensor | None = None) -> torch.Tensor:
    """Krum scores from a squared-distance matrix.

    ``score(i) = sum of the n' - f - 2 smallest dist[i, j]`` over the other candidates ``j != i``
    (self excluded by index, so duplicates count as neighbours); ``n'`` is the number of candidates.
    A neighbour count below zero is clamped to zero (scores all 0; only under ``strict=False``).

    Args:
        dist: ``(n, n)`` float64 squared distances.
        f: declared Byzantine bound.
        candidates: optional 1-D long tensor of row indices to score among (default all rows).

    Returns:
        ``(n',)`` float64 scores, in the order of ``candidates``.
    """
    idx = torch.arange(dist.shape[0], device=dist.device) if candidates is None else candidates
    m = idx.numel()
    k = max(m - f - 2, 0)
    sub = dist[idx][:, idx].clone()
    sub.fill_diagonal_(math.inf)
    if k == 0:
        return torch.zeros(m, dtype=dist.dtype, device=dist.device)
    return torch.sort(sub, dim=1).values[:, :k].sum(dim=1)


def krum(x: torch.Tensor, f: int, dist: torch.Tensor | None = None) -> torch.Tensor:
    """Krum (Blanchard et al., NeurIPS 2017): the row with the lowest Krum score (lowest index on ties).

    Shape ``(n, d) -> (d,)``; a copy, never a view.
    """
    dist = pairwise_sq_distances(x) if dist is None else dist
    return x[int(torch.argmin(krum_scores(dist, f)))].clone()


def multi_krum(x: torch.Tensor, f: int, m: int | None = None, dist: torch.Tensor | None = None) -> torch.Tensor:
    """Multi-Krum: the mean of the ``m`` rows with the lowest Krum scores (default ``m = n - f``)."""
    n = x.shape[0]
    m = n - f if m is None else m
    dist = pairwise_sq_distances(x) if dist is None else dist
    chosen = torch.sort(krum_scores(dist, f), stable=True).indices[:m]
    return mean_of_rows(x, chosen)


def mean_of_rows(x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Mean of the rows ``chosen`` of ``x``: ``x[chosen].mean(0)`` without the gathered copy.

    A 0/1 vector times ``x`` (one read of ``x``), divided by ``len(chosen)``: the same sum as the
    gathered mean, in another order. Used by Multi-Krum and MDA; ``(n, d) -> (d,)``.
    """
    sel = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
    sel[chosen.to(x.device)] = 1.0
    return (sel @ x).div_(chosen.numel())


def bulyan_select(dist: torch.Tensor, f: int, theta: int) -> torch.Tensor:
    """Iterated Krum: indices of the ``theta`` rows Bulyan selects, in selection order.

    Each round scores the remaining set R with ``|R| - f - 2`` neighbours, takes the lowest score
    (lowest original index on ties) and removes it. One distance matrix serves every round.
    """
    remaining = torch.arange(dist.shape[0], device=dist.device)
    chosen = []
    for _ in range(theta):
        scores = krum_scores(dist, f, remaining)
        j = int(torch.argmin(scores))
        chosen.append(int(remaining[j]))
        remaining = torch.cat([remaining[:j], remaining[j + 1:]])
    return torch.tensor(chosen, dtype=torch.long)


def bulyan(x: torch.Tensor, f: int, dist: torch.Tensor | None = None) -> torch.Tensor:
    """Bulyan (El Mhamdi, Guerraoui, Rouault, ICML 2018).

    ``theta = n - 2f`` rows chosen by iterated Krum, then per coordinate the mean of the
    ``beta = theta - 2f`` selected values closest to their median (MeaMed with ``theta - beta = 2f``
    dropped). Shape ``(n, d) -> (d,)``.
    """
    from .coordinate import meamed

    n = x.shape[0]
    theta = n - 2 * f
    dist = pairwise_sq_distances(x) if dist is None else dist
    sel = bulyan_select(dist, f, theta)
    return meamed(x, 2 * f, rows=sel.tolist())  # on the selected rows, in selection order, no copy


def nnm_weights(dist: torch.Tensor, f: int) -> torch.Tensor:
    """Row-stochastic ``(n, n)`` float64 matrix W of Nearest Neighbour Mixing.

    Row i averages the ``n - f`` nearest rows of x_i **including itself** (self first by index, then
    the nearest others, lowest index on ties).
    """
    n = dist.shape[0]
    k = n - f
    d = dist.clone()
    d.fill_diagonal_(-1.0)
    nbrs = torch.sort(d, dim=1, stable=True).indices[:, :k]
    w = torch.zeros_like(dist)
    w.scatter_(1, nbrs, 1.0 / k)
    return w


def nnm(x: torch.Tensor, f: int, dist: torch.Tensor | None = None) -> torch.Tensor:
    """Nearest Neighbour Mixing (Allouah et al., AISTATS 2023): ``(n, d) -> (n, d)``."""
    dist = pairwise_sq_distances(x) if dist is None else dist
    w = nnm_weights(dist, f).to(dtype=x.dtype, device=x.device)
    return torch.mm(w, x, out=empty_rows(x.shape, x))


def mda(x: torch.Tensor, f: int, max_subsets: int, dist: torch.Tensor | None = None) -> torch.Tensor:
    """Minimum-Diameter Averaging (El Mhamdi et al. 2020): mean of the ``n - f`` rows of smallest diameter."""
    dist = pairwise_sq_distances(x) if dist is None else dist
    return mean_of_rows(x, mda_select(dist, f))


def mda_select(dist: torch.Tensor, f: int) -> torch.Tensor:
    """Indices of the ``n - f`` rows of smallest diameter (MDA's selection) from squared distances.

    Subsets are enumerated in lexicographic order; the first with the smallest diameter wins.
    Cost ``C(n, f)`` subsets; the class refuses more than ``max_subsets``.
    """
    n = dist.shape[0]
    k = n - f
    best, best_diam = None, math.inf
    combos = itertools.combinations(range(n), k)
    while True:
        batch = list(itertools.islice(combos, 1024))
        if not batch:
            break
        idx = torch.tensor(batch, dtype=torch.long)
        sub = dist[idx[:, :, None], idx[:, None, :]]
        diam = sub.flatten(1).max(dim=1).values
        j = int(torch.argmin(diam))
        if float(diam[j]) < best_diam:
            best_diam, best = float(diam[j]), batch[j]
    if best is None:
        best = tuple(range(k))
    return torch.tensor(best, dtype=torch.long)
