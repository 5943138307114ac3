"""CAF, SMEA, MoNNA, CGE, DnC: hand-computed cases, the Gram-space identities, DnC's generator state.

The float64 references, the properties and the error messages of these rules are checked with every
other rule through the rule database (tests/rule_db.py); this file holds what is specific to them.
"""

from __future__ import annotations

import io
import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

import reference as R
from rule_db import make_input
import robustagg as ra
from robustagg.functional import spectral as S

F64 = torch.float64


def _t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


# --- CGE -----------------------------------------------------------------------------------------------
def test_cge_by_hand():
    x = _t([[1.0, 0.0], [0.0, 2.0], [3.0, 4.0], [-1.0, 0.0]])  # norms 1, 2, 5, 1
    assert ra.CGE(f=1)(x).tolist() == pytest.approx([0.0, 2.0 / 3.0], abs=1e-15)  # rows 0, 3, 1
    assert ra.CGE(f=0)(x).tolist() == pytest.approx([0.75, 1.5], abs=1e-15)  # the mean
    w = ra.CGE(f=1).weights(x)
    assert w.tolist() == pytest.approx([1 / 3, 1 / 3, 0.0, 1 / 3])


def test_cge_equal_norms_keep_the_lower_rows():
    x = _t([[0.0, 1.0], [1.0, 0.0], [0.0, -1.0]])  # all norms 1: rows 0 and 1 stay
    assert ra.CGE(f=1)(x).tolist() == [0.5, 0.5]


def test_cge_is_not_translation_equivariant():
    # Declared so in the rule database; the witness: shifting by c changes which row is longest.
    x = _t([[0.0], [1.0], [3.0]])
    assert ra.CGE(f=1)(x).item() == 0.5  # drops 3
    assert ra.CGE(f=1)(x - 3.0).item() + 3.0 == 2.0  # rows -3, -2, 0: drops -3, keeps 1 and 3


# --- MoNNA ---------------------------------------------------------------------------------------------
def test_monna_by_hand():
    x = _t([[0.0], [1.0], [-3.0], [10.0], [2.0]])
    assert ra.MoNNA(f=2)(x).item() == 1.0  # distances to row 0: 0, 1, 3, 10, 2 -> rows 0, 1, 4
    assert ra.MoNNA(f=2, trusted=3)(x).item() == pytest.approx(13.0 / 3.0)  # rows 3, 4, 1
    assert ra.MoNNA(f=2, trusted=3).weights(x).tolist() == pytest.approx([0, 1 / 3, 0, 1 / 3, 1 / 3])


def test_monna_keeps_the_trusted_row_even_among_copies():
    x = _t([[5.0], [5.0], [5.0], [0.0], [9.0]])
    sel = ra.functional.ranked.monna_select(x, 3, trusted=2)
    assert sel.tolist() == [2, 0]  # the trusted row first, then the lowest-index copy at distance 0


def test_monna_depends_on_which_row_is_trusted():
    # Declared not permutation invariant: the trusted row is picked by position.
    x = _t([[0.0], [1.0], [10.0]])
    assert ra.MoNNA(f=1, trusted=0)(x).item() == 0.5
    assert ra.MoNNA(f=1, trusted=0)(x.flip(0)).item() == 5.5  # now 10 is trusted


# --- SMEA ----------------------------------------------------------------------------------------------
def test_smea_by_hand_one_dimension():
    # In 1-D the top eigenvalue is the variance: {0, 1, 3} has 14/9, every set with 10 more.
    x = _t([[0.0], [1.0], [3.0], [10.0]])
    assert ra.SMEA(f=1)(x).item() == pytest.approx(4.0 / 3.0, abs=1e-15)
    y = _t([[0.0], [1.0], [3.0], [10.0], [12.0]])  # f = 2: {0, 1, 3} (14/9) beats {3, 10, 12} (402/27)
    assert ra.SMEA(f=2)(y).item() == pytest.approx(4.0 / 3.0, abs=1e-15)


