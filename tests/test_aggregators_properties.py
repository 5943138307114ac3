"""Properties declared in the rule database, checked on every rule configuration.

Permutation invariance (on inputs without ties), translation equivariance ``F(X + c) = F(X) + c``,
positive-scale equivariance ``F(aX) = aF(X)``, unanimity, and the calling convention: the output
is a new tensor (never a view of the input), the input is never mutated, dtype and device are
preserved, and a list of rows gives the same result as the stacked tensor.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import robustagg as ra
from rule_db import RULE_IDS, RULES, RuleSpec, examples, make_input

pytestmark = pytest.mark.filterwarnings("ignore::robustagg.AssumptionWarning")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _ids(specs):
    return [RULE_IDS[RULES.index(s)] for s in specs]


def _atol(x: torch.Tensor, spec: RuleSpec, extra: float = 0.0) -> float:
    mag = float(x.abs().max()) + extra + 1e-30
    if spec.name.startswith("geometric_median"):
        return 1e-6 * mag  # Gram-matrix distances: about sqrt(eps) relative near a row
    return 16 * x.shape[0] * torch.finfo(x.dtype).eps * mag


def assert_equivalent(spec: RuleSpec, x: torch.Tensor, f: int, a: torch.Tensor, b: torch.Tensor, atol: float) -> None:
    """``a`` and ``b`` (outputs for ``x``) agree to ``atol``, or are equally good choices among exact ties.

    Rules that break exact ties by row index (Krum with one neighbour: the two mutual nearest rows;
    MDA: subsets sharing their farthest pair; NNM then Krum: mixed rows with equal neighbour sets)
    may pick another of the tied candidates once rounding differs; the other choice must then have
    the same objective.
    """
    if torch.allclose(a, b, rtol=0, atol=atol):
        return
    objective = spec.objective or spec.tie_objective
    assert objective is not None, (a, b)
    oa, ob = objective(x, f, a), objective(x, f, b)
    assert np.isfinite(oa) and abs(oa - ob) <= 1e-9 * abs(oa) + 1e-300, (a, b, oa, ob)


@st.composite
def no_tie_inputs(draw, spec: RuleSpec, dtype=torch.float64):
    f = draw(st.integers(0, 2))
    n = draw(st.integers(spec.min_n(f), min(spec.min_n(f) + 4, spec.max_n)))
    d = draw(st.integers(1, 5))
    kind = draw(st.sampled_from(["gauss", "outliers"]))
    seed = draw(st.integers(0, 2**32 - 1))
    return f, torch.tensor(make_input(kind, n, d, f, seed), dtype=dtype), seed


PERM = [s for s in RULES if s.permutation_invariant]


@pytest.mark.parametrize("spec", PERM, ids=_ids(PERM))
@settings(max_examples=examples(8))
@given(data=st.data())
def test_permutation_invariance(spec, data):
    f, x, seed = data.draw(no_tie_inputs(spec))
    perm = torch.from_numpy(np.random.default_rng(seed).permutation(x.shape[0]))
    a, b = spec.build(f)(x), spec.build(f)(x[perm])
    assert_equivalent(spec, x, f, a, b, _atol(x, spec))


def test_bulyan_depends_on_row_order():
    # Documents why the database declares Bulyan not permutation invariant: n=7, f=1 ends with a
    # round of 0 neighbours, where the lowest remaining index is taken.
    x = torch.tensor([[0.0], [1.0], [2.0], [3.0], [4.0], [5.0], [50.0]], dtype=torch.float64)
    assert ra.Bulyan(f=1)(x).item() == 2.0  # selects {0,1,2,3,4}: see test_bulyan_by_hand
    # Reversed rows: rounds take the values 3, 2, 4, 1 (ties now go to the other side), and the
    # last round (0 neighbours) takes the lowest remaining index, now the outlier 50: the selected
    # values are {1, 2, 3, 4, 50}, median 3, the 3 closest are 2 3 4 -> 3.
    assert ra.Bulyan(f=1)(x.flip(0)).item() == 3.0
    assert not ra.Bulyan.permutation_invariant


TRANS = [s for s in RULES if s.translation_equivariant]


@pytest.mark.parametrize("spec", TRANS, ids=_ids(TRANS))
@settings(max_examples=examples(8))
@given(data=st.data())
def test_translation_equivariance(spec, data):
    f, x, seed = data.draw(no_tie_inputs(spec))
    c = torch.from_numpy(np.random.default_rng(seed + 1).normal(size=x.shape[1]) * 10.0 * float(x.abs().max()))
    a = spec.build(f)(x + c)
    b = spec.build(f)(x)
    assert_equivalent(spec, x, f, a - c, b, _atol(x, spec, float(c.abs().max())))


SCALE = [s for s in RULES if s.scale_equivariant]


@pytest.mark.parametrize("spec", SCALE, ids=_ids(SCALE))
@settings(max_examples=examples(8))
@given(data=st.data(), a=st.sampled_from([2.0**-7, 8.0, 3.0, 0.1]))
def test_positive_scale_equivariance(spec, data, a):
    f, x, _ = data.draw(no_tie_inputs(spec))
    got = spec.build(f)(a * x)
    want = a * spec.build(f)(x)
    if a in (2.0**-7, 8.0):  # powers of two scale every rounding exactly
        assert torch.equal(got, want), (got, want)
    else:
        assert_equivalent(spec, x, f, got / a, want / a, _atol(x, spec))


def test_negative_scale_is_not_assumed_for_selection_rules():
    # F(-X) = -F(X) holds for symmetric rules; checked once for the coordinate median as a control.
    x = torch.tensor(make_input("gauss", 7, 3, 0, 1))
    assert torch.equal(ra.CoordinateWiseMedian(f=2)(-x), -ra.CoordinateWiseMedian(f=2)(x))


UNAN = [s for s in RULES if s.unanimous]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("spec", UNAN, ids=_ids(UNAN))
@settings(max_examples=examples(5))
@given(f=st.integers(0, 2), d=st.integers(1, 6), seed=st.integers(0, 2**32 - 1))
def test_unanimity(spec, dtype, f, d, seed):
    n = spec.min_n(f) + 1
    r = torch.tensor(np.random.default_rng(seed).normal(size=d) * 100.0, dtype=dtype)
    x = r.repeat(n, 1)
    out = spec.build(f)(x)
    if spec.selects_rows == "row" or spec.name in ("coordinate_median",):
        assert torch.equal(out, r)
    else:  # averages of n equal values: within a few roundings
        assert torch.allclose(out, r, rtol=0, atol=_atol(x, spec)), (out, r)


def test_centered_clipping_unanimity_needs_enough_radius():
    # Not unanimous in general (declared so): from v = 0 each step moves at most tau.
    r = torch.tensor([30.0, 40.0], dtype=torch.float64)  # norm 50
    out = ra.CenteredClipping(tau=10.0, iterations=3)(r.repeat(5, 1))
    assert torch.allclose(out, r * (30.0 / 50.0), atol=1e-12)  # moved 3 * 10 along r
    out = ra.CenteredClipping(tau=10.0, iterations=5)(r.repeat(5, 1))
    assert torch.allclose(out, r, atol=1e-12)


# --- calling convention ----------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["f64", "f32", "bf16"])
@pytest.mark.parametrize("spec", RULES, ids=RULE_IDS)
def test_calling_convention(spec, dtype, device):
    f = 1
    n = spec.min_n(f) + 2
    x = torch.tensor(make_input("gauss", n, 5, f, 7), dtype=dtype, device=device)
    before, version = x.clone(), x._version
    out = spec.build(f)(x)
    assert out.shape == (5,) and out.dtype == dtype and out.device == x.device
    assert x._version == version and torch.equal(x, before), "input mutated"
    assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr(), "output shares the input's storage"
    out.add_(1.0)  # writing to the output never reaches the input
    assert torch.equal(x, before)
    from_list = spec.build(f)([row for row in x])
    assert torch.equal(from_list, spec.build(f)(x))


@pytest.mark.parametrize("name", ["nnm", "bucketing", "clipping", "arc"])
def test_maps_calling_convention(name):
    x = torch.tensor(make_input("gauss", 7, 4, 1, 3), dtype=torch.float32)
    before, version = x.clone(), x._version
    pre = ra.get(name, f=1)
    out = pre(x)
    assert out.dtype == x.dtype and out.shape[1] == 4 and out.shape[0] == pre.output_rows(7)
    assert x._version == version and torch.equal(x, before)
    assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert torch.equal(ra.get(name, f=1)([r for r in x]), out)


def test_maps_that_change_nothing_still_copy():
    # ARC with f = 0 clips nothing and Clipping with a huge tau scales nothing: still new tensors.
    x = torch.ones(4, 3)
    for pre in (ra.ARC(f=0), ra.Clipping(tau=1e9)):
        out = pre(x)
        assert torch.equal(out, x) and out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


@pytest.mark.parametrize("spec", RULES, ids=RULE_IDS)
def test_declared_flags_match_the_database(spec):
    rule = spec.build(1)
    assert rule.translation_equivariant == spec.translation_equivariant
    assert rule.permutation_invariant == spec.permutation_invariant
    assert rule.selects_rows == (spec.selects_rows != "")


@pytest.mark.parametrize("spec", [s for s in RULES if s.selects_rows == "row"],
                         ids=_ids([s for s in RULES if s.selects_rows == "row"]))
def test_row_selection_returns_an_input_row_exactly(spec):
    x = torch.tensor(make_input("outliers", 9, 6, 2, 11), dtype=torch.float32)
    out = spec.build(2)(x)
    assert any(torch.equal(out, row) for row in x)


def test_deterministic_repeated_calls():
    x = torch.tensor(make_input("dups", 11, 5, 2, 5))
    for spec in RULES:
        if spec.fresh:
            continue
        rule = spec.build(2) if spec.min_n(2) <= 11 else spec.build(1)
        assert torch.equal(rule(x), rule(x)), spec.name
