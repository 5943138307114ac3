"""Fast path vs the slow float64 reference (tests/reference.py) on random inputs.

Every rule configuration of the rule database and every pre-aggregation map is compared with its
reference, in float64 and float32 (the reference then runs on the same float32 values cast to
float64). Inputs mix Gaussian rows, small integers (exact ties in distances and values), duplicated
rows and far outliers; a few inputs have ``d`` larger than one column chunk of the kernels.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference as R
import robustagg as ra
from rule_db import KINDS, MAPS, RULE_IDS, RULES, RuleSpec, examples, make_input

pytestmark = pytest.mark.filterwarnings("ignore::robustagg.AssumptionWarning")

DTYPES = (torch.float64, torch.float32)


@st.composite
def rule_inputs(draw, spec: RuleSpec, dtype: torch.dtype):
    f = draw(st.integers(0, 2))
    lo = spec.min_n(f)
    n = draw(st.integers(max(lo, 1), min(lo + 5, spec.max_n)))
    d = draw(st.integers(1, 6))
    kind = draw(st.sampled_from(KINDS))
    seed = draw(st.integers(0, 2**32 - 1))
    return f, kind, torch.tensor(make_input(kind, n, d, f, seed), dtype=dtype)


def tolerance(x: torch.Tensor, spec_name: str = "") -> float:
    """Absolute tolerance: float rounding of sums of n values of the input's magnitude."""
    n = x.shape[0]
    mag = float(x.abs().max()) + 1e-30
    eps = torch.finfo(x.dtype).eps
    if spec_name.startswith("geometric_median"):
        # the fast path forms distances from a Gram matrix: sqrt(eps) relative error near a row
        return mag * (1e-6 if x.dtype == torch.float64 else 1e-4)
    return 8 * n * eps * mag


def assert_close(out: torch.Tensor, expected: np.ndarray, atol: float, what: str, x=None, f: int = 0,
                 objective=None) -> None:
    """``max |out - expected| <= atol``; for minimisers also accept an output with no worse objective."""
    got = out.detach().cpu().double().numpy()
    assert got.shape == expected.shape, what
    err = float(np.max(np.abs(got - expected))) if got.size else 0.0
    if err > atol and objective is not None:
        mine, ref = objective(x, f, got), objective(x, f, expected)
        rel = 1e-12 if x.dtype == torch.float64 else 1e-5
        assert mine <= ref * (1 + rel) + 1e-300, f"{what}: objective {mine!r} > reference {ref!r}"
        return
    assert err <= atol, f"{what}: max error {err:.3g} > {atol:.3g}\ngot {got}\nexpected {expected}"


def _check_rule(spec: RuleSpec, f: int, kind: str, x: torch.Tensor) -> None:
    rule = spec.build(f)
    out = rule(x)
    assert out.dtype == x.dtype and out.shape == (x.shape[1],)
    expected = spec.reference(x, f)
    assert_close(out, expected, tolerance(x, spec.name), f"{spec.name} f={f} kind={kind} {x.dtype} n={x.shape[0]}",
                 x, f, spec.objective)
    if spec.selects_rows == "row":  # the very same row values, not a rounded copy
        assert any(torch.equal(out, row) for row in x)


COMPARED = [(s, i) for s, i in zip(RULES, RULE_IDS) if s.reference is not None]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("spec", [s for s, _ in COMPARED], ids=[i for _, i in COMPARED])
@settings(max_examples=examples(15))
@given(data=st.data())
def test_rule_matches_reference(spec, dtype, data):
    f, kind, x = data.draw(rule_inputs(spec, dtype))
    _check_rule(spec, f, kind, x)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("name", sorted(MAPS))
@settings(max_examples=examples(20))
@given(f=st.integers(0, 3), n_extra=st.integers(1, 6), d=st.integers(1, 6), kind=st.sampled_from(KINDS),
       seed=st.integers(0, 2**32 - 1))
def test_map_matches_reference(name, dtype, f, n_extra, d, kind, seed):
    build, ref = MAPS[name]
    n = 2 * f + n_extra
    x = torch.tensor(make_input(kind, n, d, f, seed), dtype=dtype)
    out = build(f)(x)
    expected = ref(x, f)
    assert out.dtype == dtype
    assert_close(out, expected, tolerance(x), f"{name} f={f} kind={kind} {dtype}")


