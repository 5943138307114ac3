"""The shared reference cases (tests/data/aggregators.json) and hand-computed vectors.

Every expected value in the JSON file is asserted to 1e-9 in float64 (the geometric-median case to
its own tolerance, with the default GeometricMedian()), every error case raises AssumptionError
with the inequality, n, f and the fix in its message.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

import robustagg as ra

DATA = json.loads((Path(__file__).parent / "data" / "aggregators.json").read_text())
CASES = DATA["cases"]
TOL = 1e-9

pytestmark = pytest.mark.filterwarnings("ignore::robustagg.AssumptionWarning")


def _x(name: str) -> torch.Tensor:
    return torch.tensor(DATA["datasets"][name], dtype=torch.float64)


def _case_id(case: dict) -> str:
    return case["rule"] + "(" + ",".join(f"{k}={v}" for k, v in case["params"].items()) + ")"


def _build(case: dict):
    params = dict(case["params"])
    rule = case["rule"]
    if rule == "geometric_median":
        assert params == {"converged": True}
        return ra.GeometricMedian()  # the defaults must give a converged geometric median
    if rule == "centered_clipping":
        center = torch.tensor(params.pop("center"), dtype=torch.float64)
        cc = ra.get(rule, **params)
        cc.load_state_dict({"rule": "centered_clipping", "center": center})
        return cc
    return ra.get(rule, **params)


def test_every_case_is_exercised():
    # Guard against a silently shrunken file: 13 cases and 3 error cases when written.
    assert len(CASES) >= 13 and len(DATA["errors"]) >= 3
    assert {c["rule"] for c in CASES} >= {"mean", "coordinate_median", "trimmed_mean", "krum", "multi_krum", "nnm",
                                          "nnm>mean", "nnm>trimmed_mean", "geometric_median", "centered_clipping",
                                          "bulyan"}


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_reference_case(case):
    x = _x(case["data"])
    x_before = x.clone()
    rule = _build(case)
    out = rule(x)
    tol = case.get("tolerance", TOL)
    assert torch.equal(x, x_before)
    if "expected_rows" in case:
        expected = torch.tensor(case["expected_rows"], dtype=torch.float64)
        assert out.shape == expected.shape
    else:
        expected = torch.tensor(case["expected"], dtype=torch.float64)
        assert out.shape == (x.shape[1],)
    assert out.dtype == torch.float64
    assert torch.allclose(out, expected, rtol=0.0, atol=tol), (out.tolist(), expected.tolist())
    if "scores" in case:
        scores = ra.Krum(f=case["params"]["f"]).scores(x)
        assert torch.allclose(scores.double(), torch.tensor(case["scores"], dtype=torch.float64), rtol=0, atol=TOL)


def test_krum_scores_by_hand():
    # D1 rows: (4,4) (3,1) (4,0) (2,2) (2,3) (10,10) (10,8); f = 2 -> n - f - 2 = 3 neighbours.
    # Row 1 = (3,1): squared distances to the others 10, 2, 2, 5, 130, 98 -> 2 + 2 + 5 = 9.
    # Row 3 = (2,2): to the others 8, 2, 8, 1, 128, 100 -> 1 + 2 + 8 = 11.
    scores = ra.Krum(f=2).scores(_x("D1"))
    assert scores[1].item() == 9.0 and scores[3].item() == 11.0


@pytest.mark.parametrize("err", DATA["errors"], ids=lambda e: f"{e['rule']}(n={e['n']},f={e['f']})")
def test_reference_error_case(err):
    n, f = err["n"], err["f"]
    inequality = re.search(r"n >= \d*f \+ \d+", err["why"]).group(0)
    rule = ra.get(err["rule"], f=f)
    x = torch.arange(n * 2, dtype=torch.float64).reshape(n, 2)
    pattern = (re.escape(inequality) + r" \([^)]+\); got " + re.escape(f"n={n}, f={f}.") +
               r" Lower f, add workers, or pass strict=False to study breakdown\.$")
    with pytest.raises(ra.AssumptionError, match=pattern) as info:
        rule(x)
    assert isinstance(info.value, ValueError)
    with pytest.raises(ra.AssumptionError, match=pattern):
        rule.check(n)  # usable before any process starts
    assert re.search(re.escape(err["why"].split(" needs")[0]) + " requires", str(info.value), re.IGNORECASE)
    ok_n = {"krum": 2 * f + 3, "bulyan": 4 * f + 3, "trimmed_mean": 2 * f + 1}[err["rule"]]
    assert rule.check(ok_n) == []
    with pytest.raises(ra.AssumptionError):
        rule.check(ok_n - 1)  # the bound is exactly where the inequality says


# --- hand-computed vectors beyond the shared file ------------------------------------------------
X5 = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [9.0, 9.0], [1.0, 1.0]], dtype=torch.float64)


def test_even_n_median_averages_the_two_middles():
    x = torch.tensor([[1.0, 9.0], [2.0, 0.0], [4.0, 1.0], [100.0, 3.0]], dtype=torch.float64)
    # column 0 sorted 1 2 4 100 -> (2 + 4)/2 = 3; column 1 sorted 0 1 3 9 -> (1 + 3)/2 = 2.
    assert ra.CoordinateWiseMedian(f=1)(x).tolist() == [3.0, 2.0]


def test_meamed_by_hand():
    x = torch.tensor([[1.0, 9.0], [2.0, 0.0], [4.0, 1.0], [100.0, 3.0], [5.0, 5.0]], dtype=torch.float64)
    # f = 1 keeps n - f = 4 values closest to the median.
    # column 0: median 4; distances 3 2 0 96 1 -> keep 1 2 4 5 -> 12/4 = 3.
    # column 1: median 3; distances 6 3 2 0 2 -> keep 0 1 3 5 -> 9/4 = 2.25.
    assert ra.MeaMed(f=1)(x).tolist() == [3.0, 2.25]


def test_meamed_tie_keeps_lower_row():
    # median 2; |1 - 2| = |3 - 2| = 1 tie: n - f = 2 keeps row 1 (value 2) and the lower tied row 0 (value 1).
    x = torch.tensor([[1.0], [2.0], [3.0]], dtype=torch.float64)
    assert ra.MeaMed(f=1)(x).tolist() == [1.5]


def test_multi_krum_tie_to_lowest_index():
    # f = 1 -> n - f - 2 = 2 neighbours. Squared distances and scores:
    # row0 (0,0): 1, 4, 162, 2 -> 1 + 2 = 3     row1 (1,0): 1, 5, 145, 1 -> 1 + 1 = 2
    # row2 (0,2): 4, 5, 130, 2 -> 2 + 4 = 6     row4 (1,1): 2, 1, 2, 128 -> 1 + 2 = 3
    # Krum = row 1; m = 2 takes row 1 then the lower of the tied rows 0 and 4: mean = (0.5, 0).
    assert ra.Krum(f=1).scores(X5).tolist() == [3.0, 2.0, 6.0, 258.0, 3.0]
    assert ra.MultiKrum(f=1, m=2)(X5).tolist() == [0.5, 0.0]
    assert ra.Krum(f=1)(X5).tolist() == [1.0, 0.0]


def test_krum_duplicates_are_neighbours():
    # Rows 0 and 1 are equal; n=5, f=1 -> 2 neighbours, the duplicate counts at distance 0:
    # row0: 0, 1, 25, 81 -> 0 + 1 = 1; row1 the same; row2 (1): 1, 1, 16, 64 -> 2;
    # row3 (5): 25, 25, 16, 16 -> 32; row4 (9): 81, 81, 64, 16 -> 80. Tie 0/1 -> row 0.
    x = torch.tensor([[0.0], [0.0], [1.0], [5.0], [9.0]], dtype=torch.float64)
    assert ra.Krum(f=1).scores(x).tolist() == [1.0, 1.0, 2.0, 32.0, 80.0]
    assert ra.Krum(f=1)(x).tolist() == [0.0]


def test_bulyan_by_hand():
    x = torch.tensor([[0.0], [1.0], [2.0], [3.0], [4.0], [5.0], [50.0]], dtype=torch.float64)
    # n=7, f=1: theta = 5 rows by iterated Krum (|R| - 3 neighbours), beta = 3 closest to the median.
    # Round 1 (4 neighbours): row 2 scores 1+1+4+4 = 10, row 3 scores 10 too -> row 2 (lower index).
    # Then rows 3, 1, 4, 0 (ties to the lower index): selected values {0,1,2,3,4}, median 2,
    # the 3 closest are 1 2 3 -> 2.
    assert ra.Bulyan(f=1)(x).tolist() == [2.0]


def test_mda_by_hand():
    # f=1: drop one row; the subset {0,1,2,4} has squared diameter 5 (between (1,0) and (0,2)),
    # every subset holding (9,9) is wider -> mean = (2/4, 3/4).
    assert ra.MinimumDiameterAveraging(f=1)(X5).tolist() == [0.5, 0.75]


def test_geometric_median_collinear_by_hand():
    # Three points on a line: the geometric median is the middle point (1, 0).
    x = torch.tensor([[0.0, 0.0], [1.0, 0.0], [7.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(ra.GeometricMedian()(x), torch.tensor([1.0, 0.0], dtype=torch.float64), atol=1e-6)


def test_centered_clipping_state_by_hand():
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [10.0, 10.0]], dtype=torch.float64)
    cc = ra.CenteredClipping(tau=1.0, iterations=1)
    # From v = 0: clip keeps e1 and e2 (norm 1), scales (10,10) to (1,1)/sqrt(2); v = sum / 3.
    a = (1.0 + 1.0 / math.sqrt(2.0)) / 3.0
    first = cc(x)
    assert torch.allclose(first, torch.tensor([a, a], dtype=torch.float64), atol=TOL)
    assert torch.equal(cc.state_dict()["center"], first)
    second = cc(x)  # starts from the stored centre, so it differs from a fresh call
    assert not torch.allclose(second, first)
    cc.reset()
    assert cc.state_dict()["center"] is None
    assert torch.allclose(cc(x), first, atol=0)


def test_clipping_and_arc_by_hand():
    x = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]], dtype=torch.float64)
    # ||(3,4)|| = 5 > 1 -> (0.6, 0.8); ||(0.3,0.4)|| = 0.5 stays; zero stays zero.
    assert torch.allclose(ra.Clipping(tau=1.0)(x), torch.tensor([[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]],
                                                               dtype=torch.float64), atol=TOL)
    y = torch.tensor([[1.0, 0.0], [0.0, 2.0], [30.0, 40.0], [3.0, 0.0]], dtype=torch.float64)
    # n=4, f=1: k = floor(2 * (1/4) * 3) = 1; the largest norm (50) is scaled to the next one (3).
    assert torch.allclose(ra.ARC(f=1)(y), torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.8, 2.4], [3.0, 0.0]],
                                                        dtype=torch.float64), atol=TOL)
    z = torch.tensor([[1.0], [2.0], [3.0], [4.0], [5.0], [6.0], [7.0], [8.0], [9.0], [10.0]], dtype=torch.float64)
    # n=10, f=2: k = floor(2 * 0.2 * 8) = floor(3.2) = 3 -> 10, 9, 8 clipped to norm 7.
    assert ra.ARC(f=2)(z).flatten().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 7.0, 7.0, 7.0]


def test_bucketing_by_hand():
    x = torch.tensor([[0.0], [1.0], [2.0], [3.0], [4.0]], dtype=torch.float64)
    perm = torch.randperm(5, generator=torch.Generator().manual_seed(3)).tolist()
    b = ra.Bucketing(s=2, generator=torch.Generator().manual_seed(3))
    out = b(x).flatten().tolist()
    # buckets of 2 consecutive permuted rows, the last one holding a single row
    assert out == [(perm[0] + perm[1]) / 2, (perm[2] + perm[3]) / 2, float(perm[4])]