def test_smea_by_hand_two_dimensions():
    x = _t([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [9.0, 9.0]])
    # {0, 1, 2}: covariance [[2/9, -1/9], [-1/9, 2/9]], eigenvalues 1/3 and 1/9.
    assert ra.SMEA(f=1)(x).tolist() == pytest.approx([1 / 3, 1 / 3], abs=1e-15)


def test_smea_gram_eigenvalue_is_the_covariance_eigenvalue():
    # The (n - f) x (n - f) centred Gram block / k has the covariance's top eigenvalue (explicit d x d here).
    rng = np.random.default_rng(3)
    x = rng.normal(size=(6, 4)) * 3.0 + 100.0
    g = ra.functional.gram.robust_gram(torch.tensor(x))
    rows = [0, 2, 3, 5]
    k = len(rows)
    h = torch.eye(k, dtype=F64) - 1.0 / k
    lam_gram = float(torch.linalg.eigvalsh(h @ g[rows][:, rows] @ h / k)[-1])
    sub = x[rows]
    cov = (sub - sub.mean(0)).T @ (sub - sub.mean(0)) / k
    assert lam_gram == pytest.approx(float(np.linalg.eigvalsh(cov)[-1]), rel=1e-10)


def _exact_smea_1d(values, f: int) -> tuple[tuple[int, ...], Fraction]:
    """SMEA in exact rational arithmetic in 1-D (the top eigenvalue is the variance): first subset, mean."""
    best = None
    for sub in itertools.combinations(range(len(values)), len(values) - f):
        v = [Fraction(values[i]) for i in sub]
        mu = sum(v) / len(v)
        var = sum((a - mu) ** 2 for a in v) / len(v)
        if best is None or var < best[0]:  # strict: the first subset among equal variances stays
            best = (var, sub, mu)
    return best[1], best[2]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("values, f, want", [
    # The reproducer: {0, 1, 2} = (1, 1, 3) and {0, 1, 3} = (1, 1, -1) both have variance
    # 8/9 (deviations -2/3, -2/3, 4/3 and their negatives); the others 8/3. The first wins: 5/3.
    ([1.0, 1.0, 3.0, -1.0], 1, (0, 1, 2)),
    ([5.0, 5.0, 7.0, 3.0], 1, (0, 1, 2)),           # the same shifted by 4: 17/3
    ([0.5, 0.5, 1.5, -0.5], 1, (0, 1, 2)),          # halved: 5/6
    ([2.0, 0.0, 0.0, -2.0], 1, (0, 1, 2)),          # (2, 0, 0) and (0, 0, -2) tie at 8/9: 2/3
    ([3.0, -1.0, 1.0, 1.0], 1, (0, 2, 3)),          # (3, 1, 1) and (-1, 1, 1) tie at 8/9: 5/3
    ([0.0, 1.0, 1.0, 2.0], 1, (0, 1, 2)),           # (0, 1, 1) and (1, 1, 2) tie at 2/9: 2/3
    ([-3.0, -1.0, 1.0, 3.0, 10.0], 2, (0, 1, 2)),   # (-3, -1, 1) and (-1, 1, 3) tie at 8/3: -1
    ([-4.0, -1.0, 0.0, 2.0, 3.0], 2, (1, 2, 3)),    # (-1, 0, 2) and (0, 2, 3) tie at 14/9: 1/3
])
def test_smea_exact_ties_go_to_the_first_subset(values, f, want, dtype):
    assert _exact_smea_1d(values, f)[0] == want
    x = torch.tensor([[v] for v in values], dtype=dtype)
    mean = sum(values[i] for i in want) / len(want)
    assert ra.SMEA(f=f)(x).item() == pytest.approx(mean, abs=1e-6 if dtype == torch.float32 else 1e-15)
    w = ra.SMEA(f=f).weights(x)
    assert torch.nonzero(w).flatten().tolist() == list(want)
    assert R.smea(x, f).item() == pytest.approx(mean, abs=1e-6 if dtype == torch.float32 else 1e-15)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_smea_exact_tie_in_two_dimensions(dtype):
    # The centre and the four unit vectors: dropping the centre leaves covariance diag(1/2, 1/2);
    # dropping (1, 0) leaves x-deviations (1, 1, -3, 1)/4 (variance 3/16) and y-values 0, 1, 0, -1
    # (variance 1/2, no covariance); likewise for every vertex. All five subsets have top eigenvalue
    # exactly 1/2: the first, {0, 1, 2, 3}, wins, with mean (0, 1/4).
    x = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]], dtype=dtype)
    assert ra.SMEA(f=1)(x).tolist() == [0.0, 0.25]
    assert R.smea(x, 1).tolist() == [0.0, 0.25]


