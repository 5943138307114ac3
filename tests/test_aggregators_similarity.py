"""SignGuard, ClippedClustering, FLAME, FLTrust, FoolsGold: hand-computed cases, state, seeds, memory.

The generic property and float64-reference tests of the rule database cover these rules too
(``tests/rule_db.py``); this file checks what is specific to them: values worked out by hand,
the explicit state of the stateful and seeded rules, FLTrust's two ways of receiving the trusted
update, the multi-step FoolsGold history against its reference, and the memory of a wide call.
"""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference as R
import robustagg as ra
from rule_db import examples, make_input
from test_aggregators_numerics import _peak_rss_bytes, _peak_rss_reset

pytestmark = pytest.mark.filterwarnings("ignore::robustagg.AssumptionWarning")

S2, S5 = math.sqrt(2.0), math.sqrt(5.0)


def _t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


# --- SignGuard ------------------------------------------------------------------------------------
def test_signguard_norm_band_by_hand():
    # norms sqrt2, sqrt5, sqrt5, 50: median M = sqrt5; 50/sqrt5 = 22.4 > 3 drops the last row. Every
    # row has the same signs, so the features coincide and MeanShift sees one cluster.
    x = _t([[1.0, 1.0], [1.0, 2.0], [2.0, 1.0], [30.0, 40.0]])
    out = ra.SignGuard(f=1, fraction=1.0)(x)
    assert torch.allclose(out, _t([4 / 3, 4 / 3]), rtol=0, atol=1e-12)
    # A wider band keeps it, clipped to norm M: (30, 40) * sqrt5 / 50 = (0.6 sqrt5, 0.8 sqrt5).
    out = ra.SignGuard(f=1, fraction=1.0, upper=30.0)(x)
    assert torch.allclose(out, _t([(4 + 0.6 * S5) / 4, (4 + 0.8 * S5) / 4]), rtol=0, atol=1e-12)


def test_signguard_lower_band_and_clipping_by_hand():
    # norms 0.01 sqrt2, sqrt2, sqrt5, sqrt5: M = (sqrt2 + sqrt5) / 2; 0.01 sqrt2 < 0.1 M drops row 3;
    # the clipping norm is the lower middle, sqrt2: rows 1 and 2 (norm sqrt5) are scaled by sqrt2 / sqrt5.
    x = _t([[1.0, 1.0], [1.0, 2.0], [2.0, 1.0], [0.01, 0.01]])
    want = (x[0] + (x[1] + x[2]) * (S2 / S5)) / 3
    assert torch.allclose(ra.SignGuard(f=1, fraction=1.0)(x), want, rtol=0, atol=1e-12)


def test_signguard_sign_cluster_drops_a_flipped_row_inside_the_band():
    # The last row has an honest norm but flipped signs: only the sign clustering removes it.
    x = _t([[1.0, 2.0, 1.0], [2.0, 1.0, 1.0], [1.0, 1.0, 2.0], [-1.0, -2.0, -1.0]])
    out = ra.SignGuard(f=1, fraction=1.0)(x)
    assert torch.allclose(out, x[:3].mean(dim=0), rtol=0, atol=1e-12)
    assert ra.SignGuard(f=1, fraction=1.0).weights(x).tolist() == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.0])


SG_ISSUE_X = [[-1, 1, 1, -1], [1, -1, 1, 1], [1, 1, 1, 1], [-1, 1, -1, -1], [-1, -1, -1, -1], [-1, -1, -1, 1],
              [-1, -1, 1, 1]]


def test_signguard_meanshift_drops_a_row_far_from_every_centre_issue_reproducer():
    # The authors' code (signguard_multiclass): sign fractions divided by each column's maximum,
    # MeanShift(bandwidth, bin_seeding=True, cluster_all=False), the largest cluster. Every row has
    # norm 2 and no zero entry; positive fractions p = (.5, .75, 1, .25, 0, .25, .5) with column
    # maxima 1, so the features are (p, 0, 1 - p) on a segment, distance sqrt2 |p - p'|.
    # estimate_bandwidth (quantile .5: each point's 3rd nearest point, itself included): .25 sqrt2
    # for six rows, .5 sqrt2 for row 2: bw = 2 sqrt2 / 7 = 0.404. Bins round(feature / bw) give five
    # seeds; they converge to (1/6, 0, 5/6) {3, 4, 5}, (3/8, 0, 5/8) {0, 3, 5, 6} (two seeds),
    # (7/12, 0, 5/12) {0, 1, 6} and (7/8, 0, 1/8) {1, 2}. By decreasing intensity (4, 3, 3, 2), centres
    # within bw of a kept one go: (3/8, 5/8) removes both 3-point centres; (7/8, 1/8) stays. Row 4 at
    # (0, 0, 1) is 0.53 > bw from (3/8, 5/8): unassigned (-1), not clustered. Labels
    # (0, 1, 1, 0, -1, 0, 0): rows {0, 3, 5, 6}, a quarter each (no row is clipped).
    w = ra.SignGuard(f=2, fraction=1.0).weights(_t(SG_ISSUE_X))
    assert w.tolist() == pytest.approx([0.25, 0, 0, 0.25, 0, 0.25, 0.25], abs=1e-15)


