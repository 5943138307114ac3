"""Clustering-based filters: SignGuard, ClippedClustering, FLAME (kernels and their coefficients).

Each rule keeps a subset ``S`` of rows (the majority cluster of some feature), rescales the kept
rows by ``c_i = min(1, tau / ||x_i||)`` and averages: ``out = sum_{i in S} c_i x_i / |S|`` (FLAME
adds Gaussian noise). The features come from one uncentred float64 Gram matrix
(:mod:`~robustagg.functional.cosine`) or, for SignGuard, one strided pass over sampled columns;
the clustering itself runs on ``n`` points through scikit-learn, imported on first use only (it
costs about a second), never when :mod:`robustagg` is imported.

The ``*_coefficients`` functions return the float64 ``(n,)`` coefficients ``a`` with
``out = sum_i a_i x_i`` (before noise); the kernels form the output once.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from .cosine import clip_factors, combine, cosine_distance_from_gram, median, norms_from_gram, unit_gram

__all__ = ["SIGN_FEATURE_EPS", "sign_features", "sign_clusters", "first_largest_label", "signguard_coefficients",
           "signguard", "majority_cluster", "clipped_clustering_coefficients", "clipped_clustering",
           "flame_coefficients", "flame"]


# --- SignGuard ------------------------------------------------------------------------------------
#: Added to each sign-feature column's maximum before the division, as in the authors' code (a
#: column of zeros, e.g. no row with a zero entry, stays 0 instead of 0/0).
SIGN_FEATURE_EPS = 1e-8


def sign_features(x: torch.Tensor, offset: int, stride: int) -> np.ndarray:
    """SignGuard's sign features of every row over the columns ``offset::stride``.

    The fractions of positive, zero and negative entries, each of the three columns divided by its
    maximum over the rows plus :data:`SIGN_FEATURE_EPS` (Xu et al.'s code, ``signguard_multiclass``).
    Counts are exact, so the features are identical bit for bit wherever they are computed.

    Returns:
        ``(n, 3)`` float64 array in [0, 1).
    """
    cols = x[:, offset::stride]
    k = cols.shape[1]
    pos = (cols > 0).sum(dim=1).double()
    neg = (cols < 0).sum(dim=1).double()
    frac = torch.stack([pos, k - pos - neg, neg], dim=1) / k
    return (frac / (frac.max(dim=0).values + SIGN_FEATURE_EPS)).cpu().numpy()


def _largest_cluster(labels: np.ndarray, dist: np.ndarray | None = None) -> np.ndarray:
    """Boolean mask of the largest cluster (labels >= 0; -1 is noise).

    Ties between equally large clusters: the one with the smaller sum of pairwise distances
    ``dist`` within it (when given), then the one holding the lowest row index.
    """
    ids = [int(c) for c in np.unique(labels) if c >= 0]
    if not ids:
        return np.zeros(labels.shape[0], dtype=bool)

    def key(c: int) -> tuple[int, float, int]:
        members = np.flatnonzero(labels == c)
        spread = 0.0 if dist is None else float(dist[np.ix_(members, members)].sum())
        return (-members.size, spread, int(members[0]))

    return labels == min(ids, key=key)


def sign_clusters(feats: np.ndarray, quantile: float) -> np.ndarray:
    """SignGuard's MeanShift labels of the sign features (``-1``: a row near no cluster centre).

    ``MeanShift(bandwidth=estimate_bandwidth(feats, quantile), bin_seeding=True, cluster_all=False)``
    as in the authors' code; scikit-learn numbers the clusters by decreasing intensity (points
    within the bandwidth of the centre, then the larger centre). Fewer than 2 rows, or a bandwidth
    of 0 (too few distinct features for the quantile, e.g. ``n <= 3`` or identical features, where
    scikit-learn refuses the bandwidth): one cluster.

    Returns:
        ``(n,)`` int64 labels.
    """
    from sklearn.cluster import MeanShift, estimate_bandwidth  # type: ignore[import-untyped]  # lazy: slow to import

    if feats.shape[0] < 2:
        return np.zeros(feats.shape[0], dtype=np.int64)
    bandwidth = float(estimate_bandwidth(feats, quantile=quantile))
    if not bandwidth > 0:
        return np.zeros(feats.shape[0], dtype=np.int64)
    with warnings.catch_warnings():  # every row in its own bin: scikit-learn warns and seeds from the rows
        warnings.filterwarnings("ignore", message="Binning data failed", category=UserWarning)
        ms = MeanShift(bandwidth=bandwidth, bin_seeding=True, cluster_all=False).fit(feats)
    return np.asarray(ms.labels_, dtype=np.int64)


def first_largest_label(labels: np.ndarray) -> np.ndarray:
    """Mask of the rows of the largest cluster (labels >= 0); equally large: the lowest label (``argmax``).

    All labels -1: no row.
    """
    ids = labels[labels >= 0]
    if ids.size == 0:
        return np.zeros(labels.shape[0], dtype=bool)
    return labels == int(np.argmax(np.bincount(ids)))


def signguard_coefficients(x: torch.Tensor, offset: int, stride: int, lower: float = 0.1, upper: float = 3.0,
                           quantile: float = 0.5) -> torch.Tensor:
    """SignGuard's coefficients (Xu, Huang, Song, Lan, ICDCS 2022, Alg. 1, plain sign statistics).

    As the authors' code (``signguard_multiclass``):

    1. Norm filter: ``S1 = {i : lower M < ||x_i|| < upper M}`` (open), ``M`` the median norm (even
       ``n``: the mean of the two middle norms, ``numpy.median``).
    2. Sign clustering: :func:`sign_features` over the sampled columns, :func:`sign_clusters`;
       ``S2`` = the largest cluster, the lowest label on ties (:func:`first_largest_label`); rows
       MeanShift leaves unassigned are in no cluster.
    3. ``S = S1 ∩ S2``; ``a_i = min(1, C / ||x_i||) / |S|`` on ``S``, 0 elsewhere, ``C`` the lower
       middle norm (``torch.median``; ``C = M`` for odd ``n``). All 0 if ``S`` is empty or ``M = 0``.

    Args:
        x: ``(n, d)`` finite rows; offset, stride: the sampled columns ``offset::stride``.

    Returns:
        ``(n,)`` float64 coefficients.
    """
    n = x.shape[0]
    g, s = unit_gram(x)
    norms = norms_from_gram(g, s)
    m = median(norms)
    a = torch.zeros(n, dtype=torch.float64, device=g.device)
    if not m > 0:
        return a
    s1 = ((norms > lower * m) & (norms < upper * m)).cpu().numpy()
    s2 = first_largest_label(sign_clusters(sign_features(x, offset, stride), quantile))
    keep = torch.from_numpy(s1 & s2).to(g.device)
    if not bool(keep.any()):
        return a
    a[keep] = clip_factors(norms[keep], median(norms, lower=True)) / int(keep.sum())
    return a


def signguard(x: torch.Tensor, offset: int, stride: int, lower: float = 0.1, upper: float = 3.0,
              quantile: float = 0.5) -> torch.Tensor:
    """SignGuard aggregate ``sum_{i in S} min(1, C/||x_i||) x_i / |S|``; see :func:`signguard_coefficients`."""
    return combine(x, signguard_coefficients(x, offset, stride, lower, upper, quantile))


# --- ClippedClustering --------------------------------------------------------------------------------
def majority_cluster(dist: np.ndarray) -> np.ndarray:
    """The larger of two clusters by average-linkage agglomerative clustering on precomputed ``dist``.

    Fewer than 3 rows: every row is kept (two clusters of 2 rows would drop one arbitrarily).

    Returns:
        ``(n,)`` bool mask.
    """
    n = dist.shape[0]
    if n < 3:
        return np.ones(n, dtype=bool)
    from sklearn.cluster import AgglomerativeClustering  # type: ignore[import-untyped]  # lazy

    labels = AgglomerativeClustering(n_clusters=2, metric="precomputed", linkage="average").fit(dist).labels_
    return _largest_cluster(labels, dist)


def clipped_clustering_coefficients(x: torch.Tensor, history: torch.Tensor | None = None
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """ClippedClustering's coefficients (Li, Ngai, Voigt, IEEE Trans. Big Data 2023).

    1. ``tau`` = median of every norm seen so far: ``history`` (float64 norms of earlier calls)
       and the current ``||x_i||``; every row is clipped to ``tau``: ``c_i = min(1, tau/||x_i||)``.
    2. Agglomerative clustering (average linkage, 2 clusters) on the cosine distances
       ``1 - cos(x_i, x_j)`` (clipping does not change them); ``S`` = the larger cluster.
    3. ``a_i = c_i / |S|`` on ``S``.

    Returns:
        ``(a, norms)``: ``(n,)`` float64 coefficients and the current ``(n,)`` float64 norms (the
        caller appends them to its history).
    """
    g, s = unit_gram(x)
    norms = norms_from_gram(g, s)
    seen = norms if history is None or history.numel() == 0 else torch.cat([history.to(norms.device), norms])
    tau = median(seen)
    keep = torch.from_numpy(majority_cluster(cosine_distance_from_gram(g).cpu().numpy())).to(g.device)
    c = clip_factors(norms, tau) if tau > 0 else torch.zeros_like(norms)
    a = torch.where(keep, c, torch.zeros_like(c)) / int(keep.sum())
    return a, norms


def clipped_clustering(x: torch.Tensor, history: torch.Tensor | None = None) -> torch.Tensor:
    """ClippedClustering aggregate; see :func:`clipped_clustering_coefficients` (history not updated here)."""
    return combine(x, clipped_clustering_coefficients(x, history)[0])


# --- FLAME ---------------------------------------------------------------------------------------------
def _hdbscan_majority(dist: np.ndarray, min_samples: int) -> np.ndarray:
    n = dist.shape[0]
    if n < 3:
        return np.ones(n, dtype=bool)
    from sklearn.cluster import HDBSCAN  # type: ignore[import-untyped]  # lazy

    size = n // 2 + 1
    labels = HDBSCAN(min_cluster_size=size, min_samples=min(min_samples, n), metric="precomputed",
                     allow_single_cluster=True, copy=True).fit(dist).labels_
    keep = _largest_cluster(labels)
    return keep if keep.sum() >= size else np.zeros(n, dtype=bool)


def flame_coefficients(x: torch.Tensor, min_samples: int = 1) -> tuple[torch.Tensor, float]:
    """FLAME's coefficients before noise (Nguyen et al., USENIX Security 2022, Alg. 1).

    1. HDBSCAN on the cosine distances ``1 - cos(x_i, x_j)`` with ``min_cluster_size = n//2 + 1``
       and ``min_samples``; ``S`` = the cluster holding a majority (noise points are dropped; no
       majority cluster: ``S`` is empty and the coefficients are 0).
    2. ``S_t`` = median of all ``n`` norms; ``a_i = min(1, S_t/||x_i||) / |S|`` on ``S``.

    Returns:
        ``(a, S_t)``: ``(n,)`` float64 coefficients and the clipping bound (gradient-norm units).
    """
    g, s = unit_gram(x)
    norms = norms_from_gram(g, s)
    st = median(norms)
    keep = torch.from_numpy(_hdbscan_majority(cosine_distance_from_gram(g).cpu().numpy(), min_samples)).to(g.device)
    a = torch.zeros_like(norms)
    if bool(keep.any()) and st > 0:
        a[keep] = clip_factors(norms[keep], st) / int(keep.sum())
    return a, st


def flame(x: torch.Tensor, lam: float = 0.001, min_samples: int = 1,
          generator: torch.Generator | None = None) -> torch.Tensor:
    """FLAME aggregate ``sum_{i in S} a_i x_i + N(0, (lam S_t)^2 I)``; see :func:`flame_coefficients`.

    The noise is drawn on the CPU by ``torch.randn(d, generator=generator)`` (float32 or float64
    as ``x``; float32 for other dtypes) and moved to ``x``'s device: the same generator state gives
    the same noise on every device. ``lam = 0`` draws nothing.
    """
    a, st = flame_coefficients(x, min_samples)
    out = combine(x, a)
    sigma = lam * st
    if lam > 0 and math.isfinite(sigma):
        dtype = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
        noise = torch.randn(x.shape[1], generator=generator, dtype=dtype)
        out += (noise * sigma).to(device=x.device, dtype=x.dtype)
    return out
