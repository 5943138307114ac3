"""Row shares (rule.weights) by hand, including equal values that must share."""

import pytest
import torch

import robustagg as ra

# Column 0: every row holds 0 (one value, shared by all five rows). Column 1: 1, 2, 3, 4, 100.
X = torch.tensor([[0.0, 1.0], [0.0, 2.0], [0.0, 3.0], [0.0, 4.0], [0.0, 100.0]], dtype=torch.float64)


def test_median_shares_split_over_equal_values():
    # col 0: weight 1 split over 5 equal rows = 0.2 each; col 1: the median 3 is row 2 -> 1.
    # averaged over the 2 columns: row 2 = (0.2 + 1) / 2 = 0.6, the others (0.2 + 0) / 2 = 0.1
    w = ra.CoordinateWiseMedian(f=1).weights(X)
    assert w.tolist() == pytest.approx([0.1, 0.1, 0.6, 0.1, 0.1])


def test_trimmed_mean_shares():
    # f = 1 keeps 3 values of 1/3 each. col 0: total 1 over 5 equal rows = 0.2 each;
    # col 1: rows 1, 2, 3 get 1/3. row 1 = (0.2 + 1/3) / 2 = 0.2667; row 0 = (0.2 + 0) / 2 = 0.1
    w = ra.CoordinateWiseTrimmedMean(f=1).weights(X)
    assert w.tolist() == pytest.approx([0.1, 4 / 15, 4 / 15, 4 / 15, 0.1])


def test_meamed_shares():
    # f = 1 keeps 4 values of 1/4. col 0: 1 over 5 rows = 0.2 each; col 1: median 3, the 4 closest
    # are 3, 2, 4, 1 (rows 2, 1, 3, 0) -> 0.25 each. row 0 = (0.2 + 0.25) / 2 = 0.225, row 4 = 0.1
    w = ra.MeaMed(f=1).weights(X)
    assert w.tolist() == pytest.approx([0.225, 0.225, 0.225, 0.225, 0.1])


@pytest.mark.parametrize("name", ["coordinate_median", "trimmed_mean", "meamed", "krum", "multi_krum",
                                  "geometric_median", "mda", "nnm>trimmed_mean"])
def test_shares_sum_to_one(name):
    x = torch.randn(9, 300, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert float(ra.get(name, f=2).weights(x).sum()) == pytest.approx(1.0)


def _shares_by_walking_runs(x, positions, per_position):
    """float64 reference: sort each column, walk its runs of equal values, share each run's credit."""
    n, d = x.shape
    out = [0.0] * n
    for j in range(d):
        col = [(float(x[i, j]), i) for i in range(n)]
        col.sort()
        p = 0
        while p < n:
            q = p
            while q < n and col[q][0] == col[p][0]:
                q += 1
            credit = sum(per_position for r in range(p, q) if r in positions)
            for r in range(p, q):
                out[col[r][1]] += credit / (q - p) / d
            p = q
    return out


@pytest.fixture(params=["numpy", "torch"])
def backend(request, monkeypatch):
    """The CPU fast path (NumPy comparisons) and the torch path that CUDA tensors take."""
    from robustagg.functional import selection

    monkeypatch.setattr(selection, "FORCE_TORCH", request.param == "torch")
    return request.param


@pytest.mark.parametrize("seed", range(6))
def test_order_statistic_shares_match_walking_the_runs(seed, backend):
    # ties everywhere (small integers, all-zero columns, -0.0 next to 0.0), n odd and even, f at its bound
    from robustagg.functional.weights import order_statistic_weights

    g = torch.Generator().manual_seed(seed)
    n = 3 + seed
    x = torch.randint(-2, 3, (n, 40), generator=g).to(torch.float32)
    x[:, :5] = 0.0
    x[0, :5] = -0.0
    x[:, 5:10] = torch.randn(n, 5, generator=g)
    for f in range(0, (n - 1) // 2 + 1):
        positions = list(range(f, n - f))
        got = order_statistic_weights(x, positions, 1.0 / len(positions))
        assert got.tolist() == pytest.approx(_shares_by_walking_runs(x, positions, 1.0 / len(positions)), abs=1e-14)
    lo, hi = (n - 1) // 2, n // 2  # the median's middles
    got = order_statistic_weights(x, [lo, hi] if lo != hi else [lo], 0.5 if lo != hi else 1.0)
    assert got.tolist() == pytest.approx(
        _shares_by_walking_runs(x, [lo, hi] if lo != hi else [lo], 0.5 if lo != hi else 1.0), abs=1e-14)


@pytest.mark.parametrize("seed", range(4))
def test_order_statistic_shares_with_gaps_match_walking_the_runs(seed, backend):
    # a rule that keeps the two extremes of its trimmed set (the how-to's trimmed mid-range) credits
    # two separate positions; any set of positions splits into ranges, each credited on its own
    from robustagg.functional.weights import order_statistic_weights

    g = torch.Generator().manual_seed(10 + seed)
    n = 5 + seed
    x = torch.randint(-1, 2, (n, 30), generator=g).to(torch.float64)
    x[:, 10:] = torch.randn(n, 20, generator=g, dtype=torch.float64)
    for positions in ([1, n - 2], [0, 2, 3], [0, n - 1], list(range(0, n, 2)), [n - 1]):
        want = _shares_by_walking_runs(x, set(positions), 0.5)
        assert order_statistic_weights(x, positions, 0.5).tolist() == pytest.approx(want, abs=1e-14)
    # a repeated position is credited once
    assert order_statistic_weights(x, [2, 2, 3], 0.5).tolist() == pytest.approx(
        order_statistic_weights(x, [2, 3], 0.5).tolist(), abs=1e-15)


def test_order_statistic_shares_refuse_positions_outside_the_rows():
    from robustagg.functional.weights import order_statistic_weights

    with pytest.raises(ValueError, match=r"inside \[0, 5\)"):
        order_statistic_weights(torch.zeros(5, 3), [3, 4, 5], 0.5)
    with pytest.raises(ValueError, match="non-empty"):
        order_statistic_weights(torch.zeros(5, 3), [], 0.5)
    with pytest.raises(ValueError, match=r"inside \[0, 5\)"):
        order_statistic_weights(torch.zeros(5, 3), [-1, 0], 0.5)