def test_signguard_unassigned_row_is_in_no_cluster():
    # d = 4, no zeros, positive counts (0, 2, 2, 3, 3, 4): column maxima 1, features (p, 0, 1 - p) at
    # p = 0, .5, .5, .75, .75, 1 (distance sqrt2 |p - p'|). Bandwidth: the 3rd nearest point (itself
    # included) is .5 sqrt2 away for row 0 and .25 sqrt2 for the others: bw = 1.75 sqrt2 / 6 = 0.412.
    # Bins give four seeds. From (.41, 0, .41) and (.82, 0, .41) the shift reaches (5/8, 0, 3/8), the
    # mean of rows 1-4 (intensity 4; row 5 is .53 away); from (.82, 0, 0) it reaches (5/6, 0, 1/6)
    # (rows 3-5, intensity 3), within bw of (5/8, 3/8) and removed; row 0 is its own centre. Row 5
    # is .53 > bw from (5/8, 3/8): label -1, so SignGuard keeps rows 1-4 (MeanShift's defaults,
    # every row a seed and every row assigned, put row 5 in that cluster).
    x = _t([[-1, -1, -1, -1], [1, 1, -1, -1], [1, -1, 1, -1], [1, 1, 1, -1], [1, 1, -1, 1], [1, 1, 1, 1]])
    labels = ra.functional.clustering.sign_clusters(ra.functional.clustering.sign_features(x, 0, 1), 0.5)
    assert labels.tolist() == [1, 0, 0, 0, 0, -1]
    assert torch.allclose(ra.SignGuard(f=2, fraction=1.0)(x), _t([1.0, 0.5, 0.0, -0.5]), rtol=0, atol=1e-15)


# d = 8: rows 0-2 have 5 positive and 3 negative entries, rows 3-4 four of each, rows 5-6 four
# positive, one zero and three negative (norm sqrt7 < the median sqrt8: nothing is clipped).
SG_NORM_X = [[1, 1, 1, 1, 1, -1, -1, -1], [1, 1, 1, 1, -1, 1, -1, -1], [-1, 1, 1, 1, 1, 1, -1, -1],
             [1, 1, 1, 1, -1, -1, -1, -1], [1, -1, 1, -1, 1, -1, 1, -1],
             [1, 1, 1, 1, 0, -1, -1, -1], [1, 1, 1, 0, 1, -1, -1, -1]]


def test_signguard_divides_each_sign_feature_by_its_column_maximum():
    # Fractions (5/8, 0, 3/8), (1/2, 0, 1/2), (1/2, 1/8, 3/8); column maxima 5/8, 1/8, 1/2 (+ 1e-8):
    # features (1, 0, 3/4), (4/5, 0, 1), (4/5, 1, 3/4). The raw fractions are equidistant
    # (sqrt2 / 8 apart): bw = 4 (sqrt2/8) / 7 separates all three groups and the largest is rows 0-2.
    # Normalised, rows 0-2 and 3-4 are 0.320 apart and rows 5-6 about 1.02 from both: bw =
    # (2 * 0.320 + 2 * 1.020) / 7 = 0.383. The seed in the bin of rows 0-2 shifts to their point, then
    # to the mean of rows 0-4, (0.92, 0, 0.85), as does the seed of rows 3-4; rows 5-6 stay apart.
    # SignGuard keeps rows 0-4.
    x = _t(SG_NORM_X)
    feats = ra.functional.clustering.sign_features(x, 0, 1)
    want = [[1, 0, 0.75]] * 3 + [[0.8, 0, 1]] * 2 + [[0.8, 1, 0.75]] * 2
    assert np.allclose(feats, want, rtol=0, atol=1e-7) and float(feats.max()) < 1.0  # the 1e-8 of the authors
    assert ra.SignGuard(f=2, fraction=1.0).weights(x).tolist() == pytest.approx([0.2] * 5 + [0, 0], abs=1e-15)


