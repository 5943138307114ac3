"""Float64 Gram matrices of the rows in one pass over ``x``: the core of every distance-based rule.

``G[i, j] = <r_i - c, r_j - c>`` for the rows ``r`` of ``x`` (plus optional extra rows) and a
centre ``c``; squared distances follow as ``G_ii + G_jj - 2 G_ij`` and every Weiszfeld or
centered-clipping iterate as a quadratic form in ``G`` (see :mod:`~robustagg.functional.weiszfeld`).

Fast path (CPU, float32/float64 rows): a compiled kernel (:mod:`~robustagg.functional._gram_kernel`)
converts column chunks of ``x`` to float64 in an L2-sized buffer (float32 products are then exact,
and float32 values above ~1.8e19, whose squares overflow float32, stay finite) and computes only
the upper triangle with register tiles: for ``n = 20`` about 3x the mean's time on one core,
against ~5x for NumPy's BLAS ``syrk`` on the same chunks, which computes nearly the full ``n x n``
product for so few rows. CUDA, other devices and other dtypes use ``torch.addmm`` in float64 on
column chunks.

Precision (:func:`robust_gram`): the first pass uses no centre (``c = 0``). Its rounding error on
``D_ij`` is about ``eps64 * (|x_i|^2 + |x_j|^2)``, negligible unless the rows are near-identical
with a large norm. When the median squared row norm exceeds :data:`RHO_MAX` times the median
pairwise squared distance, a second pass recomputes ``G`` centred on a central row, exactly as the
reference does (``eps64 * |x_i - c|^2``). A huge Byzantine row (1e20 in float32) does not move
either medians, so it neither triggers the second pass nor costs the honest rows any precision.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import torch

from .._tensor import check_finite

__all__ = ["gram", "robust_gram", "gram_to_sq_dist", "warm_up", "needs_warm_up", "RHO_MAX", "GRAM_CHUNK_BYTES"]

#: Largest accepted ratio (median squared row norm) / (median squared pairwise distance) for the
#: uncentred first pass; above it the Gram is recomputed centred on a central row.
RHO_MAX = 1e3
#: Bytes of the float64 chunk buffer of the CPU kernel (measured best at ~384 KiB: L2-resident).
GRAM_CHUNK_BYTES = 384 << 10
#: Fewest columns per thread of the CPU kernel when torch uses several threads.
MIN_COLUMNS_PER_THREAD = 1 << 16
#: Elements per float64 chunk on CUDA.
CUDA_GRAM_CHUNK_ELEMENTS = 1 << 24


def _gram_cpu(x: torch.Tensor, center: torch.Tensor | None, extra: torch.Tensor | None) -> torch.Tensor:
    """The compiled kernel (:mod:`~robustagg.functional._gram_kernel`) on float32/float64 CPU rows.

    With ``torch.get_num_threads() > 1`` the columns are split into that many contiguous parts
    (at least :data:`MIN_COLUMNS_PER_THREAD` each) computed by Python threads (the kernel releases
    the GIL) and summed in part order: deterministic for a given thread count.
    """
    from ._gram_kernel import gram_upper  # compiled on first use (Numba)

    n, d = x.shape
    m_pad = (n + (0 if extra is None else extra.shape[0]) + 3) // 4 * 4
    budget = min(GRAM_CHUNK_BYTES, max(1 << 16, x.numel() * x.element_size() // 4))  # small inputs: small buffer
    width = max(64, budget // (8 * m_pad))
    xn = x.numpy()
    ext = np.zeros((0, d), dtype=np.float64) if extra is None else extra.to(torch.float64).numpy()
    c64 = np.zeros(0, dtype=np.float64) if center is None else center.to(torch.float64).numpy()
    parts = max(1, min(torch.get_num_threads(), d // MIN_COLUMNS_PER_THREAD))
    if parts == 1:
        return torch.from_numpy(gram_upper(xn, ext, c64, width))
    edges = [d * p // parts for p in range(parts + 1)]

    def part(p: int) -> np.ndarray:
        s, e = edges[p], edges[p + 1]
        return gram_upper(xn[:, s:e], ext[:, s:e], c64[s:e] if c64.size else c64, width)

    with ThreadPoolExecutor(parts) as pool:
        results = list(pool.map(part, range(parts)))
    g = results[0]
    for r in results[1:]:
        g += r
    return torch.from_numpy(g)


def _fill(block: torch.Tensor, x: torch.Tensor, extra: torch.Tensor | None, c64: torch.Tensor | None,
          start: int, stop: int) -> None:
    """Copy columns ``start:stop`` of ``[x; extra]`` into the float64 ``block``, minus the centre."""
    n = x.shape[0]
    block[:n].copy_(x[:, start:stop])
    if extra is not None:
        block[n:].copy_(extra[:, start:stop])
    if c64 is not None:
        block.sub_(c64[start:stop])


def _gram_torch(x: torch.Tensor, center: torch.Tensor | None, extra: torch.Tensor | None) -> torch.Tensor:
    n, d = x.shape
    m = n + (0 if extra is None else extra.shape[0])
    g = torch.zeros(m, m, dtype=torch.float64, device=x.device)
    c64 = None if center is None else center.to(torch.float64)
    k = max(1, min(d, min(CUDA_GRAM_CHUNK_ELEMENTS, max(1 << 16, x.numel() * x.element_size() // 32)) // m))
    buf = torch.empty(m, k, dtype=torch.float64, device=x.device)
    for start in range(0, d, k):
        stop = min(start + k, d)
        block = buf[:, :stop - start]
        _fill(block, x, extra, c64, start, stop)
        g.addmm_(block, block.T)
    return g


def gram(x: torch.Tensor, center: torch.Tensor | None = None, extra: torch.Tensor | None = None) -> torch.Tensor:
    """Float64 Gram matrix ``G[i, j] = <r_i - c, r_j - c>`` of the rows of ``x`` then ``extra``.

    Args:
        x: ``(n, d)`` floating rows (any dtype, any device; never copied whole).
        center: ``(d,)`` centre ``c``, or None for ``c = 0``.
        extra: optional ``(e, d)`` rows appended after ``x``.

    Returns:
        ``(n + e, n + e)`` float64, exactly symmetric, on ``x.device``.
    """
    x = x.detach()  # a Gram matrix is a statistic of the submissions, never part of an autograd graph
    center = None if center is None else center.detach()
    extra = None if extra is None else extra.detach()
    fast = x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)
    g = _gram_cpu(x, center, extra) if fast else _gram_torch(x, center, extra)
    return (g + g.T) * 0.5  # exactly symmetric (a general product need not be); no-op on a symmetric g


def warm_up() -> None:
    """Compile, or load from Numba's on-disk cache, the CPU Gram kernel for the usual layouts (and the
    credit kernel of the coordinate-wise rules' shares, :mod:`~robustagg.functional._credit_kernel`).

    The first Gram call of a process otherwise pays for it: about 0.5 s to import Numba and load
    the cached machine code, or 2 to 3 s per signature (float32/float64, contiguous/strided rows)
    when nothing is cached yet (a fresh install; the cache lives in ``__pycache__`` beside the
    kernel's source, or Numba's user cache directory when that is read-only). The trainer calls
    this in the launcher before the workers start and in every worker before its first step, so
    that the cost lands neither in a timed step (where it would look like a straggler) nor inside
    a collective's timeout.
    """
    from ..metrics import step_metrics
    from .weights import order_statistic_weights

    for dtype in (torch.float32, torch.float64):
        x = torch.zeros(4, 16, dtype=dtype)
        gram(x)
        gram(x[:, ::2])
        gram(x, x[0], x[:1])
        order_statistic_weights(x, [1, 2], 0.5)  # the compiled credit kernel of the coordinate rules' shares
        step_metrics(x[0], x, torch.tensor([True, True, False, True]))  # and the metrics' moments kernel


#: Pre-aggregation maps that compute no Gram matrix (a permutation and means; norms).
GRAM_FREE_MAPS = frozenset({"bucketing", "clipping", "arc"})


def needs_warm_up(rule: Any, byzantine: Any = None) -> bool:
    """Whether a run of ``rule`` under ``byzantine`` can compute a Gram matrix (so :func:`warm_up` pays off).

    False only when every stage is known to need none: the rule (or a Pipeline's final rule) is
    coordinate-wise (its ``coordinatewise`` class attribute: mean, median, trimmed mean, MeaMed),
    every pre-aggregation map is one of :data:`GRAM_FREE_MAPS`, and the attack, if any, declares
    ``uses_gram = False`` (``attacks.Attack``; a rule-aware attack calls the rule, covered above).
    A data attack (label or batch poison without a gradient function) computes nothing. Anything
    unknown (a custom rule or attack without the attributes) counts as needing it: the safe side,
    the warm-up only costs start-up time.

    Args:
        rule: an :class:`~robustagg.aggregators.base.Aggregator` or
            :class:`~robustagg.preaggregation.Pipeline`.
        byzantine: a :class:`~robustagg.training.ByzantineBehaviour` or ``None``.
    """
    stages = list(getattr(rule, "pre", [])) + [getattr(rule, "rule", rule)]
    *maps, final = stages
    if not getattr(type(final), "coordinatewise", False) or any(getattr(m, "name", "") not in GRAM_FREE_MAPS
                                                               for m in maps):
        return True
    fn = getattr(byzantine, "gradient_fn", None)
    if fn is None:
        return False
    return bool(getattr(getattr(fn, "attack", fn), "uses_gram", True))


def gram_to_sq_dist(g: torch.Tensor) -> torch.Tensor:
    """Squared distances ``G_ii + G_jj - 2 G_ij`` (clamped at 0, zero diagonal) from a Gram matrix."""
    g = (g + g.T) * 0.5  # exact symmetry (a general matrix product need not give it), exact ties stay exact
    sq = torch.diagonal(g)
    dist = (sq[:, None] + sq[None, :] - 2.0 * g).clamp_(min=0.0)
    dist.fill_diagonal_(0.0)
    return dist


def _lower_median(v: torch.Tensor) -> float:
    return float(torch.sort(v).values[(v.numel() - 1) // 2]) if v.numel() else 0.0


def central_row_from_gram(g: torch.Tensor, n: int) -> int:
    """Row (among the first ``n``) whose squared distance to the rows' mean is the lower median.

    The same choice as :func:`~robustagg.functional.distance.robust_center_row`, from a Gram matrix
    (with any centre) instead of a pass over the data.
    """
    if n <= 2:
        return 0
    gx = g[:n, :n]
    r = torch.diagonal(gx) - 2.0 * gx.mean(dim=1) + gx.mean()
    r = torch.nan_to_num(r, nan=math.inf)
    return int(torch.sort(r, stable=True).indices[(n - 1) // 2])


def robust_gram(x: torch.Tensor, extra: torch.Tensor | None = None,
                reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Float64 Gram matrix of ``[x; extra]`` precise enough for every distance-based rule.

    One uncentred pass; a second pass centred on :func:`central_row_from_gram` when the rows are
    near-identical relative to their norm (ratio above :data:`RHO_MAX`, see the module docstring).
    Any centre gives the same distances and Weiszfeld iterates in exact arithmetic; only rounding
    differs.

    Args:
        x: ``(n, d)`` finite rows.
        extra: optional ``(e, d)`` rows appended after ``x`` (e.g. a starting point).
        reduce: for coordinate-sharded rows, sums each partial Gram over the shards (e.g. an
            all-reduce); every decision is then taken on the global Gram, identically on every
            shard. The finiteness check is left to the caller in that case.

    Returns:
        ``(n + e, n + e)`` float64 Gram matrix (of the rows minus some centre).

    Raises:
        NonFiniteInputError: a row of ``x`` holds NaN or inf (seen for free on the Gram diagonal,
            so callers of the distance-based kernels need no separate finiteness pass).
    """
    n = x.shape[0]
    g = gram(x, None, extra)
    if reduce is not None:
        g = reduce(g)
    elif not bool(torch.isfinite(torch.diagonal(g)[:n]).all()):
        check_finite(x)  # NaN/inf rows raise NonFiniteInputError here; finite rows past 1e154 go on
    if n < 2:
        return g
    dist = gram_to_sq_dist(g[:n, :n])
    off = dist[~torch.eye(n, dtype=torch.bool, device=dist.device)]
    norm2 = _lower_median(torch.diagonal(g)[:n])
    spread = _lower_median(off)
    if not (math.isfinite(norm2) and math.isfinite(spread)) or norm2 > RHO_MAX * spread:
        c = x[central_row_from_gram(g, n)]
        g = gram(x, c, extra)
        if reduce is not None:
            g = reduce(g)
    return g