@pytest.mark.parametrize("dtype, step", [(torch.float64, 2.0**-51), (torch.float32, 2.0**-22)])
def test_smea_a_difference_below_rounding_is_not_a_tie(dtype, step):
    # (0, 0, 2 + step, -2): 2 + step is the next representable value after 2. The variance of
    # (0, 0, 2 + step) is 2 (2 + step)^2 / 9, just above the 8/9 of (0, 0, -2) (relatively 1 + step),
    # so {0, 1, 3} is strictly the smallest, although the first subset is {0, 1, 2}: mean -2/3.
    values = [0.0, 0.0, 2.0 + step, -2.0]
    assert _exact_smea_1d(values, 1)[0] == (0, 1, 3)
    x = torch.tensor([[v] for v in values], dtype=dtype)
    assert torch.nonzero(ra.SMEA(f=1).weights(x)).flatten().tolist() == [0, 1, 3]
    assert R.smea(x, 1).item() == pytest.approx(-2 / 3, abs=1e-15)


def test_smea_enumerates_beyond_one_batch(monkeypatch):
    # The best subset in a later batch must win over the first batch's best.
    monkeypatch.setattr(S, "SMEA_BATCH", 2)
    x = _t([[50.0], [0.0], [1.0], [2.0], [40.0]])  # best triple {1, 2, 3} is the 7th of C(5, 3) = 10
    assert S.smea_select(ra.functional.gram.robust_gram(x), 2).tolist() == [1, 2, 3]


# --- CAF -----------------------------------------------------------------------------------------------
def test_caf_by_hand():
    # x = 0, 2, 4, 100 (f = 1): iterate 1 is the mean 26.5 (deviations 26.5, 24.5, 22.5, 73.5);
    # tau = squared deviations, c_i = 1 - tau_i / 73.5^2 = (4700, 4802, 4896, 0) / 5402.25; the sum
    # 2.665 > n - 2f = 2, so iterate 2 is (2*4802 + 4*4896) / (4700 + 4802 + 4896) = 29188/14398,
    # whose weighted variance (2.66) is the smallest; its update leaves a total weight below 2.
    x = _t([[0.0], [2.0], [4.0], [100.0]])
    assert ra.CAF(f=1)(x).item() == pytest.approx(29188.0 / 14398.0, rel=1e-13)
    w = ra.CAF(f=1).weights(x)
    assert w.tolist() == pytest.approx([4700 / 14398, 4802 / 14398, 4896 / 14398, 0.0], rel=1e-12, abs=1e-15)


def _caf_iterations_tau_max_over_all_rows(x: np.ndarray, f: int) -> int:
    """Iterates of CAF's loop when tau_max is taken over every row, zero weights included (ByzFL's reading).

    Exact top eigenpairs (numpy ``eigh`` of the d x d weighted covariance); the loop runs while sum c > n - 2f.
    """
    n = x.shape[0]
    c, count = np.ones(n), 0
    while c.sum() > n - 2 * f:
        mu = c @ x / c.sum()
        diffs = x - mu
        v = np.linalg.eigh((c[:, None] * diffs).T @ diffs / c.sum())[1][:, -1]
        tau = (diffs @ v) ** 2
        c = c * (1 - tau / tau.max())
        count += 1
    return count


