"""Fast Gram-based distance kernels against per-pair differences and direct loops.

- The one-pass float64 Gram (the compiled upper-triangle kernel on CPU, ``torch.addmm`` elsewhere) equals the Gram
  from the rows up to float64 rounding, with and without a centre and extra rows.
- Distances match per-pair float64 differences to ~1e-12 relatively, including near-identical rows
  of large norm (the second, centred pass) and a 1e20 row in float32 (no overflow, no NaN).
- Krum, Multi-Krum, Bulyan and NNM select exactly the rows a per-pair-difference reference selects
  (random inputs, duplicated rows, integer inputs with exact ties: lowest index first).
- Geometric median and centered clipping match the Weiszfeld / clipping loops run on the rows in
  float64 to ``1e-5 max|x|`` (the float32 output's rounding), and multi-row averages differ from
  ``x[chosen].mean(0)`` only by summation order.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import robustagg.functional as F
from robustagg.functional import gram as G
from robustagg.functional import weiszfeld as W
from robustagg.functional.distance import pairwise_sq_distances_reference


# --- simple references (per-pair differences, plain loops, float64) ----------------------------------
def ref_dist(x: torch.Tensor) -> torch.Tensor:
    x64 = x.double()
    n = x.shape[0]
    dist = torch.zeros(n, n, dtype=torch.float64)
    for i, j in itertools.combinations(range(n), 2):
        dist[i, j] = dist[j, i] = ((x64[i] - x64[j]) ** 2).sum()
    return dist


def ref_scores(dist: torch.Tensor, f: int, cand: list[int]) -> list[float]:
    k = max(len(cand) - f - 2, 0)
    return [sum(sorted(float(dist[i, j]) for j in cand if j != i)[:k]) for i in cand]


def ref_krum(x: torch.Tensor, f: int) -> int:
    s = ref_scores(ref_dist(x), f, list(range(x.shape[0])))
    return min(range(len(s)), key=lambda i: (s[i], i))


def ref_multi_krum(x: torch.Tensor, f: int, m: int) -> list[int]:
    s = ref_scores(ref_dist(x), f, list(range(x.shape[0])))
    return sorted(range(len(s)), key=lambda i: (s[i], i))[:m]


def ref_bulyan(x: torch.Tensor, f: int) -> list[int]:
    dist, remaining, chosen = ref_dist(x), list(range(x.shape[0])), []
    for _ in range(x.shape[0] - 2 * f):
        s = ref_scores(dist, f, remaining)
        chosen.append(remaining.pop(min(range(len(s)), key=lambda t: (s[t], remaining[t]))))
    return chosen


def ref_nnm_sets(x: torch.Tensor, f: int) -> list[set[int]]:
    dist, n = ref_dist(x), x.shape[0]
    return [set(sorted(range(n), key=lambda j: (j != i, float(dist[i, j]), j))[:n - f]) for i in range(n)]


def _cases(seed: int) -> list[tuple[torch.Tensor, int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (5, 7, 11, 20):
        f = (n - 3) // 4
        normal = torch.randn(n, 300, generator=g)
        copies = torch.randn(n, 300, generator=g)
        copies[n - f:] = copies[n - 1]                            # f identical Byzantine rows
        copies[1] = copies[3]                                     # and an honest duplicate
        ints = torch.randint(-2, 3, (n, 6), generator=g).float()  # exact ties everywhere
        far = torch.randn(n, 300, generator=g)
        far[0] = 1e20                                             # squares overflow float32
        out += [(normal, f), (copies, f), (ints, f), (far, f)]
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs() / b.abs().clamp(min=1e-300)).max())


# --- Gram ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_gram_equals_the_rows_product(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 5003, generator=g).to(dtype)
    extra = torch.randn(2, 5003, generator=g).to(dtype)
    c = torch.randn(5003, generator=g).to(dtype)
    rows = torch.cat([x, extra]).double()
    for center, ext, expect in ((None, None, x.double()), (c, None, x.double() - c.double()),
                                (c, extra, rows - c.double()), (None, extra, rows)):
        want = expect @ expect.T
        got = G.gram(x, center, ext)
        assert torch.equal(got, got.T)
        assert float((got - want).abs().max()) <= 1e-12 * float(want.abs().max())
        other = G._gram_torch(x, center, ext)  # the CUDA code path, run on CPU
        assert float((other - want).abs().max()) <= 1e-12 * float(want.abs().max())


def test_gram_uses_small_chunks_correctly(monkeypatch):
    monkeypatch.setattr(G, "GRAM_CHUNK_BYTES", 8 * 7 * 64)  # 64 columns per chunk
    x = torch.randn(7, 1000)
    want = x.double() @ x.double().T
    assert float((G.gram(x) - want).abs().max()) <= 1e-12 * float(want.abs().max())


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 21])
@pytest.mark.parametrize("d", [1, 3, 130])
def test_gram_kernel_shapes_strides_and_padding(monkeypatch, m, d):
    # Chunks of 64 columns (130 = 64 + 64 + 2), m not a multiple of the 2 x 4 tiles, strided rows.
    monkeypatch.setattr(G, "GRAM_CHUNK_BYTES", 8 * 24 * 64)
    g = torch.Generator().manual_seed(m * 1000 + d)
    base = torch.randn(m, 3 * d, generator=g)
    c = torch.randn(d, generator=g, dtype=torch.float64)
    extra = torch.randn(2, d, generator=g)
    for x in (base[:, :d], base[:, ::3], base[:, :d].T.contiguous().T, base[:, :d].double()):
        rows = torch.cat([x.double(), extra.double()]) - c
        want = rows @ rows.T
        got = G.gram(x, c, extra)
        assert got.shape == (m + 2, m + 2) and got.dtype == torch.float64
        assert float((got - want).abs().max()) <= 1e-13 * float(want.abs().max())


def test_gram_kernel_gives_identical_rows_bitwise_identical_entries(monkeypatch):
    # Rows 0, 3 and 6 are equal: they sit in different 2 x 4 tiles, yet each entry is summed in the
    # same order, so their Gram rows must agree bit for bit (Krum's ties depend on it).
    monkeypatch.setattr(G, "GRAM_CHUNK_BYTES", 8 * 8 * 64)
    x = torch.randn(7, 1001, generator=torch.Generator().manual_seed(4))
    x[3] = x[0]
    x[6] = x[0]
    gm = G.gram(x)
    others = [1, 2, 4, 5]
    assert torch.equal(gm[0, others], gm[3, others]) and torch.equal(gm[0, others], gm[6, others])
    assert gm[0, 0] == gm[3, 3] == gm[6, 6] == gm[0, 3] == gm[3, 6]


def test_gram_kernel_splits_columns_over_threads(monkeypatch):
    # Three threads over 1000 columns (parts 333/333/334, chunks of 64 inside each), summed in order.
    monkeypatch.setattr(G, "MIN_COLUMNS_PER_THREAD", 300)
    monkeypatch.setattr(G, "GRAM_CHUNK_BYTES", 8 * 12 * 64)
    x = torch.randn(9, 1000, generator=torch.Generator().manual_seed(6))
    c = torch.randn(1000, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    rows = x.double() - c
    want = rows @ rows.T
    import robustagg.functional._gram_kernel as K

    calls = []
    kernel = K.gram_upper
    monkeypatch.setattr(K, "gram_upper", lambda xs, *rest: calls.append(xs.shape[1]) or kernel(xs, *rest))
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        got = G.gram(x, c)
        again = G.gram(x, c)
    finally:
        torch.set_num_threads(saved)
    assert sorted(calls) == [333, 333, 333, 333, 334, 334]  # three parts per call, two calls
    assert float((got - want).abs().max()) <= 1e-13 * float(want.abs().max())
    assert torch.equal(got, again)


def test_gram_kernel_propagates_nan_and_inf():
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(5))
    x[1, 7] = float("nan")
    x[3, 9] = float("inf")
    diag = torch.diagonal(G.gram(x))
    assert torch.isnan(diag[1]) and diag[3] == float("inf") and torch.isfinite(diag[[0, 2, 4]]).all()


def test_robust_gram_recentres_near_identical_rows_of_large_norm():
    # Rows 1e4 + noise 1e-3: uncentred, the Gram identity would lose ~8 of float64's 16 digits.
    g = torch.Generator().manual_seed(1)
    x = 1e4 + 1e-3 * torch.randn(8, 2000, generator=g, dtype=torch.float64)
    dist, want = F.pairwise_sq_distances(x), ref_dist(x)
    off = ~torch.eye(8, dtype=torch.bool)
    assert _rel(dist[off], want[off]) < 1e-9
    assert F.krum(x, 1).tolist() == x[ref_krum(x, 1)].tolist()


def test_one_huge_row_neither_overflows_nor_costs_precision():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 4000, generator=g)
    x[4] = 1e20
    dist = F.pairwise_sq_distances(x)
    assert torch.isfinite(dist).all()
    off = ~torch.eye(9, dtype=torch.bool)
    assert _rel(dist[off], ref_dist(x)[off]) < 1e-12
    out = F.krum(x, 2)
    assert torch.isfinite(out).all() and not torch.equal(out, x[4])


def test_float64_rows_beyond_1e154_are_recomputed():
    x = torch.tensor([[1e200, 0.0], [0.0, 1.0], [0.0, 2.0], [1.0, 0.0]], dtype=torch.float64)
    dist = F.pairwise_sq_distances(x)
    assert float(dist[0, 1]) > 1e300 and dist[1, 2] == 1.0 and dist[1, 3] == 2.0  # 1e400 saturates


# --- distances and selections -------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1])
def test_distances_match_per_pair_differences(seed):
    for x, _ in _cases(seed):
        dist, want = F.pairwise_sq_distances(x), ref_dist(x)
        assert torch.allclose(dist, want, rtol=1e-12, atol=1e-12 * float(want.max()))
        assert torch.allclose(dist, pairwise_sq_distances_reference(x), rtol=1e-12, atol=1e-12 * float(want.max()))


def test_duplicated_rows_tie_exactly():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 1000, generator=g)
    x[5] = x[2]
    x[7] = x[2]
    dist = F.pairwise_sq_distances(x)
    assert dist[2, 5] == 0 and dist[5, 7] == 0
    assert torch.equal(dist[2, [0, 1, 3, 4, 6]], dist[5, [0, 1, 3, 4, 6]])
    assert torch.equal(dist[2, [0, 1, 3, 4, 6]], dist[7, [0, 1, 3, 4, 6]])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_selections_match_the_reference(seed):
    for x, f in _cases(seed):
        n = x.shape[0]
        dist = F.pairwise_sq_distances(x)
        assert torch.equal(F.krum(x, f), x[ref_krum(x, f)])
        chosen = ref_multi_krum(x, f, n - f)
        got = torch.sort(F.krum_scores(dist, f), stable=True).indices[:n - f].tolist()
        assert sorted(got) == sorted(chosen)
        mk = F.multi_krum(x, f)
        want = x[chosen].double().mean(dim=0)
        assert float((mk.double() - want).abs().max()) <= 4 * n * 2 ** -23 * float(x[chosen].abs().max())
        if n >= 4 * f + 3:
            assert F.bulyan_select(dist, f, n - 2 * f).tolist() == ref_bulyan(x, f)
            ref_out = F.meamed(x[ref_bulyan(x, f)], 2 * f)
            assert torch.allclose(F.bulyan(x, f), ref_out, rtol=0, atol=4 * n * 2 ** -23 * float(x.abs().max()))
        w = F.nnm_weights(dist, f)
        assert [set(torch.nonzero(row).flatten().tolist()) for row in w] == ref_nnm_sets(x, f)
        assert torch.equal(F.nnm(x, f), w.to(x.dtype) @ x)


# --- iterative rules ----------------------------------------------------------------------------------
@pytest.mark.parametrize("init", ["mean", "zero"])
def test_geometric_median_matches_the_weiszfeld_loop(init):
    for x, _ in _cases(4)[:8]:
        for nu, iters, tol in ((1e-6, 8, 0.0), (0.1, 3, 0.0), (1e-6, 100, 1e-12)):
            fast = F.geometric_median(x, nu=nu, max_iter=iters, tol=tol, init=init)
            ref = W.geometric_median_reference(x, nu=nu, max_iter=iters, tol=tol, init=init)
            assert torch.allclose(fast, ref, rtol=0, atol=1e-5 * float(x.abs().max())), (fast - ref).abs().max()


def test_centered_clipping_matches_the_clipping_loop():
    for x, _ in _cases(5)[:8]:
        for tau, iters in ((0.5, 1), (10.0, 3), (1e3, 2)):
            center = torch.randn(x.shape[1], generator=torch.Generator().manual_seed(9))
            fast = F.centered_clipping(x, tau, iters, center)
            ref = W.centered_clipping_reference(x, tau, iters, center)
            assert torch.allclose(fast, ref, rtol=0, atol=1e-5 * float(x.abs().max()) + 1e-5 * tau)


def test_geometric_median_with_a_huge_row_stays_with_the_bulk():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(9, 3000, generator=g)
    x[0] = 1e20
    out = F.geometric_median(x, max_iter=50, tol=0.0)
    assert torch.isfinite(out).all() and float(out.abs().max()) < 10.0


def test_mda_average_differs_only_by_summation_order():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(7, 500, generator=g)
    sel = F.mda_select(F.pairwise_sq_distances(x), 2)
    assert torch.allclose(F.mda(x, 2, 10_000), x[sel].mean(dim=0), rtol=0, atol=1e-6)


def test_gram_kernels_reject_nan_and_inf_rows_from_the_gram_diagonal():
    import robustagg as ra

    x = torch.randn(7, 500, generator=torch.Generator().manual_seed(10))
    x[3, 17] = float("nan")
    x[5, 0] = float("-inf")
    for call in (lambda: F.krum(x, 1), lambda: F.multi_krum(x, 1), lambda: F.geometric_median(x),
                 lambda: F.nnm(x, 1), lambda: F.centered_clipping(x, 1.0, 2, torch.zeros(500))):
        with pytest.raises(ra.NonFiniteInputError, match=r"rows \[3, 5\]"):
            call()


def test_warm_up_compiles_the_kernel_for_both_dtypes_and_layouts():
    from robustagg.functional._gram_kernel import gram_upper

    G.warm_up()
    seen = {(str(sig[0].dtype), sig[0].layout) for sig in gram_upper.signatures}
    assert {("float32", "C"), ("float32", "A"), ("float64", "C"), ("float64", "A")} <= seen


def test_weighted_rules_rescale_rows_whose_float64_squares_overflow():
    # float64 rows beyond ~1e154 overflow the Gram (1e200^2 = 1e400); an exact power-of-two rescaling
    # keeps the convex coefficients finite instead of NaN.
    x = torch.tensor([[0.0, 0.0], [1.0, 0.0], [1e200, 0.0]], dtype=torch.float64)
    # one clipping step from 0 with tau = 10: clip factors 1, 1, 10 / 1e200 ->
    # v = (0 + (1, 0) + (10 / 1e200) (1e200, 0)) / 3 = (11 / 3, 0)
    out = F.centered_clipping(x, 10.0, 1, torch.zeros(2, dtype=torch.float64))
    assert out.tolist() == pytest.approx([11 / 3, 0.0], rel=1e-12)
    # 1-D geometric median of {0, 2, 1e200} is the middle point 2 (Weiszfeld from zero reaches it)
    x[1, 0] = 2.0
    assert F.geometric_median(x, 1e-6, 100, 1e-10, "zero").tolist() == pytest.approx([2.0, 0.0], rel=1e-9)