def test_signguard_equally_large_clusters_take_the_first_label():
    # Rows 0-1 have 1 positive entry of 4, rows 2-3 three, row 4 none: features (1/3, 0, 3/4),
    # (1, 0, 1/4), (0, 0, 1); bw = 0.417 / 5 (rows 0-3 have a twin) keeps three clusters. MeanShift
    # labels its centres by intensity (2, 2, 1), equal intensities by the larger centre: (1, 0, 1/4)
    # is label 0. The authors' argmax over the cluster sizes takes label 0: rows 2 and 3.
    x = _t([[1, -1, -1, -1], [-1, -1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, -1, -1, -1]])
    assert ra.SignGuard(f=2, fraction=1.0).weights(x).tolist() == pytest.approx([0, 0, 0.5, 0.5, 0], abs=1e-15)


def test_signguard_clips_to_the_lower_middle_norm_for_even_n():
    # Rows (1, 1) a for a = 1..5 and (-1, -1) 3.5: norms sqrt2 (1, 2, 3, 4, 5, 3.5). The band uses
    # numpy's median (of 3 and 3.5: 3.25 sqrt2), every row is inside (0.1, 3) times it; the sign
    # features are (1, 0, 0) for rows 0-4 and (0, 0, 1) for row 5: bw = sqrt2 / 6 (five points have a
    # twin at 0), two bins, two centres, row 5 alone. The clipping norm is torch's median, the lower
    # middle 3 sqrt2: rows 3 and 4 are clipped to (3, 3): (1 + 2 + 3 + 3 + 3) / 5 = 2.4.
    x = _t([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [4.0, 4.0], [5.0, 5.0], [-3.5, -3.5]])
    assert torch.allclose(ra.SignGuard(f=2, fraction=1.0)(x), _t([2.4, 2.4]), rtol=0, atol=1e-12)
    # Four rows of equal signs (one cluster): norms 1..4, band median 2.5, clipping norm 2.
    y = _t([[1.0], [2.0], [3.0], [4.0]])
    assert ra.SignGuard(f=1, fraction=1.0)(y).item() == pytest.approx(7 / 4, abs=1e-15)  # (1 + 2 + 2 + 2) / 4


def test_signguard_norm_band_is_open_at_both_ends():
    # The authors keep 0.1 M < ||x_i|| < 3 M (strict). Norms 5, 5, 5, 15 (M = 5): 15 = 3 M is out;
    # norms 50, 50, 50, 5 (M = 50): 5 = 0.1 M is out. Equal signs: one cluster.
    w = ra.SignGuard(f=1, fraction=1.0).weights(_t([[3.0, 4.0], [3.0, 4.0], [3.0, 4.0], [9.0, 12.0]]))
    assert w.tolist() == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.0], abs=1e-15)
    x = _t([[30.0, 40.0], [30.0, 40.0], [30.0, 40.0], [3.0, 4.0]])
    assert torch.equal(ra.SignGuard(f=1, fraction=1.0)(x), _t([30.0, 40.0]))


def test_signguard_column_sample_is_seeded_state():
    x = torch.tensor(make_input("gauss", 9, 50, 0, 3))
    a, b = ra.SignGuard(seed=5), ra.SignGuard(seed=5)
    state = a.state_dict()
    assert torch.equal(a.weights(x), b.weights(x))  # weights() does not advance the generator ...
    outs = [a(x) for _ in range(4)]
    assert not torch.equal(a.generator.get_state(), b.generator.get_state())  # ... a call does
    a.load_state_dict(state)
    assert all(torch.equal(a(x), o) for o in outs)  # the same draws again, in order
    a.reset()
    assert torch.equal(a(x), outs[0])