def test_caf_tau_max_over_positive_weights_bounds_the_loop(monkeypatch):
    # Nine N(0, I_5) rows and one at distance s along (1, ..., 1): the far row's weight goes to 0 in
    # the first iterate. With tau_max over every row it keeps the largest tau, each iterate scales
    # the other weights by 1 - tau_i / tau_far ~ 1 - 1/s^2, and the loop runs ~s^2 times (the numbers
    # in docs/conventions.md); over rows of positive weight, at most n = 10 iterates.
    h = np.random.default_rng(0).normal(size=(9, 5))
    calls = []
    real = S.top_eigenpair
    monkeypatch.setattr(S, "top_eigenpair", lambda m: calls.append(1) or real(m))
    for s, loop in ((10, 8), (100, 892), (300, 6969)):
        x = np.vstack([h, s * np.ones((1, 5)) / math.sqrt(5)])
        assert _caf_iterations_tau_max_over_all_rows(x, 2) == loop
        calls.clear()
        assert np.allclose(ra.CAF(f=2)(torch.tensor(x)).numpy(), R.caf(x, 2), rtol=0, atol=1e-12)
        assert 1 <= len(calls) <= 10


def test_caf_with_f_zero_is_the_mean():
    x = torch.tensor(np.random.default_rng(1).normal(size=(7, 5)))
    assert torch.allclose(ra.CAF(f=0)(x), x.mean(0), rtol=0, atol=1e-14)


def test_caf_stops_on_identical_rows():
    # lam = 0 at the first iterate: nothing to filter, the mean is returned (no division by zero).
    x = _t([[1.5, -2.0]] * 5)
    assert ra.CAF(f=2)(x).tolist() == pytest.approx([1.5, -2.0], abs=1e-15)


def test_caf_weights_are_convex_and_zero_the_far_rows():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(11, 6))
    x[[2, 7]] += 1e3
    w = ra.CAF(f=2).weights(torch.tensor(x))
    assert float(w.min()) >= 0.0 and float(w.sum()) == pytest.approx(1.0, abs=1e-14)
    assert w[2] == 0.0 and w[7] == 0.0


def test_caf_projection_scores_from_the_gram_matrix():
    # tau_i = (K W^1/2 u)_i^2 / lam equals <x_i - mu, v>^2 with v the covariance's top eigenvector.
    rng = np.random.default_rng(8)
    x = rng.normal(size=(7, 3))
    c = rng.uniform(0.2, 1.0, size=7)
    w = torch.tensor(c / c.sum())
    k = S._centred(torch.tensor(x @ x.T), w)
    root = w.sqrt()
    lam, u = S.top_eigenpair(root[:, None] * k * root[None, :])
    tau = ((k @ (root * u)) ** 2 / lam).numpy()
    mu, lam_ref, v = R.top_direction(x, c)
    assert lam == pytest.approx(lam_ref, rel=1e-12)
    assert np.allclose(tau, ((x - mu) @ v) ** 2, rtol=1e-10, atol=1e-14)


