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


def _sorted_credit_reference(x, positions, per_position):
    """The shares as issue 19's first round computed them: stable sort, then the general tie split."""
    from robustagg.functional import weights as W

    n, d = x.shape
    counts = torch.zeros(n, dtype=torch.float64)
    kept = torch.zeros(n, 1, dtype=torch.float64)
    kept[positions] = per_position
    chunk = max(1, W._CHUNK_ELEMENTS // n)
    for s in range(0, d, chunk):
        values, order = torch.sort(x[:, s:s + chunk], dim=0, stable=True)
        counts += W._credit_split_over_ties(values, order, kept.expand_as(values))
    return counts / d


@pytest.mark.parametrize("chunk", [1 << 20, 64])  # one chunk, and many (the sum over chunks)
def test_order_statistic_shares_are_bitwise_the_sort_and_tie_split(chunk, monkeypatch):
    """The run-table form of the median / trimmed-mean shares gives the general form's float64 bits,
    on inputs full of exact ties (integers, whole zero columns, constant columns) and without."""
    from robustagg.functional import weights as W

    monkeypatch.setattr(W, "_CHUNK_ELEMENTS", chunk)
    g = torch.Generator().manual_seed(19)
    for n in (1, 2, 3, 5, 10, 20, 100):
        d = 700
        cases = [torch.randn(n, d, generator=g), torch.randint(-2, 3, (n, d), generator=g).double(),
                 torch.randint(0, 2, (n, d), generator=g).float()]
        cases[0][:, :100] = 0.0  # dead units: every worker's coordinate is exactly 0
        cases[1][:, 100:150] = 7.0
        for x in cases:
            f = n // 5
            lo, hi = (n - 1) // 2, n // 2
            for pos, per in ((list(range(f, n - f)), 1.0 / (n - 2 * f)), ([lo] if lo == hi else [lo, hi],
                                                                          1.0 if lo == hi else 0.5)):
                got = W.order_statistic_weights(x, pos, per)
                want = _sorted_credit_reference(x, pos, per)
                assert got.dtype == torch.float64 and torch.equal(got, want), (n, pos)
    # the rules call it: CWTM and the median on the module's matrix X
    assert ra.CoordinateWiseTrimmedMean(f=1).weights(X).tolist() == _sorted_credit_reference(
        X, [1, 2, 3], 1.0 / 3).tolist()