def test_signguard_zero_median_norm_gives_zero():
    x = _t([[0.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    assert torch.equal(ra.SignGuard(f=1)(x), torch.zeros(2, dtype=torch.float64))


# --- ClippedClustering ------------------------------------------------------------------------------
CC_X = [[1.0, 0.0], [2.0, 0.2], [1.0, 0.1], [-5.0, 5.0]]


def test_clipped_clustering_history_by_hand():
    x = _t(CC_X)
    rule = ra.ClippedClustering(f=1)
    # Call 1: norms 1, sqrt(4.04), sqrt(1.01), sqrt(50); tau = (sqrt(1.01) + sqrt(4.04)) / 2, which
    # scales (2, 0.2) by exactly 0.75; the cosine clusters are {0, 1, 2} and {3}.
    out = rule(x)
    assert torch.allclose(out, (x[0] + 0.75 * x[1] + x[2]) / 3, rtol=0, atol=1e-12)
    # Call 2 on 10 x: the 8 norms seen are 1, 1.005, 2.01, 7.07, 10, 10.05, 20.1, 70.7, so
    # tau = (sqrt(50) + 10) / 2 and each honest row comes out with norm tau.
    out = rule(10 * x)
    tau = (math.sqrt(50.0) + 10.0) / 2
    units = x[:3] / torch.linalg.vector_norm(x[:3], dim=1, keepdim=True)
    assert torch.allclose(out, tau * units.mean(dim=0), rtol=0, atol=1e-12)
    assert rule.state_dict()["norms"].shape == (8,)


def test_clipped_clustering_state_round_trip_matches_reference():
    xs = [torch.tensor(make_input("outliers", 9, 4, 2, s)) for s in range(3)]
    rule = ra.ClippedClustering(f=2)
    rule(xs[0])
    state = rule.state_dict()
    hist = list(R.row_norms(xs[0]))
    got = rule(xs[1])
    assert np.allclose(got.numpy(), R.clipped_clustering(xs[1], hist), rtol=0, atol=1e-9 * float(xs[1].abs().max()))
    fresh = ra.ClippedClustering(f=2)
    fresh.load_state_dict(state)
    assert torch.equal(fresh(xs[1]), got)
    fresh.reset()
    assert fresh.state_dict()["norms"].numel() == 0


def test_clipped_clustering_two_rows_are_both_kept():
    x = _t([[1.0, 0.0], [0.0, 3.0]])  # tau = 2: the second row is clipped to (0, 2)
    assert torch.allclose(ra.ClippedClustering()(x), _t([0.5, 1.0]), rtol=0, atol=1e-12)


# --- FLAME ------------------------------------------------------------------------------------------
FLAME_X = [[1.0, 0.0], [1.0, 0.1], [1.1, 0.0], [0.0, -9.0]]


def test_flame_noise_is_lambda_times_the_median_norm_and_seeded():
    x = _t(FLAME_X)
    quiet = ra.FLAME(f=1, lam=0.0)(x)
    st_ = (math.sqrt(1.01) + 1.1) / 2  # median of the norms 1, 1.005, 1.1, 9
    assert torch.allclose(quiet, _t([(2 + st_) / 3, 0.1 / 3]), rtol=0, atol=1e-12)
    z = torch.randn(2, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    noisy = ra.FLAME(f=1, lam=0.01, seed=7)(x)
    assert torch.allclose(noisy - quiet, 0.01 * st_ * z, rtol=0, atol=1e-12)
    assert not torch.equal(ra.FLAME(f=1, lam=0.01, seed=8)(x), noisy)


def test_flame_state_round_trip_replays_the_noise():
    x = torch.tensor(make_input("outliers", 11, 20, 2, 4), dtype=torch.float32)
    rule = ra.FLAME(f=2)
    rule(x)
    state = rule.state_dict()
    second = rule(x)
    other = ra.FLAME(f=2, seed=123)
    other.load_state_dict(state)
    assert torch.equal(other(x), second)
    w = rule.weights(x)
    assert torch.equal(rule.weights(x), w)  # no noise, no draw
    assert int((w > 0).sum()) >= 6  # a majority cluster of the 9 honest rows


def test_flame_two_equal_groups_stay_one_cluster():
    # Two tight pairs at 90 degrees: neither pair reaches min_cluster_size = 3, so HDBSCAN (with
    # allow_single_cluster) keeps the root cluster of all four: without an honest majority the
    # clustering step protects nothing, as the requirement n >= 2f + 1 says.
    x = _t([[1.0, 0.0], [1.0, 0.01], [0.0, 1.0], [0.01, 1.0]])
    w = ra.FLAME(f=1, lam=0.0).weights(x)
    assert bool((w > 0).all())


# --- FLTrust ----------------------------------------------------------------------------------------
def test_fltrust_by_hand_and_both_conventions_agree():
    x = _t([[2.0, 0.0], [0.0, 1.0], [-5.0, 0.0]])
    g0 = _t([1.0, 1.0])
    rule = ra.FLTrust()
    rule.set_trusted(g0)
    out = rule(x)  # cos = 1/sqrt2, 1/sqrt2, -1/sqrt2 -> trust 1/sqrt2, 1/sqrt2, 0; rows rescaled to sqrt2
    assert torch.allclose(out, _t([S2 / 2, S2 / 2]), rtol=0, atol=1e-12)
    assert torch.equal(ra.FLTrust(root="last_row")(torch.cat([x, g0[None]])), out)
    assert rule.trusted is None  # used once
    with pytest.raises(ra.ConfigError, match="set_trusted"):
        rule(x)
    rule.set_trusted(g0)
    assert torch.allclose(rule.weights(x), _t([S2 / 2 / 2, S2 / 2, 0.0]), rtol=0, atol=1e-12)
    assert rule.trusted is not None  # weights() does not consume it
    lr = ra.FLTrust(root="last_row").weights(torch.cat([x, g0[None]]))
    assert lr.shape == (4,) and lr[3] == 0


def test_fltrust_unrepresentative_root_follows_the_root_not_the_clients():
    # Honest rows point to (+, +); a root update pointing to (-, -) trusts only the attacker's row.
    x = _t([[1.0, 0.0], [0.0, 1.0], [-3.0, -3.1]])
    rule = ra.FLTrust()
    rule.set_trusted(_t([-1.0, -1.0]))
    assert torch.allclose(rule(x), x[2] * (S2 / torch.linalg.vector_norm(x[2])), rtol=0, atol=1e-12)
    rule.set_trusted(_t([0.0, 0.0]))  # no direction at all: zero update
    assert torch.equal(rule(x), torch.zeros(2, dtype=torch.float64))


@settings(max_examples=examples(20))
@given(n=st.integers(1, 12), d=st.integers(1, 6), seed=st.integers(0, 2**32 - 1), f=st.integers(0, 11))
def test_fltrust_norm_never_exceeds_the_trusted_norm_whatever_f(n, d, seed, f):
    x = torch.tensor(make_input("outliers", n, d, min(f, n), seed))
    g0 = torch.tensor(np.random.default_rng(seed + 1).normal(size=d))
    rule = ra.FLTrust(f=f)
    rule.set_trusted(g0)
    out = rule(x)
    assert float(torch.linalg.vector_norm(out)) <= float(torch.linalg.vector_norm(g0)) * (1 + 1e-12)
    assert np.allclose(out.numpy(), R.fltrust(x, g0), rtol=0, atol=1e-12 * (1 + float(x.abs().max())))


# --- FoolsGold --------------------------------------------------------------------------------------
def test_foolsgold_sybils_get_zero_weight_by_hand():
    # cos(r0, r2) = cos(r0, r3) = 1/sqrt2, cos(r2, r3) = 1: v = (1/sqrt2, 1/sqrt2, 1, 1). Pardoning
    # scales cs_02 and cs_03 by v_0/v_2 = 1/sqrt2 to 1/2: alpha = (1/2, 1/2, 0, 0) -> /max -> (1, 1, 0, 0)
    # -> 0.99 -> ln 99 + 0.5 > 1 -> clipped to 1; 0 stays 0.
    x = _t([[1.0, 0.0], [0.0, 1.0], [5.0, 5.0], [5.0, 5.0]])
    assert torch.allclose(ra.FoolsGold(f=2)(x), _t([0.5, 0.5]), rtol=0, atol=1e-12)
    assert ra.FoolsGold(f=2).weights(x).tolist() == pytest.approx([0.5, 0.5, 0.0, 0.0])


def test_foolsgold_logit_by_hand():
    # r2 at 40 degrees between r0 = e1 and r1 = e2: cs_02 = cos 40, cs_12 = sin 40, cs_01 = 0;
    # v = (cos40, sin40, cos40); row 1 is pardoned against rows 0 and 2: cs_12 -> sin40 * sin40/cos40.
    # alpha = (1 - cos40, 1 - sin40^2/cos40, 1 - cos40); divided by alpha_1 (the max), alpha_1 -> 0.99
    # -> logit clipped to 1; the others: ln(a / (1 - a)) + 0.5 with a = (1 - cos40)/alpha_1.
    c, s = math.cos(math.radians(40)), math.sin(math.radians(40))
    x = _t([[1.0, 0.0], [0.0, 1.0], [c, s]])
    a1 = 1 - s * s / c
    a = (1 - c) / a1
    w = math.log(a / (1 - a)) + 0.5
    assert 0 < w < 1  # an intermediate weight: the logit branch is exercised
    want = (w * x[0] + x[1] + w * x[2]) / (2 * w + 1)
    assert torch.allclose(ra.FoolsGold()(x), want, rtol=0, atol=1e-12)
    assert R.foolsgold([x]) == pytest.approx(want.numpy(), abs=1e-12)


def _logit(a: float) -> float:
    """FoolsGold's weight for a rescaled alpha ``a`` (Fung et al.'s code): ln(a / (1 - a)) + 0.5 clipped to [0, 1]."""
    return min(1.0, max(0.0, math.log(a / (1 - a)) + 0.5)) if a > 0 else 0.0


def test_foolsgold_a_worker_pointing_away_keeps_weight_one_issue_reproducer():
    # The authors' cs - I: the diagonal is 0 and counts in the maximum, so v_i >= 0. Rows
    # r0 = (1, 0), r1 = (.8, .6), r2 = (0, 1), r3 = (-1, -1): cos 01 = .8, 02 = 0, 12 = .6, and r3 has
    # cosine < 0 with every other row. v = (.8, .8, .6, 0). Pardoning (v_j > v_i): row 2 against rows
    # 0 and 1 scales cs_21 to .6 * .6/.8 = .45; row 3's cosines are all scaled by 0/v_j = 0. Row
    # maxima .8, .8, .45, 0 give alpha = (.2, .2, .55, 1); 1 -> .99 (weight 1), .2 -> ln(1/4) + .5 < 0
    # (weight 0), .55 -> ln(11/9) + .5 = 0.7007. Output (w (0, 1) + (-1, -1)) / (w + 1).
    x = _t([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0], [-1.0, -1.0]])
    w = math.log(11 / 9) + 0.5
    alpha = ra.functional.trust.foolsgold_alpha(ra.functional.cosine.unit_gram(x)[0])
    assert alpha.tolist() == pytest.approx([0.0, 0.0, w, 1.0], abs=1e-12)
    assert torch.allclose(ra.FoolsGold(f=1)(x), _t([-1 / (1 + w), (w - 1) / (1 + w)]), rtol=0, atol=1e-12)
    assert ra.FoolsGold(f=1)(x).tolist() == pytest.approx([-0.588, -0.176], abs=5e-4)  # the issue's numbers
    assert ra.FoolsGold(f=1).weights(x).tolist() == pytest.approx([0, 0, w / (1 + w), 1 / (1 + w)], abs=1e-12)


@pytest.mark.parametrize("rows, alpha, out", [
    # r0 = (1, 0), r1 = (1, 1) at 45 degrees, r2 = (-1, 0) opposite r0: cos 01 = 1/sqrt2, 02 = -1,
    # 12 = -1/sqrt2. v = (1/sqrt2, 1/sqrt2, 0): row 2's cosines are scaled by 0; rows 0 and 1 tie
    # (no pardoning). alpha = (1 - 1/sqrt2, 1 - 1/sqrt2, 1) -> rescaled by 1 -> (.293, .293, .99):
    # ln(.293/.707) + .5 = -0.38 -> 0, and 1. Only row 2 counts. (Reading v over j != i: v_2 = -1/sqrt2,
    # pardoning turns cs_20 = -1 into +1 and gives row 2 weight 0 instead.)
    ([[1.0, 0.0], [1.0, 1.0], [-1.0, 0.0]], [0.0, 0.0, 1.0], [-1.0, 0.0]),
    # 1-D: rows 0 and 1 point the same way (cos 1: sybils), row 2 the other way. v = (1, 1, 0);
    # alpha = (0, 0, 1) -> (0, 0, .99) -> weights (0, 0, 1). (Over j != i every alpha is 0.)
    ([[1.0], [2.0], [-1.0]], [0.0, 0.0, 1.0], [-1.0]),
    # Two rows opposite each other: cos = -1, v = (0, 0), alpha = (1, 1) -> .99 -> 1 each: the mean.
    ([[3.0, 1.0], [-3.0, -1.0]], [1.0, 1.0], [0.0, 0.0]),
    # r0 = e1, r1 = e2, r2 = -(e1 + e2): cos 01 = 0, cos 02 = cos 12 = -1/sqrt2: v = 0 for all, no
    # pardoning, alpha = 1 for all: the mean (0, 0).
    ([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]], [1.0, 1.0, 1.0], [0.0, 0.0]),
    # r0 = (2, 1), r1 = (1, 2), r2 = (-1, 0), r3 = (0, -1): cos 01 = 4/5, cos 23 = 0, r2 and r3 have
    # negative cosines with r0 and r1 (-2/sqrt5, -1/sqrt5; -1/sqrt5, -2/sqrt5). v = (.8, .8, 0, 0):
    # rows 2 and 3 are scaled to 0 against rows 0 and 1 and have cs_23 = 0: alpha = (.2, .2, 1, 1)
    # -> (0, 0, 1, 1): the mean of rows 2 and 3.
    ([[2.0, 1.0], [1.0, 2.0], [-1.0, 0.0], [0.0, -1.0]], [0.0, 0.0, 1.0, 1.0], [-0.5, -0.5]),
])
def test_foolsgold_top_similarity_counts_the_zero_diagonal(rows, alpha, out):
    x = _t(rows)
    got = ra.functional.trust.foolsgold_alpha(ra.functional.cosine.unit_gram(x)[0])
    assert got.tolist() == pytest.approx(alpha, abs=1e-12)
    assert torch.allclose(ra.FoolsGold()(x), _t(out), rtol=0, atol=1e-12)
    assert R.foolsgold_alpha(rows) == pytest.approx(alpha, abs=1e-12)


def test_foolsgold_pardoning_reads_the_history_sums():
    # Step 1 rows (1, 0), (1, 1), (0, -1); step 2 rows (0, 0), (0, 0), (-1, 1). The histories after
    # step 2 are (1, 0), (1, 1), (-1, 0): the first case above, alpha = (0, 0, 1), so the step-2
    # output is row 2 of step 2. (Over j != i, weights (1, 1, 0) would give (0, 0).)
    rule = ra.FoolsGold()
    rule(_t([[1.0, 0.0], [1.0, 1.0], [0.0, -1.0]]))
    assert torch.allclose(rule(_t([[0.0, 0.0], [0.0, 0.0], [-1.0, 1.0]])), _t([-1.0, 1.0]), rtol=0, atol=1e-12)


@settings(max_examples=examples(20))
@given(n=st.integers(1, 8), d=st.integers(1, 6), seed=st.integers(0, 2**32 - 1))
def test_foolsgold_a_history_with_no_positive_cosine_gets_weight_one(n, d, seed):
    # From the authors' definition: cs_ij <= 0 for every j != i gives v_i = 0 (the diagonal), so
    # every cs_ij with v_j > 0 is scaled by 0/v_j and the others stay <= 0: alpha_i = 1 - 0 = 1, the
    # largest possible, rescaled to 1 -> .99 -> ln 99 + .5 > 1 -> weight 1, whatever the other rows.
    rng = np.random.default_rng(seed)
    u = rng.normal(size=d)
    u /= np.linalg.norm(u)
    others = rng.normal(size=(n, d))
    others = others * np.sign(others @ u)[:, None]  # every other row has a positive product with u
    x = torch.tensor(np.vstack([others, -rng.uniform(0.1, 10.0) * u]))
    alpha = ra.functional.trust.foolsgold_alpha(ra.functional.cosine.unit_gram(x)[0])
    assert float(alpha[-1]) == 1.0
    assert float(R.foolsgold_alpha(x)[-1]) == 1.0


@settings(max_examples=examples(10))
@given(n=st.integers(2, 9), d=st.integers(1, 5), steps=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
def test_foolsgold_history_over_steps_matches_reference(n, d, steps, seed):
    xs = [torch.tensor(make_input("gauss", n, d, 0, seed + t)) for t in range(steps)]
    rule = ra.FoolsGold()
    for t, x in enumerate(xs):
        out = rule(x)
        want = R.foolsgold(xs[:t + 1])
        assert np.allclose(out.numpy(), want, rtol=0, atol=1e-9 * max(float(xi.abs().max()) for xi in xs[:t + 1]))
    assert torch.allclose(rule.state_dict()["history"], sum(xs), rtol=0, atol=1e-9 * float(sum(xs).abs().max()))


def test_foolsgold_state_round_trip_and_restart_on_new_n():
    xs = [torch.tensor(make_input("gauss", 6, 4, 0, s)) for s in range(3)]
    rule = ra.FoolsGold()
    rule(xs[0])
    state = rule.state_dict()
    second = rule(xs[1])
    fresh = ra.FoolsGold()
    fresh.load_state_dict(state)
    assert torch.equal(fresh(xs[1]), second)
    assert torch.equal(rule.weights(xs[2]), rule.weights(xs[2]))  # weights() leaves the history alone
    fewer = xs[2][:5]
    assert torch.allclose(rule(fewer), ra.FoolsGold()(fewer), rtol=0, atol=1e-12)  # n changed: restart
    assert rule.restarts == 1 and rule.state_dict()["history"].shape == (5, 4)


# --- all five -----------------------------------------------------------------------------------------
NEW = ["signguard", "clipped_clustering", "flame", "fltrust", "foolsgold"]


def _build(name: str, f: int):
    return ra.get(name, f=f, **({"root": "last_row"} if name == "fltrust" else {}))


@pytest.mark.parametrize("name", NEW)
def test_large_d_without_n_by_n_by_d_temporaries(name):
    # d = 2e6 float32, n = 10: 80 MB of input. FoolsGold keeps an (n, d) history (one input's size)
    # by design; nothing may come near an (n, n, d) temporary (800 MB).
    n, d = 10, 2_000_000
    x = torch.empty(n, d, dtype=torch.float32).normal_(generator=torch.Generator().manual_seed(0))
    x[3] = -x[3] * 20.0  # a flipped, scaled row
    rule = _build(name, 2)
    rule(x[:, :64])  # scikit-learn imported and warmed up outside the measurement
    rule.reset()
    if not _peak_rss_reset():
        pytest.skip("peak RSS cannot be reset on this platform")
    base = _peak_rss_bytes()
    out = rule(x)
    extra = _peak_rss_bytes() - base
    assert out.shape == (d,) and out.dtype == torch.float32 and torch.isfinite(out).all()
    assert extra < 3 * x.numel() * x.element_size(), f"{name} peaked {extra / 2**20:.0f} MiB above its input"


def test_importing_robustagg_does_not_import_sklearn():
    code = "import sys, robustagg; print('sklearn' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", ["signguard", "clipped_clustering", "flame", "foolsgold"])
def test_rules_drop_a_far_flipped_minority(name):
    # 9 honest rows around a common direction, 2 attackers sending -20x that direction: each rule
    # gives the attackers zero weight and stays close to the honest mean.
    rng = np.random.default_rng(1)
    base = rng.normal(size=30)
    honest = base + 0.3 * rng.normal(size=(9, 30))
    x = torch.tensor(np.vstack([honest, -20 * base[None].repeat(2, 0)]))
    rule = _build(name, 2)
    w = rule.weights(x)
    assert float(w[9:].abs().max()) == 0.0, w
    cos = float(torch.nn.functional.cosine_similarity(rule(x), torch.tensor(honest.mean(0)), dim=0))
    assert cos > 0.95


@pytest.mark.parametrize("name", NEW)
def test_float64_rows_beyond_1e154_are_finite_inputs(name):
    # Their squares overflow float64: the Gram matrix is recomputed on rows rescaled
    # by a power of two, so cosines and norm ratios stay exact.
    rng = np.random.default_rng(3)
    x = torch.tensor(rng.normal(size=(9, 6)))
    x[4] = 1e200 * x[4].sign()
    out = _build(name, 2)(x)
    assert torch.isfinite(out).all(), out
    if name != "foolsgold":  # every other rule clips to an honest norm (or the trusted one)
        assert float(out.abs().max()) <= 10 * float(torch.cat([x[:4], x[5:]]).abs().max())


@pytest.mark.parametrize("name", NEW)
def test_nan_and_inf_rows_are_named_and_leave_the_state_alone(name):
    rng = np.random.default_rng(5)
    x = torch.tensor(rng.normal(size=(9, 4)))
    rule = _build(name, 2)
    rule(x)
    before = rule.state_dict()
    bad = x.clone()
    bad[1, 0], bad[4, 2] = math.nan, math.inf
    with pytest.raises(ra.NonFiniteInputError, match=r"in rows \[1, 4\]"):
        rule(bad)
    after = rule.state_dict()
    for key, value in before.items():
        same = torch.equal(value, after[key]) if isinstance(value, torch.Tensor) else value == after[key]
        assert same, key


def test_fltrust_given_mode_names_nan_rows_from_its_gram_pass():
    # FLTrust(root="given") skips the separate finiteness pass: its Gram pass must name the rows.
    x = torch.tensor(np.random.default_rng(2).normal(size=(5, 3)))
    x[2, 1] = math.nan
    rule = ra.FLTrust()
    rule.set_trusted(torch.ones(3, dtype=torch.float64))
    assert rule.gram_checks_finite
    with pytest.raises(ra.NonFiniteInputError, match=r"in rows \[2\]"):
        rule(x)


@pytest.mark.parametrize("name", NEW)
def test_state_survives_a_checkpoint_file(name, tmp_path):
    # The trainer checkpoints rule.state_dict() with robustagg.checkpoint.save_state: the restored
    # rule continues exactly (same history, same generator draws).
    from robustagg.checkpoint import load_state, save_state

    xs = [torch.tensor(make_input("outliers", 9, 5, 2, s), dtype=torch.float32) for s in range(3)]
    rule = _build(name, 2)
    rule(xs[0])
    save_state(tmp_path / "rule.pt", rule.state_dict())
    want = [rule(x) for x in xs[1:]]
    restored = _build(name, 2)
    restored.load_state_dict(load_state(tmp_path / "rule.pt"))
    assert all(torch.equal(restored(x), w) for x, w in zip(xs[1:], want))
