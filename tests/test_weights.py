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