@pytest.mark.parametrize("init", ["mean", "zero"])
@settings(max_examples=examples(10))
@given(n=st.integers(3, 9), d=st.integers(1, 5), seed=st.integers(0, 2**32 - 1), nu=st.sampled_from([1e-6, 1e-2, 0.1]),
       iters=st.integers(1, 12))
def test_weiszfeld_iterations_match_reference(init, n, d, seed, nu, iters):
    # Same update, same start, same number of steps: the Gram-matrix iteration equals the plain loop.
    x = torch.tensor(make_input("gauss", n, d, 0, seed))
    out = ra.GeometricMedian(nu=nu, max_iter=iters, tol=0.0, init=init)(x)
    assert_close(out, R.weiszfeld(x, nu=nu, iterations=iters, init=init), tolerance(x, "geometric_median"), "weiszfeld",
                 x, 0, lambda x, f, z: R.gm_objective(x, z))


@settings(max_examples=examples(10))
@given(n=st.integers(3, 9), d=st.integers(1, 5), seed=st.integers(0, 2**32 - 1), tau=st.sampled_from([0.1, 1.0, 50.0]),
       iters=st.integers(1, 5), far_centre=st.booleans())
def test_centered_clipping_from_a_given_centre_matches_reference(n, d, seed, tau, iters, far_centre):
    x = torch.tensor(make_input("gauss", n, d, 0, seed))
    centre = torch.tensor(np.random.default_rng(seed + 1).normal(size=d) * (100.0 if far_centre else 1.0))
    cc = ra.CenteredClipping(tau=tau, iterations=iters)
    cc.load_state_dict({"rule": "centered_clipping", "center": centre})
    out = cc(x)
    assert_close(out, R.centered_clipping(x, tau, iters, centre), 1e-9 * (1 + float(centre.abs().max())), "cclip")


@settings(max_examples=examples(6))
@given(n=st.integers(5, 11), d=st.integers(2, 4), seed=st.integers(0, 2**32 - 1))
def test_default_geometric_median_is_converged(n, d, seed):
    # The defaults must give a converged geometric median. Plain Weiszfeld is slow when the median
    # is close to a row: 100 iterations leave a relative objective gap of at most ~2e-6 on such
    # Gaussian inputs (median gap 0, 99th percentile 5e-8 over 300 draws), so the bound is 1e-5.
    x = torch.tensor(make_input("gauss", n, d, 0, seed))
    z = ra.GeometricMedian()(x)
    best = R.geometric_median(x)
    assert R.gm_objective(x, z) <= R.gm_objective(x, best) * (1 + 1e-5) + 1e-300


# --- inputs wider than one column chunk -----------------------------------------------------------
BIG_D = 300_007  # > 3 chunks of 2**20 / n columns for n = 13, not a multiple of any chunk size
WIDE_N = 13


#: Rules whose reference enumerates every subset of n - f rows: SMEA's runs one float64 SVD of an
#: (n - f, d) matrix per subset, C(13, 2) = 78 of them at n = 13 (about 16 s), against C(7, 2) = 21
#: much smaller ones at n = 7 (about 1 s). At n = 7 the input is still wider than one column chunk
#: of every kernel, and the reference still tries every subset.
WIDE_N_FOR = {"smea": 7}


def _wide(n: int) -> torch.Tensor:
    x = make_input("outliers", n, BIG_D, 2, seed=20240611)
    x[3] = x[5]  # a duplicated row
    return torch.tensor(x, dtype=torch.float32)


@pytest.fixture(scope="module")
def wide_input():
    return _wide(WIDE_N)


WIDE = [(s, i) for s, i in COMPARED if s.min_n(2) <= WIDE_N_FOR.get(s.name, WIDE_N) <= s.max_n]


@pytest.mark.parametrize("spec", [s for s, _ in WIDE], ids=[i for _, i in WIDE])
def test_rule_matches_reference_on_wide_input(spec, wide_input):
    x = _wide(WIDE_N_FOR[spec.name]) if spec.name in WIDE_N_FOR else wide_input
    _check_rule(spec, 2, "wide", x)


def test_maps_match_reference_on_wide_input(wide_input):
    for name, (build, ref) in MAPS.items():
        assert_close(build(2)(wide_input), ref(wide_input, 2), tolerance(wide_input), name)
