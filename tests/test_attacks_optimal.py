"""Optimal ALIE and optimal IPM: the line search against the defender's rule, hand cases, relation to agr_tailored."""

from __future__ import annotations

import math
import os

import pytest
import torch

import attacks
import robustagg as ra
from robustagg.errors import ConfigError

os.environ.setdefault("WANDB_MODE", "disabled")
torch.set_num_threads(1)


def synthetic(h: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(d, generator=g, dtype=torch.float64) + 0.5 + torch.randn(h, d, generator=g, dtype=torch.float64)


def displacement(rule, honest: torch.Tensor, byz: torch.Tensor) -> float:
    return float((rule(torch.cat([honest, byz])) - honest.mean(dim=0)).norm())


RULES = {
    "trimmed_mean": lambda: ra.CoordinateWiseTrimmedMean(f=3),
    "krum": lambda: ra.Krum(f=3),
    "nnm>trimmed_mean": lambda: ra.get("nnm>trimmed_mean", f=3),
    "centered_clipping": lambda: ra.CenteredClipping(f=3, tau=1.0),
}


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("seed", [0, 1])
def test_opt_alie_is_agr_tailored_with_the_std_direction_bit_for_bit(rule, seed):
    honest = synthetic(12, 15, seed)
    a, b = attacks.OptALIE(), attacks.AGRTailored(direction="std")
    out_a, out_b = a(honest, 3, rule=RULES[rule]()), b(honest, 3, rule=RULES[rule]())
    assert torch.equal(out_a, out_b)
    assert a.last_z == b.last_lambda and a.last_objective == b.last_objective
    # and its rows are ALIE's rows with that z
    assert torch.allclose(out_a, attacks.ALIE(z=a.last_z)(honest, 3), rtol=1e-12, atol=1e-12)


def test_opt_alie_hand_case_against_the_median():
    # honest 0, 1, 2, 3: mean 1.5, sigma = sqrt(5/3); f = 1, median of 5 rows.
    # b(z) = 1.5 - sigma z; the median is 1 once b <= 1, i.e. z >= 0.5 / sigma = 0.387, so
    # J(z) = min(sigma z, 0.5). Grid (z_max = 4, grid = 4): 0, 0.5, 1, 2, 4 -> J = 0, 0.5, 0.5, ...:
    # ties keep the smaller, z = 0.5; refinement (0.25, 0.375, ... give J < 0.5) never improves it.
    honest = torch.tensor([[0.0], [1.0], [2.0], [3.0]], dtype=torch.float64)
    a = attacks.OptALIE(z_max=4.0, grid=4, refine=10)
    out = a(honest, 1, rule=ra.CoordinateWiseMedian(f=1))
    sigma = math.sqrt(5.0 / 3.0)
    assert a.last_z == 0.5 and a.last_objective == 0.5
    assert float(out) == pytest.approx(1.5 - 0.5 * sigma, rel=1e-15)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_opt_alie_moves_trimmed_mean_at_least_as_far_as_alie_with_the_papers_z(seed):
    honest = synthetic(16, 30, seed)
    rule = ra.CoordinateWiseTrimmedMean(f=4)
    a = attacks.OptALIE()
    opt = displacement(rule, honest, a(honest, 4, rule=rule))
    assert opt > displacement(rule, honest, attacks.ALIE()(honest, 4))
    assert a.last_objective == pytest.approx(opt, rel=1e-12)


def test_opt_ipm_hand_cases():
    honest = torch.tensor([[1.0], [2.0], [3.0], [4.0]], dtype=torch.float64)  # mean 2.5
    # mean rule, f = 2: J(eps) = |(10 - 5 eps)/6 - 2.5| = 5 (1 + eps) / 6, increasing: eps_max wins;
    # default eps_max = 1024 * max(1, max_i |x_i - 2.5| / 2.5) = 1024 * max(1, 0.6) = 1024
    a = attacks.OptIPM()
    assert torch.equal(a(honest, 2, rule=ra.Mean()), torch.full((2, 1), -2560.0, dtype=torch.float64))
    assert a.last_epsilon == 1024.0 and a.last_objective == pytest.approx(5 * 1025 / 6, rel=1e-15)
    # median, f = 1: b = -2.5 eps <= 2 for every eps >= 0, so the median is 2 and J = 0.5 flat: eps = 0
    a = attacks.OptIPM(grid=8, refine=5)
    assert torch.equal(a(honest, 1, rule=ra.CoordinateWiseMedian(f=1)), torch.zeros(1, 1, dtype=torch.float64))
    assert a.last_epsilon == 0.0 and a.last_objective == 0.5


def test_opt_ipm_is_not_an_alias_of_agr_tailored_unit():
    # Same median case: agr_tailored's unit direction also searches rows between the mean and zero
    # (b = 2.5 - lam, lam < 2.5): the smallest grid lam with b <= 2 wins, a row IPM never sends.
    honest = torch.tensor([[1.0], [2.0], [3.0], [4.0]], dtype=torch.float64)
    agr = attacks.AGRTailored(direction="unit", lambda_max=4.0, grid=4, refine=0)
    out = agr(honest, 1, rule=ra.CoordinateWiseMedian(f=1))
    assert agr.last_lambda == 0.5 and float(out) == 2.0  # grid 0, 0.5, 1, 2, 4
    assert float(attacks.OptIPM(epsilon_max=4.0, grid=4, refine=0)(honest, 1, rule=ra.CoordinateWiseMedian(f=1))) == 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_opt_ipm_moves_trimmed_mean_at_least_as_far_as_ipm(seed):
    honest = synthetic(16, 30, seed)
    rule = ra.CoordinateWiseTrimmedMean(f=4)
    a = attacks.OptIPM()
    opt = displacement(rule, honest, a(honest, 4, rule=rule))
    for eps in (0.1, 0.5, 1.0, 2.0):
        assert opt >= displacement(rule, honest, attacks.IPM(epsilon=eps)(honest, 4)) * (1 - 1e-12)
    assert a.last_objective == pytest.approx(opt, rel=1e-12)


def test_opt_ipm_zero_mean_and_rule_state():
    zm = torch.tensor([[1.0, -1.0], [-1.0, 1.0]], dtype=torch.float64)
    a = attacks.OptIPM()
    assert torch.equal(a(zm, 1, rule=ra.Mean()), torch.zeros(1, 2, dtype=torch.float64)) and a.last_epsilon == 0.0
    honest = synthetic(9, 6, 5)
    cclip = ra.CenteredClipping(f=2, tau=1.0)
    cclip(torch.cat([honest, honest[:2]]))  # a non-zero centre
    before = cclip.state_dict()["center"].clone()
    attacks.OptIPM(grid=10, refine=5)(honest, 2, rule=cclip)
    attacks.OptALIE(grid=10, refine=5)(honest, 2, rule=cclip)
    assert torch.equal(cclip.state_dict()["center"], before)


@pytest.mark.parametrize("ctor, pattern", [
    (lambda: attacks.OptALIE(z_max=0.0), r"OptALIE: z_max must be > 0"),
    (lambda: attacks.OptALIE(grid=0), r"OptALIE: grid must be an integer >= 1"),
    (lambda: attacks.OptIPM(epsilon_max=-1.0), r"OptIPM: epsilon_max must be > 0"),
    (lambda: attacks.OptIPM(refine=-1), r"OptIPM: refine must be an integer >= 0"),
    (lambda: attacks.OptIPM(tol=0.0), r"OptIPM: tol must be > 0"),
])
def test_optimal_constructor_validation(ctor, pattern):
    with pytest.raises(ConfigError, match=pattern):
        ctor()


def test_optimal_attacks_need_the_rule():
    with pytest.raises(ConfigError, match=r"OptIPM is rule-aware: pass rule="):
        attacks.OptIPM()(synthetic(4, 2, 0), 1)
    with pytest.raises(ConfigError, match=r"OptALIE is rule-aware: pass rule="):
        attacks.OptALIE()(synthetic(4, 2, 0), 1)