# --- DnC -----------------------------------------------------------------------------------------------
def test_dnc_by_hand():
    x = _t([[0.0, 1.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [40.0, 40.0]])
    assert ra.DnC(f=1)(x).tolist() == [0.5, 0.5]
    assert ra.DnC(f=1, sub_dim=1, iterations=4)(x).tolist() == [0.5, 0.5]  # any one coordinate drops row 4


def _rounds(seed: int, d: int, b: int, iterations: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [S.dnc_coordinates(d, b, gen).tolist() for _ in range(iterations)]


def test_dnc_intersects_the_rounds():
    # Coordinate 0 alone drops row 2 (score 64), coordinate 1 alone drops row 1: rows kept by every
    # round are {0, 3, 4} (mean (0, 0)) once both coordinates were drawn, else {0, 1, 3, 4} or {0, 2, 3, 4}.
    x = _t([[0.0, 0.0], [0.0, 10.0], [10.0, 0.0], [1.0, 1.0], [-1.0, -1.0]])
    seen = set()
    for seed in range(6):
        coords = {c for r in _rounds(seed, 2, 1, 2) for c in r}
        want = [0.0, 0.0] if coords == {0, 1} else ([0.0, 2.5] if coords == {0} else [2.5, 0.0])
        assert ra.DnC(f=1, sub_dim=1, iterations=2, seed=seed)(x).tolist() == want, seed
        seen.add(frozenset(coords))
    assert frozenset({0, 1}) in seen and len(seen) >= 2  # both branches exercised


def test_dnc_empty_intersection_keeps_the_rows_kept_most_often():
    # Coordinate j drops row j (its value 10 against 0, 0): over rounds drawing 0, 1 and 2 no row
    # is kept by every round; each is kept 2 of 3 times, so all three are averaged.
    x = _t([[10.0, 0.0, 0.0], [0.0, 10.0, 0.0], [0.0, 0.0, 10.0]])
    seed = next(s for s in range(200) if sorted(c for r in _rounds(s, 3, 1, 3) for c in r) == [0, 1, 2])
    out = ra.DnC(f=1, sub_dim=1, iterations=3, seed=seed)(x)
    assert out.tolist() == pytest.approx([10 / 3] * 3)
    # and with two rounds on coordinates {0, 1}, only row 2 is kept twice
    seed2 = next(s for s in range(200) if sorted(c for r in _rounds(s, 3, 1, 2) for c in r) == [0, 1])
    assert ra.DnC(f=1, sub_dim=1, iterations=2, seed=seed2)(x).tolist() == [0.0, 0.0, 10.0]


@pytest.mark.parametrize("d,b", [(10, 4), (10, 3), (1000, 7), (5, 9)])
def test_dnc_coordinates_are_distinct_sorted_and_seeded(d, b):
    # Both samplers: randperm when 4b >= d, rounds of randint otherwise.
    a = _rounds(11, d, b, 3)
    assert a == _rounds(11, d, b, 3)
    for cols in a:
        assert len(cols) == min(b, d) and cols == sorted(set(cols)) and 0 <= cols[0] and cols[-1] < d
    if b < d:
        assert len({tuple(c) for c in a}) > 1 or d <= b  # successive rounds draw fresh coordinates


def test_dnc_state_round_trip_and_reset():
    x = torch.tensor(np.random.default_rng(2).normal(size=(9, 40)))
    x[4] += 3.0
    rule = ra.DnC(f=2, sub_dim=3, iterations=2, seed=7)
    first = rule(x)
    buf = io.BytesIO()
    torch.save(rule.state_dict(), buf)  # what a checkpoint stores
    second = rule(x)
    restored = ra.DnC(f=2, sub_dim=3, iterations=2, seed=123)
    buf.seek(0)
    restored.load_state_dict(torch.load(buf))
    assert torch.equal(restored(x), second)
    rule.reset()
    assert torch.equal(rule(x), first)
    assert rule.state_dict()["rule"] == "dnc"


def test_dnc_weights_predict_the_next_call_without_advancing():
    x = torch.tensor(np.random.default_rng(4).normal(size=(9, 30)))
    rule = ra.DnC(f=2, sub_dim=2, iterations=3, seed=1)
    before = rule.state_dict()["generator"].clone()
    w = rule.weights(x)
    assert torch.equal(rule.state_dict()["generator"], before)
    out = rule(x)
    kept = torch.nonzero(w > 0).flatten()
    assert torch.allclose(out, x[kept].mean(0), rtol=0, atol=1e-14)
    assert float(w.sum()) == pytest.approx(1.0)


def test_new_rules_are_registered_documented_and_exported():
    for name, cls in [("caf", ra.CAF), ("smea", ra.SMEA), ("monna", ra.MoNNA), ("cge", ra.CGE), ("dnc", ra.DnC)]:
        assert name in ra.available() and ra.lookup(name) is cls
        assert ra.get(name, f=1).requirement.check(3, 1) == [] and ra.get(name, f=1).requirement.check(2, 1)
        assert math.isnan(cls(f=1).requirement.kappa_bound(5, 1))  # no kappa bound recorded


def test_dnc_exact_ties_go_to_the_lower_index_whatever_the_rounding():
    # x = 0, 2, 1, 3: scores 2.25, 0.25, 0.25, 2.25 in exact arithmetic; rows 0 and 3 tie for the
    # drop, and the higher index goes (mean of 0, 2, 1 = 1), even when the eigenvector's rounding
    # makes u_0^2 exceed u_3^2 (seen in float32).
    for dtype in (torch.float32, torch.float64):
        x = torch.tensor([[0.0], [2.0], [1.0], [3.0]], dtype=dtype)
        assert ra.DnC(f=1)(x).item() == 1.0
    assert S.rank_with_ties(torch.tensor([2.25, 0.25, 0.25 + 1e-15, 2.25 - 1e-15], dtype=F64)).tolist() == [1, 2, 0, 3]


def test_caf_zeroes_every_copy_of_the_farthest_row():
    # The seed-found case: duplicated rows tied for the largest tau. Rounding in the Gram space
    # left one copy a weight ~1e-16, which then set tau_max for the next step; all copies must go.
    rng = np.random.default_rng(12345)
    for _ in range(200):
        f = int(rng.integers(0, 3))
        n = int(rng.integers(2 * f + 1, 2 * f + 7))
        x = torch.tensor(make_input("dups", n, 1, f, int(rng.integers(0, 2**32))))
        assert np.allclose(ra.CAF(f=f)(x).numpy(), R.caf(x, f), rtol=0, atol=1e-12 * (1 + float(x.abs().max())))


@pytest.mark.parametrize("d,b", [(50, 5), (1000, 100)], ids=["randperm", "randint"])
def test_dnc_coordinates_are_uniform(d, b):
    # Each coordinate is drawn with probability b/d; over 4000 seeded draws the frequencies stay
    # within 5 binomial standard deviations (a sampler favouring small indices fails this).
    gen = torch.Generator().manual_seed(0)
    count = torch.zeros(d)
    for _ in range(4000):
        count[S.dnc_coordinates(d, b, gen)] += 1
    p = b / d
    sd = math.sqrt(p * (1 - p) / 4000)
    freq = count / 4000
    assert float((freq - p).abs().max()) < 5 * sd, (float(freq.min()), float(freq.max()))


def test_smea_bounds_are_lower_bounds():
    rng = np.random.default_rng(21)
    for kind in ("gauss", "outliers", "dups"):
        x = make_input(kind, 9, 4, 3, int(rng.integers(0, 2**32)))
        g = ra.functional.gram.robust_gram(torch.tensor(x))
        left = torch.combinations(torch.arange(9), r=3)
        kept, ind = S._kept(left, 9)
        lb = S._smea_lower_bounds(g, ind, 6)[0]
        for s, bound in zip(kept.tolist(), lb.tolist()):
            assert bound <= R.top_direction(x[s])[1] * (1 + 1e-12) + 1e-300, (kind, s)


def test_smea_pruning_skips_subsets_with_a_far_row(monkeypatch):
    # Two far rows: every subset holding one has a bound above the best clean subset's value, so
    # far fewer than C(10, 2) = 45 eigenvalue problems are solved; the answer is the exhaustive one.
    monkeypatch.setattr(S, "SMEA_BATCH", 1)
    calls = []
    real = torch.linalg.eigvalsh
    monkeypatch.setattr(torch.linalg, "eigvalsh", lambda m: calls.append(1) or real(m))
    x = make_input("gauss", 10, 5, 0, 4)
    big = 1e3 * float(np.abs(x).max())
    x[3] += big
    x[8] -= big
    out = ra.SMEA(f=2)(torch.tensor(x))
    assert np.allclose(out.numpy(), R.smea(x, 2), rtol=0, atol=1e-12)
    assert 1 <= len(calls) < 45, len(calls)
