"""Attack zoo: effects against the robustagg rules on synthetic honest gradients, state, data attack."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attacks
import robustagg as ra
from robustagg import functional as F
from robustagg.errors import ConfigError, ShapeError

os.environ.setdefault("WANDB_MODE", "disabled")
torch.set_num_threads(1)


def synthetic(h: int, d: int, seed: int = 0, spread: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Honest rows ``mu + noise`` whose mean is exactly ``mu`` (the noise is centred), float64."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(d, generator=g, dtype=torch.float64) + 0.5
    noise = spread * torch.randn(h, d, generator=g, dtype=torch.float64)
    return mu + (noise - noise.mean(dim=0)), mu


# --- IPM against the mean ------------------------------------------------------------------------
# Mean over n = h + f rows with f copies of -eps * mu: output = ((n - f) - f * eps) * mu / n, so
# <output, mu> < 0  iff  f * eps > n - f  iff  eps > (n - f) / f.

@pytest.mark.parametrize("n, f, eps, negative", [
    (23, 21, 0.1, True),    # (n - f)/f = 2/21 = 0.095 < 0.1: turned
    (12, 8, 0.1, False),    # 4/8 = 0.5 > 0.1: not turned (output = (4 - 0.8) mu / 12)
    (10, 4, 2.0, True),     # 6/4 = 1.5 < 2: turned (a larger eps needs fewer Byzantine workers)
    (10, 4, 1.0, False),    # 1.5 > 1: not turned
])
def test_ipm_turns_the_mean_exactly_when_eps_exceeds_ratio(n, f, eps, negative):
    honest, mu = synthetic(n - f, 8)
    byz = attacks.IPM(epsilon=eps)(honest, f)
    out = F.mean(torch.cat([honest, byz]))
    expected = ((n - f) - f * eps) * mu / n
    assert torch.allclose(out, expected, atol=1e-12)
    assert (float(out @ mu) < 0) == negative
    assert (eps > (n - f) / f) == negative


def test_ipm_default_eps_against_mean_rule_object():
    honest, mu = synthetic(2, 4, seed=3)
    with pytest.warns(ra.AssumptionWarning):  # the mean with f >= 1 declared warns, never raises
        out = ra.Mean(f=21)(torch.cat([honest, attacks.IPM()(honest, 21)]))
    assert float(out @ mu) < 0  # eps = 0.1 > (23 - 21)/21


# --- AGR-tailored vs ALIE ------------------------------------------------------------------------

def displacement(rule, honest: torch.Tensor, byz: torch.Tensor) -> float:
    return float((rule(torch.cat([honest, byz])) - honest.mean(dim=0)).norm())


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("direction", ["std", "unit", "sign"])
def test_agr_tailored_moves_cwtm_at_least_as_far_as_alie(seed, direction):
    honest, _ = synthetic(16, 30, seed=seed)
    rule = ra.CoordinateWiseTrimmedMean(f=4)
    alie = displacement(rule, honest, attacks.ALIE()(honest, 4))
    a = attacks.AGRTailored(direction=direction)
    byz = a(honest, 4, rule=rule)
    agr = displacement(rule, honest, byz)
    assert agr >= alie * (1 - 1e-12)
    assert a.last_objective == pytest.approx(agr, rel=1e-12)
    if direction == "std":  # ALIE is the std direction at lam = z: the search must do at least as well
        assert agr > alie


def test_agr_tailored_against_a_pipeline_and_krum():
    honest, _ = synthetic(13, 20, seed=4)
    pipe = ra.get("nnm>trimmed_mean", f=3)
    assert displacement(pipe, honest, attacks.AGRTailored()(honest, 3, rule=pipe)) >= \
        displacement(pipe, honest, attacks.ALIE()(honest, 3))
    krum = ra.Krum(f=3)
    a = attacks.AGRTailored(direction="unit")
    agr = displacement(krum, honest, a(honest, 3, rule=krum))
    assert agr >= displacement(krum, honest, attacks.ALIE()(honest, 3)) * (1 - 1e-12)
    assert agr >= displacement(krum, honest, torch.empty(0, 20, dtype=torch.float64)) * (1 - 1e-12)


def test_agr_tailored_leaves_the_rule_state_untouched():
    honest, _ = synthetic(9, 6, seed=5)
    cclip = ra.CenteredClipping(f=2, tau=1.0)
    cclip(torch.cat([honest, honest[:2]]))  # give it a non-zero centre
    before = cclip.state_dict()["center"].clone()
    attacks.AGRTailored(grid=10, refine=5)(honest, 2, rule=cclip)
    assert torch.equal(cclip.state_dict()["center"], before)
    pipe = ra.Pipeline(pre=[ra.Bucketing(s=2, generator=torch.Generator().manual_seed(0))],
                       rule=ra.CoordinateWiseMedian(f=1))
    state = pipe.state_dict()["stages"][0]["generator"].clone()
    attacks.AGRTailored(grid=10, refine=5)(honest, 2, rule=pipe)
    assert torch.equal(pipe.state_dict()["stages"][0]["generator"], state)


def test_agr_tailored_mean_rule_goes_to_lambda_max():
    # the mean is unbounded in lam: the search ends at lambda_max; 1.5 - 8 = -6.5
    honest = torch.tensor([[0.0], [1.0], [2.0], [3.0]], dtype=torch.float64)
    a = attacks.AGRTailored(direction="unit", lambda_max=8.0)
    assert torch.equal(a(honest, 1, rule=ra.Mean()), torch.tensor([[-6.5]], dtype=torch.float64))
    assert a.last_lambda == 8.0


# --- Fang --------------------------------------------------------------------------------------

@pytest.mark.parametrize("h, f, d, seed", [(12, 3, 20, 0), (20, 4, 50, 1), (7, 2, 5, 2), (30, 8, 10, 3)])
@pytest.mark.parametrize("reference", ["krum", "mean"])
def test_fang_krum_makes_krum_select_a_byzantine_row(h, f, d, seed, reference):
    honest, _ = synthetic(h, d, seed=seed)
    a = attacks.FangKrum(reference=reference)
    byz = a(honest, f)
    assert a.last_success and a.last_lambda > 0
    assert torch.equal(byz, byz[:1].expand(f, d))
    out = ra.Krum(f=f)(torch.cat([honest, byz]))
    assert torch.equal(out, byz[0])
    assert torch.equal(ra.Krum(f=f)(torch.cat([byz, honest])), byz[0])  # order does not matter
    # the row deviates against the sign of the reference: <byz - g_Re, sign(g_Re)> < 0
    ref = honest.mean(dim=0) if reference == "mean" else F.krum(honest, f)  # Krum of the honest rows alone
    assert torch.allclose(byz[0], ref - a.last_lambda * torch.sign(ref), rtol=0, atol=1e-12)


def test_fang_krum_upper_bound_by_hand():
    # h = 5 honest rows in d = 1, c = 1: m = 6, m - 2c - 1 = 3, m - c - 2 = 3 neighbours.
    honest = torch.tensor([[1.0], [2.0], [3.0], [4.0], [10.0]], dtype=torch.float64)
    a = attacks.FangKrum(reference="mean", threshold=0.99)  # threshold: only lam_0 is tried
    byz = a(honest, 1)
    # sums of the 3 nearest distances: x=1: 1+2+3=6; 2: 1+1+2=4; 3: 1+1+2=4; 4: 1+2+3=6; 10: 6+7+8=21 -> min 4
    # g_Re = mean = 4, max |x_i - 4| = 6; lam_0 = 4 / (3 * 1) + 6 / 1 = 7.3333
    assert a.last_upper_bound == pytest.approx(4 / 3 + 6, rel=1e-12)
    # lam_0 only: b = 4 - 7.3333 * sign(4) = -3.3333; Krum (f = 1, 4 neighbours) still prefers an honest
    # row, and with threshold 0.99 no smaller lam is tried
    assert a.last_lambda == a.last_upper_bound and a.last_success is False
    assert float(byz[0, 0]) == pytest.approx(4 - (4 / 3 + 6))


@pytest.mark.parametrize("reference", ["trimmed_mean", "mean"])
def test_fang_trimmed_mean_moves_cwtm_against_the_update(reference):
    h, f = 15, 4
    honest, _ = synthetic(h, 40, seed=7)
    byz = attacks.FangTrimmedMean(reference=reference)(honest, f, generator=torch.Generator().manual_seed(0))
    ref = F.trimmed_mean(honest, f) if reference == "trimmed_mean" else honest.mean(dim=0)
    down = ref >= 0
    lo, hi = honest.min(dim=0).values, honest.max(dim=0).values
    assert bool(torch.where(down, (byz <= lo).all(dim=0), (byz >= hi).all(dim=0)).all())  # past the extremes
    # interval factor b = 2: never more than twice the extreme, never across zero
    ext = torch.where(down, lo, hi)
    assert bool((byz.abs() <= 2 * ext.abs() + 1e-12).all() and (byz * ext >= 0).all())
    out = ra.CoordinateWiseTrimmedMean(f=f)(torch.cat([honest, byz]))
    before = F.trimmed_mean(honest, f)
    # adding f values below every honest one and trimming f per side averages the h - f lowest
    # honest values, which is <= the trimmed mean of the honest rows (and >= mirrored)
    assert bool(torch.where(down, out <= before + 1e-12, out >= before - 1e-12).all())


# --- MinMax / MinSum ---------------------------------------------------------------------------

@pytest.mark.parametrize("direction", ["unit", "std", "sign"])
@pytest.mark.parametrize("seed", [0, 1])
def test_min_max_stays_within_the_honest_max_distance_and_is_tight(direction, seed):
    honest, _ = synthetic(11, 25, seed=seed, spread=0.3)
    a = attacks.MinMax(direction=direction)
    byz = a(honest, 3)
    r = float(torch.cdist(honest, honest).max())
    dist = torch.cdist(byz[:1], honest)[0]
    assert float(dist.max()) <= r * (1 + 1e-9)
    assert float(dist.max()) == pytest.approx(r, rel=1e-9)  # the largest gamma: the constraint is active
    assert a.last_gamma > 0


@pytest.mark.parametrize("direction", ["unit", "std", "sign"])
def test_min_sum_constraint_is_met_with_equality(direction):
    honest, _ = synthetic(9, 12, seed=2)
    a = attacks.MinSum(direction=direction)
    byz = a(honest, 2)
    d2 = torch.cdist(honest, honest) ** 2
    lhs = float((torch.cdist(byz[:1], honest)[0] ** 2).sum())
    assert lhs == pytest.approx(float(d2.sum(dim=1).max()), rel=1e-9)


def test_min_max_float32_large_values_keep_the_constraint():
    honest, _ = synthetic(6, 5, seed=3)
    big = (honest * 1e30).float()
    byz = attacks.MinMax(direction="std")(big, 2)
    r = float(torch.cdist(big.double(), big.double()).max())
    assert float(torch.cdist(byz[:1].double(), big.double()).max()) <= r * (1 + 1e-6)


@given(h=st.integers(1, 7), d=st.integers(1, 5), f=st.integers(1, 3), seed=st.integers(0, 2**16),
       scale=st.sampled_from([1e-6, 1.0, 1e6]), direction=st.sampled_from(["unit", "std", "sign"]))
def test_min_max_min_sum_constraints_hold_on_random_inputs(h, d, f, seed, scale, direction):
    g = torch.Generator().manual_seed(seed)
    honest = scale * torch.randn(h, d, generator=g, dtype=torch.float64)
    dist = torch.cdist(honest, honest)
    mm, ms = attacks.MinMax(direction=direction), attacks.MinSum(direction=direction)
    b1, b2 = mm(honest, f), ms(honest, f)
    slack = 1e-9 * scale
    assert float(torch.cdist(b1[:1], honest).max()) <= float(dist.max()) * (1 + 1e-9) + slack
    lhs = float((torch.cdist(b2[:1], honest) ** 2).sum())
    assert lhs <= float((dist ** 2).sum(dim=1).max()) * (1 + 1e-9) + slack ** 2
    assert mm.last_gamma >= 0 and ms.last_gamma >= 0
    # order-free attacks do not depend on the order of the honest rows
    perm = torch.randperm(h, generator=g)
    for name in ("alie", "ipm", "sign_flip", "min_max", "min_sum"):
        if name == "alie" and (h + f) // 2 + 1 - f <= 0:
            continue
        a, b = attacks.get(name), attacks.get(name)
        assert torch.allclose(a(honest, f), b(honest[perm], f), rtol=1e-12, atol=1e-12 * scale)


# --- ALIE, BitFlip, Gaussian by hand ---------------------------------------------------------------

def test_alie_own_source_uses_own_statistics():
    honest = torch.zeros(5, 2, dtype=torch.float64)
    own = torch.tensor([[1.0, 0.0], [3.0, 4.0]], dtype=torch.float64)
    # own mean (2, 2), std ddof=1: (sqrt(2), sqrt(8)); z = 1 -> (2 - 1.41421, 2 - 2.82843)
    out = attacks.ALIE(z=1.0, source="own")(honest, 2, own=own)
    assert torch.allclose(out[0], torch.tensor([2 - 2 ** 0.5, 2 - 8 ** 0.5], dtype=torch.float64))
    # paper z uses n = h + f = 7, f = 2 -> 0.5659488
    a = attacks.ALIE(source="own")
    a(honest, 2, own=own)
    assert a.last_z == pytest.approx(0.5659488219, abs=1e-9)


def test_bit_flip_and_gaussian_statistics():
    own = torch.tensor([[1.0, -2.0], [0.5, 0.0]])
    assert torch.equal(attacks.BitFlip(scale=2.0)(torch.ones(3, 2), 2, own=own), torch.tensor([[-2.0, 4.0], [-1.0, 0.0]]))
    x = attacks.Gaussian(mu=3.0, sigma=2.0)(torch.zeros(1, 20000, dtype=torch.float64), 2,
                                            generator=torch.Generator().manual_seed(0))
    # 40000 draws: the sample mean is within 5 standard errors (2/200 = 0.01) of 3
    assert abs(float(x.mean()) - 3.0) < 0.05 and abs(float(x.std()) - 2.0) < 0.05
    assert not torch.equal(x[0], x[1])  # independent rows


# --- Mimic -------------------------------------------------------------------------------------

def mimic_honest(step: int) -> torch.Tensor:
    """Rows with their largest variance along coordinate 0 (worker 3 extreme on +, worker 1 on -)."""
    g = torch.Generator().manual_seed(100 + step)
    x = 0.1 * torch.randn(5, 4, generator=g, dtype=torch.float64)
    x[:, 0] += torch.tensor([0.0, -4.0, 1.0, 4.5, 0.5], dtype=torch.float64)
    return x


def test_mimic_picks_the_extreme_worker_along_the_top_direction_and_fixes_it():
    m = attacks.Mimic(warmup=3)
    g = torch.Generator().manual_seed(0)
    for step in range(6):
        honest = mimic_honest(step)
        out = m(honest, 2, generator=g)
        i = m.state_dict()["index"]
        assert i in (1, 3)  # argmax <z, x_i> with z = +-e_0 (up to noise): the extreme worker
        assert torch.equal(out, honest[i].expand(2, -1))
        if step == 2:
            fixed = i
        if step >= 3:
            assert i == fixed  # after the warm-up the target never changes
    z = m.state_dict()["direction"]
    assert abs(float(z[0])) > 0.99 and m.state_dict()["step"] == 6


def test_mimic_state_roundtrip_and_reset():
    a, b = attacks.Mimic(warmup=2), attacks.Mimic(warmup=2)
    g = torch.Generator().manual_seed(0)
    a(mimic_honest(0), 1, generator=g)
    b.load_state_dict(a.state_dict())
    for step in (1, 2, 3):
        assert torch.equal(a(mimic_honest(step), 1), b(mimic_honest(step), 1))
    assert a.state_dict()["step"] == 4
    a.reset()
    assert a.state_dict() == {"attack": "mimic", "step": 0, "mean": None, "direction": None, "index": None}
    with pytest.raises(ConfigError, match=r"Mimic: cannot load the state of attack 'alie'"):
        a.load_state_dict({"attack": "alie"})
    with pytest.raises(ConfigError, match=r"Mimic: malformed state"):
        a.load_state_dict({"attack": "mimic", "step": -1})


def test_mimic_refuses_a_changed_honest_set():
    m = attacks.Mimic(warmup=1)
    m(mimic_honest(0), 1)
    with pytest.raises(ShapeError, match=r"state has d=4 but honest has d=3; call reset\(\)"):
        m(torch.zeros(5, 3, dtype=torch.float64), 1)
    m.load_state_dict({**m.state_dict(), "index": 4})
    with pytest.raises(ShapeError, match=r"fixed target index 4 is not below h=2"):
        m(mimic_honest(1)[:2], 1)


def test_mimic_zero_variance_is_finite():
    m = attacks.Mimic(warmup=2)
    x = torch.ones(4, 3)
    for _ in range(3):
        out = m(x, 2, generator=torch.Generator().manual_seed(1))
        assert torch.equal(out, torch.ones(2, 3))
    assert torch.isfinite(m.state_dict()["direction"]).all()


# --- LabelFlip ---------------------------------------------------------------------------------

def test_label_flip_poisons_labels_and_passes_own_through():
    lf = attacks.LabelFlip()
    y = torch.tensor([0, 1, 2, 9, 5], dtype=torch.int64)
    out = lf.poison_labels(y, 10)
    assert torch.equal(out, torch.tensor([9, 8, 7, 0, 4])) and out.dtype == torch.int64
    assert torch.equal(lf.poison_labels(out, 10), y)  # an involution
    assert torch.equal(lf.poison_labels(torch.tensor([0, 1], dtype=torch.uint8), 2), torch.tensor([1, 0],
                                                                                                   dtype=torch.uint8))
    own = torch.randn(2, 3)
    res = lf(torch.zeros(4, 3), 2, own=own)
    assert torch.equal(res, own) and res.data_ptr() != own.data_ptr()
    assert lf.kind is attacks.Kind.DATA


@pytest.mark.parametrize("y, c, err, pattern", [
    (torch.tensor([0.0, 1.0]), 10, ShapeError, r"y must be an integer tensor of class indices; got torch.float32"),
    (torch.tensor([0, 10]), 10, ShapeError, r"labels must lie in \[0, 10\); got min 0, max 10"),
    (torch.tensor([-1, 2]), 10, ShapeError, r"labels must lie in \[0, 10\)"),
    (torch.tensor([0, 1]), 0, ConfigError, r"num_classes must be an integer >= 1; got 0"),
])
def test_label_flip_errors(y, c, err, pattern):
    with pytest.raises(err, match=pattern):
        attacks.LabelFlip().poison_labels(y, c)
