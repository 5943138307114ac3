"""Slow, obviously-correct float64 reference implementations of every rule and map.

Written independently of :mod:`robustagg.functional`: numpy float64, plain loops over rows and
pairs, per-pair differences (never the Gram identity), full sorts, explicit tie-breaks by index.
Each function follows the definitions in ``shared/design/conventions.md`` word for word and takes a
``(n, d)`` array-like; the result is a float64 numpy array.

Only the column-wise sorts are vectorised over ``d`` (``numpy.sort`` on whole columns), so that
the references stay usable at ``d`` of a few hundred thousand.
"""

from __future__ import annotations

import itertools
import math
import warnings
from typing import Callable, Optional

import numpy as np

__all__ = ["as64", "mean", "coordinate_median", "trimmed_mean", "meamed", "sq_dist", "dist_matrix",
           "krum_scores", "krum_index", "krum", "multi_krum", "bulyan_indices", "bulyan", "gm_objective",
           "weiszfeld", "geometric_median", "centered_clipping", "mda", "nnm", "bucketing", "clipping", "arc",
           "variance", "kappa_hat", "cge", "monna", "top_direction", "exact_top_eigenvalue", "smea", "caf", "dnc",
           "REFERENCES",
           "cosine_matrix", "cosine_distances", "row_norms", "signguard", "clipped_clustering", "flame", "fltrust",
           "foolsgold_alpha", "foolsgold"]


def as64(x) -> np.ndarray:
    """The input as a float64 numpy array (torch tensors are converted value by value)."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().double().numpy()
    return np.array(x, dtype=np.float64)


# --- coordinate-wise -------------------------------------------------------------------------
def mean(x) -> np.ndarray:
    """(1/n) sum_i x_i, summed row by row."""
    x = as64(x)
    total = np.zeros(x.shape[1])
    for row in x:
        total = total + row
    return total / x.shape[0]


def _median_of_sorted(s: np.ndarray) -> np.ndarray:
    n = s.shape[0]
    if n % 2 == 1:
        return s[n // 2].copy()
    return (s[n // 2 - 1] + s[n // 2]) / 2.0  # even n: average of the two middle values


def coordinate_median(x, f: int = 0) -> np.ndarray:
    """Per coordinate: full sort, middle value (even n: mean of the two middle values)."""
    return _median_of_sorted(np.sort(as64(x), axis=0))


def trimmed_mean(x, f: int) -> np.ndarray:
    """Per coordinate: full sort, drop f smallest and f largest, average the n - 2f others."""
    s = np.sort(as64(x), axis=0)
    n = s.shape[0]
    kept = s[f:n - f]
    total = np.zeros(s.shape[1])
    for row in kept:
        total = total + row
    return total / (n - 2 * f)


def meamed(x, f: int) -> np.ndarray:
    """Per coordinate: the mean of the n - f values closest to the median (lowest row index on ties)."""
    x = as64(x)
    n = x.shape[0]
    med = coordinate_median(x)
    dist = np.abs(x - med)
    order = np.argsort(dist, axis=0, kind="stable")[:n - f]  # stable: equal distance -> lower row first
    return np.take_along_axis(x, order, axis=0).sum(axis=0) / (n - f)


# --- distances and Krum family -----------------------------------------------------------------
def sq_dist(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b||^2 from the per-coordinate differences (rescaled only if the plain sum overflows)."""
    diff = a - b
    total = float(np.sum(diff * diff))
    if math.isfinite(total):
        return total
    scale = float(np.max(np.abs(diff)))
    return scale * scale * float(np.sum((diff / scale) ** 2))


def dist_matrix(x) -> np.ndarray:
    """(n, n) squared distances, one pair at a time."""
    x = as64(x)
    n = x.shape[0]
    out = np.zeros((n, n))
    for i in range(n):
        for j in range(i + 1, n):
            out[i, j] = out[j, i] = sq_dist(x[i], x[j])
    return out


def krum_scores(x, f: int, candidates: Optional[list[int]] = None, dist: Optional[np.ndarray] = None) -> list[float]:
    """score(i) = sum of the |R| - f - 2 smallest squared distances to the other candidates (by index)."""
    dist = dist_matrix(x) if dist is None else dist
    cand = list(range(dist.shape[0])) if candidates is None else list(candidates)
    k = max(len(cand) - f - 2, 0)
    scores = []
    for i in cand:
        others = sorted(dist[i, j] for j in cand if j != i)  # self excluded by index, duplicates kept
        scores.append(float(sum(others[:k])))
    return scores


