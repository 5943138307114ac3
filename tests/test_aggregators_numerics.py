"""Numerics: near-identical rows of large norm in float32, huge finite rows, and large d without
``(n, n, d)`` temporaries.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import reference as R
import robustagg as ra

pytestmark = pytest.mark.filterwarnings("ignore::robustagg.AssumptionWarning")

N, F, D = 10, 2, 1000


@pytest.fixture(scope="module")
def near_identical() -> torch.Tensor:
    """1e4 + noise of about 1e-2 in float32, d = 1000.

    The noise is a multiple of 2^-7 (exact in float32 next to 1e4, whose spacing is 2^-10), so that
    means of n - f = 8 rows are exact too and outputs can be compared bit for bit.
    """
    rng = np.random.default_rng(42)
    noise = np.round(rng.normal(size=(N, D)) * 1.3) * 2.0**-7
    x = torch.tensor(1e4 + noise, dtype=torch.float32)
    assert torch.equal(x.double(), torch.tensor(1e4 + noise))  # exactly representable
    return x


def test_the_plain_float32_gram_identity_fails_on_this_input(near_identical):
    # Control: the test input is hard. ||a||^2 + ||b||^2 - 2<a,b> in float32 loses everything
    # (||a||^2 ~ 1e11, float32 spacing there ~ 1e4, true distances ~ 0.2).
    x = near_identical
    sq = (x * x).sum(dim=1)
    naive = sq[:, None] + sq[None, :] - 2.0 * (x @ x.T)
    exact = R.dist_matrix(x)
    off = ~np.eye(N, dtype=bool)
    assert np.max(np.abs(naive.double().numpy()[off] - exact[off]) / exact[off]) > 1.0


def test_krum_scores_and_choice_match_float64(near_identical):
    x = near_identical
    scores = ra.Krum(f=F).scores(x).double().numpy()
    assert np.allclose(scores, R.krum_scores(x, F), rtol=1e-9, atol=0)
    out = ra.Krum(f=F)(x)
    assert torch.equal(out, x[R.krum_index(x, F)])


def test_multi_krum_picks_the_same_rows_as_float64(near_identical):
    x = near_identical
    # m = n - f = 8 rows: a mean of 8 multiples of 2^-7 around 1e4 is exact in float32.
    assert np.array_equal(ra.MultiKrum(f=F)(x).double().numpy(), R.multi_krum(x, F))
    for m in (1, 2, 4):
        assert np.array_equal(ra.MultiKrum(f=F, m=m)(x).double().numpy(), R.multi_krum(x, F, m))


def test_nnm_picks_the_same_neighbours_as_float64(near_identical):
    x = near_identical
    assert np.array_equal(ra.NNM(f=F)(x).double().numpy(), R.nnm(x, F))


def test_bulyan_and_mda_match_float64(near_identical):
    x = near_identical
    assert np.allclose(ra.MinimumDiameterAveraging(f=F)(x).double().numpy(), R.mda(x, F), rtol=0, atol=0)
    x11 = torch.cat([x, x[:1] + 2.0**-7])  # n = 11 >= 4f + 3
    got = ra.Bulyan(f=F)(x11).double().numpy()
    assert np.allclose(got, R.bulyan(x11, F), rtol=0, atol=2.0**-10)  # beta = 3: a mean of 3 rounds once


def test_geometric_median_of_near_identical_rows(near_identical):
    x = near_identical
    got = ra.GeometricMedian()(x).double().numpy()
    # float32 output next to 1e4: spacing 2^-10 ~ 1e-3; the median itself is resolved to that.
    assert np.max(np.abs(got - R.geometric_median(x))) <= 4 * 2.0**-10


HUGE_RULES = ["krum", "multi_krum", "bulyan", "mda", "coordinate_median", "trimmed_mean", "meamed", "geometric_median",
              "nnm>trimmed_mean", "nnm>krum", "arc>trimmed_mean",
              "caf", "smea", "monna", "cge", "dnc",
              # similarity-based rules (part 2) that bound norms (FoolsGold does not: it weighs by direction only)
              "signguard", "clipped_clustering", "flame"]


@pytest.mark.parametrize("name", HUGE_RULES)
def test_a_1e20_float32_row_is_a_finite_input(name):
    rng = np.random.default_rng(7)
    x = torch.tensor(rng.normal(size=(11, 20)), dtype=torch.float32)
    x[6] = 1e20  # its squared norm 2e41 overflows float32 (max 3.4e38)
    out = ra.get(name, f=2)(x)
    assert torch.isfinite(out).all(), name
    honest = torch.cat([x[:6], x[7:]])
    # every rule here stays near the honest rows: well inside their bounding box scaled up 10x
    assert float(out.abs().max()) <= 10 * float(honest.abs().max()), (name, out)


def test_rows_beyond_float64_squares_still_rank_correctly():
    # 1e200 squared overflows float64: the distances fall back to scaled differences.
    x = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.5, 0.5], [1e200, -1e200], [-1e200, 1e200]],
                     dtype=torch.float64)
    assert ra.Krum(f=2)(x).tolist() == [0.5, 0.5]  # the centre row: scores 0.5 * 3 = 1.5, corners 0.5 + 1 + 1 = 2.5
    assert torch.isfinite(ra.Krum(f=2).scores(x)[:5]).all()


# --- large d ----------------------------------------------------------------------------------------------
def _peak_rss_reset() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM (peak RSS) to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


@pytest.mark.parametrize("name", ["krum", "trimmed_mean", "caf", "smea", "monna", "cge", "dnc"])
def test_large_d_without_n_by_n_by_d_temporaries(name):
    # d = 2e6 float32 with n = 10 is 80 MB; an (n, n, d) float32 temporary would be 800 MB and an
    # (n, k, d) one (k = n - f - 2 = 6) 480 MB. The rule must peak well below either.
    n, d = 10, 2_000_000
    x = torch.empty(n, d, dtype=torch.float32).normal_(generator=torch.Generator().manual_seed(0))
    x[3] += 5.0  # a far row so Krum has a clear choice
    rule = ra.get(name, f=2)
    if not _peak_rss_reset():
        pytest.skip("peak RSS cannot be reset on this platform")
    base = _peak_rss_bytes()
    out = rule(x)
    extra = _peak_rss_bytes() - base
    assert out.shape == (d,) and out.dtype == torch.float32 and torch.isfinite(out).all()
    assert extra < 3 * x.numel() * x.element_size(), f"{name} peaked {extra / 2**20:.0f} MiB above its input"
    if name == "krum":
        assert not torch.equal(out, x[3])
    elif name == "trimmed_mean":  # spot-check a few columns against the reference
        cols = torch.tensor([0, 1, d // 2, d - 1])
        assert np.allclose(out[cols].double().numpy(), R.trimmed_mean(x[:, cols], 2), rtol=0, atol=1e-6)
    else:  # the far row (+5 on every coordinate) is left out: it would add >= 5/10 to every coordinate
        assert abs(float(out.double().mean())) < 0.1, float(out.double().mean())
    assert math.isfinite(float(out.sum()))