def krum_index(x, f: int) -> int:
    """Index of the lowest Krum score, lowest index on ties."""
    scores = krum_scores(x, f)
    return min(range(len(scores)), key=lambda i: (scores[i], i))


def krum(x, f: int) -> np.ndarray:
    """The row with the lowest Krum score."""
    return as64(x)[krum_index(x, f)].copy()


def multi_krum(x, f: int, m: Optional[int] = None) -> np.ndarray:
    """Mean of the m rows with the lowest scores (default m = n - f; lowest index first on ties)."""
    x64 = as64(x)
    n = x64.shape[0]
    m = n - f if m is None else m
    scores = krum_scores(x64, f)
    chosen = sorted(range(n), key=lambda i: (scores[i], i))[:m]
    return mean(x64[chosen])


def bulyan_indices(x, f: int) -> list[int]:
    """theta = n - 2f rows by iterated Krum: score the remaining set, take the winner, remove it."""
    x64 = as64(x)
    dist = dist_matrix(x64)
    remaining = list(range(x64.shape[0]))
    chosen = []
    for _ in range(x64.shape[0] - 2 * f):
        scores = krum_scores(x64, f, remaining, dist)
        j = min(range(len(remaining)), key=lambda t: (scores[t], remaining[t]))
        chosen.append(remaining.pop(j))
    return chosen


def bulyan(x, f: int) -> np.ndarray:
    """Iterated Krum, then per coordinate the mean of the beta = theta - 2f values closest to the median.

    The selected rows are taken in selection order for the tie-break among values at equal
    distance from the median (the order in which Bulyan's first phase hands them over).
    """
    x64 = as64(x)
    sel = bulyan_indices(x64, f)
    return meamed(x64[sel], 2 * f)


# --- geometric median and centered clipping ----------------------------------------------------
def gm_objective(x, z) -> float:
    """sum_i ||z - x_i||."""
    x64, z64 = as64(x), as64(z)
    return float(sum(math.sqrt(sq_dist(row, z64)) for row in x64))


def weiszfeld(x, nu: float = 1e-6, iterations: int = 100, init: str = "mean") -> np.ndarray:
    """Exactly ``iterations`` smoothed Weiszfeld updates from the mean (or zero).

    ``beta_i = 1 / max(nu, ||z - x_i||)``, ``z <- sum_i beta_i x_i / sum_i beta_i``.
    """
    x64 = as64(x)
    z = mean(x64) if init == "mean" else np.zeros(x64.shape[1])
    for _ in range(iterations):
        z = _weiszfeld_step(x64, z, nu)
    return z


def geometric_median(x, nu: float = 1e-6, max_iter: int = 20_000, tol: float = 1e-14) -> np.ndarray:
    """Smoothed Weiszfeld from the mean, run until the point stops moving (relative ``tol``)."""
    x64 = as64(x)
    z = mean(x64)
    for _ in range(max_iter):
        new = _weiszfeld_step(x64, z, nu)
        step = math.sqrt(sq_dist(new, z))
        z = new
        if step <= tol * (1.0 + float(np.max(np.abs(z)))):
            break
    return z


def _weiszfeld_step(x64: np.ndarray, z: np.ndarray, nu: float) -> np.ndarray:
    beta = [1.0 / max(nu, math.sqrt(sq_dist(row, z))) for row in x64]
    total = np.zeros(x64.shape[1])
    for b, row in zip(beta, x64):
        total = total + b * row
    return total / sum(beta)


def centered_clipping(x, tau: float, iterations: int, center) -> np.ndarray:
    """v <- v + (1/n) sum_i clip_tau(x_i - v), L times; clip_tau(u) = u min(1, tau/||u||), 0 stays 0."""
    x64 = as64(x)
    v = as64(center).copy()
    n = x64.shape[0]
    for _ in range(iterations):
        step = np.zeros_like(v)
        for row in x64:
            u = row - v
            norm = math.sqrt(sq_dist(row, v))
            step = step + (u * min(1.0, tau / norm) if norm > 0 else u)
        v = v + step / n
    return v


def mda(x, f: int) -> np.ndarray:
    """Mean of the n - f rows with the smallest diameter (lexicographically first subset on ties)."""
    x64 = as64(x)
    n = x64.shape[0]
    dist = dist_matrix(x64)
    best, best_diam = None, math.inf
    for subset in itertools.combinations(range(n), n - f):
        diam = max((dist[i, j] for i, j in itertools.combinations(subset, 2)), default=0.0)
        if diam < best_diam:
            best, best_diam = subset, diam
    assert best is not None
    return mean(x64[list(best)])


# --- pre-aggregation maps ----------------------------------------------------------------------
def nnm(x, f: int) -> np.ndarray:
    """Each row -> mean of its n - f nearest rows including itself (self first, lowest index on ties)."""
    x64 = as64(x)
    n = x64.shape[0]
    dist = dist_matrix(x64)
    out = np.zeros_like(x64)
    for i in range(n):
        others = sorted((j for j in range(n) if j != i), key=lambda j: (dist[i, j], j))
        nbrs = sorted([i] + others[:n - f - 1])  # summed in index order: equal sets give equal rows
        out[i] = mean(x64[nbrs])
    return out


def bucketing(x, s: int, perm: list[int]) -> np.ndarray:
    """Means of the buckets of s consecutive rows of ``x[perm]`` (the last bucket may be smaller)."""
    x64 = as64(x)[list(perm)]
    return np.stack([mean(x64[i:i + s]) for i in range(0, x64.shape[0], s)])


def _norm(row: np.ndarray) -> float:
    return math.sqrt(sq_dist(row, np.zeros_like(row)))


def clipping(x, tau: float) -> np.ndarray:
    """x_i * min(1, tau / ||x_i||) row by row (zero rows stay zero)."""
    x64 = as64(x)
    out = x64.copy()
    for i, row in enumerate(x64):
        norm = _norm(row)
        if norm > tau:
            out[i] = row * (tau / norm)
    return out


def arc(x, f: int) -> np.ndarray:
    """k = floor(2 (f/n)(n - f)) largest-norm rows scaled to the norm of the (k+1)-th largest."""
    x64 = as64(x)
    n = x64.shape[0]
    k = (2 * f * (n - f)) // n  # integer floor of 2 f (n - f) / n
    out = x64.copy()
    if k == 0:
        return out
    norms = [_norm(row) for row in x64]
    order = sorted(range(n), key=lambda i: (-norms[i], i))
    threshold = norms[order[k]]
    for i in order[:k]:
        if norms[i] > threshold:
            out[i] = x64[i] * (threshold / norms[i])
    return out


# --- similarity-based rules: SignGuard, ClippedClustering, FLAME, FLTrust, FoolsGold ----------------
# Cosines and norms pair by pair (never a Gram matrix); the clustering runs through the same
# scikit-learn estimators as the library (the algorithms the papers name), on features computed here.
def _dot(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b))


def cosine_matrix(x) -> np.ndarray:
    """cos(x_i, x_j) = <x_i, x_j> / sqrt(|x_i|^2 |x_j|^2), one pair at a time; 0 when a row is zero."""
    x64 = as64(x)
    n = x64.shape[0]
    out = np.zeros((n, n))
    for i in range(n):
        for j in range(n):
            den = math.sqrt(_dot(x64[i], x64[i]) * _dot(x64[j], x64[j]))
            out[i, j] = min(1.0, max(-1.0, _dot(x64[i], x64[j]) / den)) if den > 0 else 0.0
    return out


def cosine_distances(x) -> np.ndarray:
    """1 - cos, zero diagonal, clipped at 0."""
    dist = np.maximum(1.0 - cosine_matrix(x), 0.0)
    np.fill_diagonal(dist, 0.0)
    return dist


def row_norms(x) -> np.ndarray:
    return np.array([math.sqrt(_dot(r, r)) for r in as64(x)])


def _largest_cluster(labels, dist=None) -> list[int]:
    """Members of the largest cluster (label >= 0); ties: smaller within-cluster distance sum, then lowest index."""
    best = None
    for c in sorted(set(int(v) for v in labels if v >= 0)):
        members = [i for i, v in enumerate(labels) if v == c]
        spread = 0.0 if dist is None else sum(dist[i][j] for i in members for j in members)
        key = (-len(members), spread, members[0])
        if best is None or key < best[0]:
            best = (key, members)
    return [] if best is None else best[1]


def _clipped_mean(x64: np.ndarray, members: list[int], tau: float) -> np.ndarray:
    total = np.zeros(x64.shape[1])
    for i in members:
        norm = math.sqrt(_dot(x64[i], x64[i]))
        total = total + (x64[i] * (tau / norm) if norm > tau else x64[i])
    return total / len(members)


def signguard(x, offset: int, stride: int, lower: float = 0.1, upper: float = 3.0, quantile: float = 0.5) -> np.ndarray:
    """SignGuard as the authors' ``signguard_multiclass`` on the columns ``offset::stride``.

    Open norm band around numpy's median norm M; sign fractions divided by each column's maximum
    (+ 1e-8); ``MeanShift(bin_seeding=True, cluster_all=False)``, the cluster ``argmax`` of the
    sizes over labels 0, 1, ... (unassigned rows, label -1, in none); clip to torch's median (the
    lower middle) and average. Where their code cannot run, as the library: a bandwidth of 0 is one
    cluster, M = 0 or no kept row gives 0.
    """
    from sklearn.cluster import MeanShift, estimate_bandwidth

    x64 = as64(x)
    n, d = x64.shape
    norms = row_norms(x64)
    m = float(np.median(norms))
    if m == 0:
        return np.zeros(d)
    s1 = {i for i in range(n) if lower * m < norms[i] < upper * m}
    fracs = []
    for row in x64:
        cols = row[offset::stride]
        k = len(cols)
        fracs.append([sum(1 for v in cols if v > 0) / k, sum(1 for v in cols if v == 0) / k,
                      sum(1 for v in cols if v < 0) / k])
    top = [max(f[c] for f in fracs) for c in range(3)]
    feats = np.array([[f[c] / (top[c] + 1e-8) for c in range(3)] for f in fracs])
    bw = float(estimate_bandwidth(feats, quantile=quantile)) if n >= 2 else 0.0
    if bw > 0:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Binning data failed")
            labels = list(MeanShift(bandwidth=bw, bin_seeding=True, cluster_all=False).fit(feats).labels_)
    else:
        labels = [0] * n
    sizes = [labels.count(c) for c in range(max(labels) + 1)]
    chosen = [i for i in range(n) if sizes and labels[i] == sizes.index(max(sizes)) and i in s1]
    clip = sorted(norms)[(n - 1) // 2]
    return _clipped_mean(x64, chosen, clip) if chosen else np.zeros(d)


def clipped_clustering(x, history=()) -> np.ndarray:
    """Clip to the median of all norms (history + current), mean of the larger average-linkage cluster."""
    from sklearn.cluster import AgglomerativeClustering

    x64 = as64(x)
    n = x64.shape[0]
    tau = float(np.median(list(history) + list(row_norms(x64))))
    if n < 3:
        members = list(range(n))
    else:
        dist = cosine_distances(x64)
        labels = AgglomerativeClustering(n_clusters=2, metric="precomputed", linkage="average").fit(dist).labels_
        members = _largest_cluster(labels, dist)
    return _clipped_mean(x64, members, tau) if tau > 0 else np.zeros(x64.shape[1])


def flame(x, min_samples: int = 1) -> np.ndarray:
    """Majority HDBSCAN cluster (min_cluster_size n//2 + 1) on cosine distances, clip to the median norm, mean."""
    from sklearn.cluster import HDBSCAN

    x64 = as64(x)
    n = x64.shape[0]
    st = float(np.median(row_norms(x64)))
    if n < 3:
        members = list(range(n))
    else:
        labels = HDBSCAN(min_cluster_size=n // 2 + 1, min_samples=min(min_samples, n), metric="precomputed",
                         allow_single_cluster=True, copy=True).fit(cosine_distances(x64)).labels_
        members = _largest_cluster(labels)
        members = members if len(members) >= n // 2 + 1 else []
    return _clipped_mean(x64, members, st) if members and st > 0 else np.zeros(x64.shape[1])


def fltrust(x, trusted) -> np.ndarray:
    """sum_i relu(cos(x_i, g0)) |g0|/|x_i| x_i / sum_i relu(cos(x_i, g0)); zero when every trust is 0."""
    x64, g0 = as64(x), as64(trusted)
    g0n = math.sqrt(_dot(g0, g0))
    total, weight = np.zeros(x64.shape[1]), 0.0
    for row in x64:
        rn = math.sqrt(_dot(row, row))
        ts = max(0.0, min(1.0, _dot(row, g0) / (rn * g0n))) if rn > 0 and g0n > 0 else 0.0
        if ts > 0:
            total = total + ts * (g0n / rn) * row
            weight += ts
    return total / weight if weight > 0 else total


def foolsgold_alpha(histories, kappa: float = 1.0) -> list[float]:
    """Alg. 1 of Fung et al. (RAID 2020) as the authors' ``foolsgold.py``, loop by loop, on the (n, d) histories.

    Their ``cs = cosine_similarity(H) - I`` sets each worker's cosine with itself to 0, and that 0
    counts in both maxima (``v_i`` and ``alpha_i``).
    """
    h = as64(histories)
    n = h.shape[0]
    cs = cosine_matrix(h)
    for i in range(n):
        cs[i][i] = 0.0
    v = [max(cs[i]) for i in range(n)]
    for i in range(n):
        for j in range(n):
            if i != j and v[i] < v[j]:
                cs[i][j] = cs[i][j] * v[i] / v[j]
    alpha = [min(1.0, max(0.0, 1.0 - max(cs[i]))) for i in range(n)]
    top = max(alpha)
    if top <= 0:
        return [0.0] * n
    out = []
    for a in alpha:
        a = a / top
        a = 0.99 if a == 1.0 else a
        out.append(0.0 if a == 0 else min(1.0, max(0.0, kappa * (math.log(a / (1 - a)) + 0.5))))
    return out


def foolsgold(steps, kappa: float = 1.0) -> np.ndarray:
    """Output at the last of ``steps`` (a list of (n, d) inputs): weighted mean by alpha of the running sums."""
    steps = [as64(s) for s in steps]
    hist = np.zeros_like(steps[0])
    for s in steps:
        hist = hist + s
    alpha = foolsgold_alpha(hist, kappa)
    total = np.zeros(steps[-1].shape[1])
    for a, row in zip(alpha, steps[-1]):
        total = total + a * row
    return total / sum(alpha) if sum(alpha) > 0 else total


# --- robustness coefficient ------------------------------------------------------------------
def variance(h) -> float:
    """V(S) = (1/|S|) sum_{i in S} ||x_i - mean_S||^2."""
    h64 = as64(h)
    mu = mean(h64)
    return sum(sq_dist(row, mu) for row in h64) / h64.shape[0]


def kappa_hat(output, honest) -> float:
    """||F(X) - mean_H||^2 / V(H)."""
    return sq_dist(as64(output), mean(honest)) / variance(honest)


# --- norm/distance ranking and covariance-based rules (CGE, MoNNA, SMEA, CAF, DnC) ------------------------
def cge(x, f: int) -> np.ndarray:
    """Mean of the n - f rows of smallest norm (lowest index first on equal norms)."""
    x64 = as64(x)
    n = x64.shape[0]
    norms = [_norm(row) for row in x64]
    kept = sorted(range(n), key=lambda i: (norms[i], i))[:n - f]
    return mean(x64[sorted(kept)])


def monna(x, f: int, trusted: int = 0) -> np.ndarray:
    """Mean of the trusted row and the n - f - 1 other rows nearest to it (lowest index on ties)."""
    x64 = as64(x)
    n = x64.shape[0]
    others = sorted((j for j in range(n) if j != trusted), key=lambda j: (sq_dist(x64[j], x64[trusted]), j))
    return mean(x64[sorted([trusted] + others[:n - f - 1])])


def top_direction(rows: np.ndarray, weights: Optional[np.ndarray] = None) -> tuple[np.ndarray, float, np.ndarray]:
    """(mu, lam, v): weighted mean, top eigenvalue and unit top eigenvector of the weighted covariance.

    ``Sigma = sum_i w_i (x_i - mu)(x_i - mu)^T / sum w`` is ``A^T A`` with ``A`` the rows
    ``sqrt(w_i / sum w) (x_i - mu)``; its top eigenpair comes from numpy's SVD of ``A`` (``lam = s_0^2``,
    ``v`` the first right singular vector), never from the rows' Gram matrix.
    """
    w = np.ones(rows.shape[0]) if weights is None else np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    mu = np.zeros(rows.shape[1])
    for wi, row in zip(w, rows):
        mu = mu + wi * row
    a = np.sqrt(w)[:, None] * (rows - mu)
    _, sv, vt = np.linalg.svd(a, full_matrices=False)
    return mu, float(sv[0]) ** 2, vt[0]


def exact_top_eigenvalue(rows: np.ndarray):
    """The covariance's top eigenvalue of ``rows`` as an exact sympy algebraic number.

    Each float is its exact rational value; the eigenvalues are the real roots of the characteristic
    polynomial of the d x d covariance, or of the k x k Gram matrix of the centred rows when k < d
    (the same non-zero eigenvalues).
    """
    import sympy

    k, d = rows.shape
    xs = [[sympy.Rational(float(v)) for v in r] for r in rows]
    mu = [sum(col) / k for col in zip(*xs)]
    ys = [[v - m for v, m in zip(r, mu)] for r in xs]
    if d <= k:
        mat = sympy.Matrix(d, d, lambda a, b: sum(y[a] * y[b] for y in ys) / k)
    else:
        mat = sympy.Matrix(k, k, lambda i, j: sum(a * b for a, b in zip(ys[i], ys[j])) / k)
    roots = sympy.Poly(mat.charpoly().as_expr(), sympy.Symbol("lambda")).real_roots()
    return max(roots) if roots else sympy.Integer(0)


def smea(x, f: int) -> np.ndarray:
    """Mean of the n - f rows whose covariance has the smallest top eigenvalue (first subset on exact ties).

    The subsets' top eigenvalues come from numpy SVD; the subsets within 1e-6 of the rows' squared
    spread of the smallest are compared exactly (:func:`exact_top_eigenvalue`, sympy), in
    lexicographic order, the first kept on equality.
    """
    x64 = as64(x)
    n = x64.shape[0]
    values = [(top_direction(x64[list(s)])[1], s) for s in itertools.combinations(range(n), n - f)]
    low = min(v for v, _ in values)
    spread = max(sq_dist(row, mean(x64)) for row in x64)
    near = [s for v, s in values if v <= low + 1e-6 * spread]
    best = near[0]
    if len(near) > 1:
        best_val = exact_top_eigenvalue(x64[list(best)])
        for s in near[1:]:
            val = exact_top_eigenvalue(x64[list(s)])
            if val != best_val and bool(val < best_val):
                best, best_val = s, val
    return mean(x64[list(best)])


def caf(x, f: int) -> np.ndarray:
    """CAF with the covariance eigenpairs from numpy SVD (:func:`top_direction`), the loop of docs/conventions.md."""
    x64 = as64(x)
    n = x64.shape[0]
    c = np.ones(n)
    best, best_lam = None, math.inf
    while True:
        mu, lam, v = top_direction(x64, c)
        if lam < best_lam:
            best, best_lam = mu, lam
        if lam <= 0.0 or not c.sum() > n - 2 * f:
            break
        tau = np.array([float(np.dot(row - mu, v)) ** 2 for row in x64])
        tau_max = max(tau[i] for i in range(n) if c[i] > 0)
        if not tau_max > 0.0:
            break
        c = c * (1.0 - tau / tau_max)
        c[c <= 1e-9] = 0.0  # rows tied with tau_max go, as in the library
        if not c.sum() > n - 2 * f:
            break
    assert best is not None
    return best


def _rank_with_ties(scores: list, rtol: float = 1e-9) -> list:
    """Indices by score; consecutive sorted scores within rtol * max|score| tie, ties by lowest index."""
    order = sorted(range(len(scores)), key=lambda i: (scores[i], i))
    tol = rtol * max(abs(v) for v in scores)
    runs, run = [], 0
    for a, b in zip([None] + order[:-1], order):
        if a is not None and scores[b] - scores[a] > tol:
            run += 1
        runs.append(run)
    return [i for _, i in sorted(zip(runs, order))]


def dnc(x, f: int, coordinate_sets: list, c: float = 1.0) -> np.ndarray:
    """DnC with the given coordinate subsets: numpy SVD of each centred submatrix, drop floor(c f) top scores.

    Scores equal to within 1e-9 of the largest tie (lowest index kept first), as in the library.

    Rows kept in every round are averaged; when none is, the rows kept in the most rounds.
    """
    x64 = as64(x)
    n = x64.shape[0]
    r = min(math.floor(c * f), n - 1)
    count = [0] * n
    for cols in coordinate_sets:
        sub = x64[:, list(cols)]
        centred = sub - mean(sub)
        _, _, vt = np.linalg.svd(centred, full_matrices=False)
        scores = [float(np.dot(row, vt[0])) ** 2 for row in centred]
        for i in _rank_with_ties(scores)[:n - r]:
            count[i] += 1
    top = max(count)
    return mean(x64[[i for i in range(n) if count[i] == top]])


#: name -> reference ``(x, **params) -> (d,)`` for rules (maps are called directly).
REFERENCES: dict[str, Callable[..., np.ndarray]] = {
    "mean": lambda x, f=0: mean(x),
    "coordinate_median": coordinate_median,
    "trimmed_mean": trimmed_mean,
    "meamed": meamed,
    "krum": krum,
    "multi_krum": multi_krum,
    "bulyan": bulyan,
    "mda": mda,
    "cge": cge,
    "monna": monna,
    "smea": smea,
    "caf": caf,
}
