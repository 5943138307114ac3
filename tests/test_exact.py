"""The exact arithmetic behind SMEA's ties (robustagg.functional.exact), against Python's Fractions and numpy."""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest
import torch

import reference as R
import robustagg as ra
from robustagg.functional import exact as E
from robustagg.functional import spectral as S


def _poly(roots) -> list[int]:
    """Integer coefficients (lowest degree first) of prod (t - r) over integer roots."""
    p = [1]
    for r in roots:
        p = [(p[i - 1] if i else 0) - r * (p[i] if i < len(p) else 0) for i in range(len(p) + 1)]
    return p


@pytest.mark.parametrize("dtype, span", [(torch.float64, 300), (torch.float32, 30), (torch.float16, 4),
                                         (torch.bfloat16, 30)])
def test_exact_gram_is_the_rational_gram(dtype, span):
    # Values over many binades (float64 from 1e-300 to 1e300) and exact zeros: every product and
    # sum is exact in Python's Fractions; the limbs must give the same numbers times one power of 2.
    rng = np.random.default_rng(span)
    x = torch.tensor(rng.normal(size=(4, 37)) * 10.0 ** rng.integers(-span, span + 1, size=(4, 37))).to(dtype)
    x[1, :5] = 0
    x[3] = 0
    g, e = E.exact_gram(x)
    rows = [[Fraction(v) for v in r] for r in x.double().tolist()]
    for i, j in itertools.product(range(4), repeat=2):
        assert Fraction(g[i][j]) * Fraction(2) ** e == sum(a * b for a, b in zip(rows[i], rows[j])), (i, j)


def test_exact_gram_over_several_column_chunks():
    x = torch.tensor(np.random.default_rng(0).normal(size=(3, 40_000)))
    g, e = E.exact_gram(x)
    rows = [[Fraction(v) for v in r] for r in x.tolist()]
    assert Fraction(g[0][2]) * Fraction(2) ** e == sum(a * b for a, b in zip(rows[0], rows[2]))


def test_exact_matrix_is_the_floats():
    g = torch.tensor([[0.1, -3.0], [1e-300, 0.0]], dtype=torch.float64)
    ints, e = E.exact_matrix(g)
    assert [[Fraction(v) * Fraction(2) ** e for v in r] for r in ints] == [[Fraction(v) for v in r] for r in g.tolist()]


def test_charpoly_matches_numpy():
    rng = np.random.default_rng(1)
    for k in range(1, 7):
        a = rng.integers(-5, 6, size=(k, k))
        a = a @ a.T
        ref = np.poly(a.astype(float))[::-1]
        assert np.allclose(E.charpoly(a.tolist()), ref, rtol=1e-9, atol=1e-6)


def test_centred_block_is_k_cubed_times_the_covariance():
    # Rows 0, 1, 3 of 1-D (1, 1, 3, -1): deviations 2/3, 2/3, -4/3, variance 8/9; the centred block
    # times k^2 = 9 has the single non-zero eigenvalue 27 * 8/9 = 24.
    g, _ = E.exact_gram(torch.tensor([[1.0], [1.0], [3.0], [-1.0]]))
    assert E.charpoly(E.centred_block(g, (0, 1, 3))) == [0, 0, -24, 1]


@pytest.mark.parametrize("p, q, want", [
    (_poly([1, 2, 3]), _poly([3, 1]), 0),
    (_poly([1, 2, 3]), _poly([4]), -1),
    (_poly([5]), _poly([2, 2, 5]), 0),          # a repeated root below the top one
    (_poly([0, 0]), _poly([0]), 0),             # both zero
    (_poly([0, 1]), _poly([0]), 1),
    (_poly([7, 1]), _poly([6, 7, 7]), 0),       # a repeated top root
    (_poly([7, 7, 1]), _poly([6, 6]), 1),
    ([-2, 0, 1], [-4, 0, 2], 0),                # sqrt2, from two polynomials
    ([-2, 0, 1], [-3, 0, 1], -1),               # sqrt2 < sqrt3
    ([-2, 0, 1], [-14142135623730950, 10**16], 1),   # sqrt2 = 1.41421356237309504...
    ([-2, 0, 1], [-14142135623730951, 10**16], -1),
    (_poly([1]) and [2, -2, -1, 1], [2, -4, -1, 2], 0),  # (t^2 - 2)(t - 1) and (t^2 - 2)(2t - 1): sqrt2
])
def test_compare_top_roots_exactly(p, q, want):
    assert E.compare_top_roots(p, q) == want
    assert E.compare_top_roots(q, p) == -want


def test_compare_top_roots_checks_its_guesses():
    # A wrong interval (it holds no root) and one holding two roots are both discarded.
    p, q = _poly([2, 5]), _poly([5])
    assert E.compare_top_roots(p, q, (Fraction(6), Fraction(7)), (Fraction(1), Fraction(6))) == 0
    assert E.compare_top_roots(p, _poly([4]), (Fraction(9, 2), Fraction(11, 2)), (Fraction(7, 2), Fraction(9, 2))) == 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_smea_mirror_tie_at_large_d(dtype):
    # Rows 0, h0, h1, -h0, -h1 (d = 500; negation is exact in every format): a subset and its
    # mirror image (h_i <-> -h_i) have the same covariance, so the best subset ties exactly with its
    # image, while their float64 values may differ in the last bits. The first of the two must win.
    h = torch.tensor(np.random.default_rng(7).normal(size=(2, 500)), dtype=dtype)
    x = torch.cat([torch.zeros(1, 500, dtype=dtype), h, -h])
    chosen = tuple(torch.nonzero(ra.SMEA(f=2).weights(x)).flatten().tolist())
    image = tuple(sorted({0: 0, 1: 3, 2: 4, 3: 1, 4: 2}[i] for i in chosen))
    assert chosen < image
    assert np.allclose(ra.SMEA(f=2)(x).numpy(), R.smea(x, 2), rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-6)


def test_smea_select_without_rows_decides_ties_on_the_gram_values():
    x = torch.tensor([[1.0], [1.0], [3.0], [-1.0]], dtype=torch.float64)
    g = ra.functional.gram.robust_gram(x)
    assert S.smea_select(g, 1).tolist() == [0, 1, 2]
    assert S.smea_select(g, 1, x).tolist() == [0, 1, 2]


def test_smea_copies_tie_without_exact_arithmetic(monkeypatch):
    # Rows 0 and 3 are bitwise copies of b = (0, 0), with p = (1, 0) and q near (1/2, sqrt3/2): the
    # triangle {b, p, q} has top eigenvalue about 1/6, below the 2/9 of {b, b, p} and {b, b, q}. The
    # subsets {0, 1, 2} and {1, 2, 3} hold the same rows and tie exactly; the first is kept without
    # an exact Gram matrix.
    monkeypatch.setattr(E, "exact_gram", lambda x: pytest.fail("exact Gram computed for copies"))
    x = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.5, 0.8660254037844386], [0.0, 0.0]], dtype=torch.float64)
    assert torch.nonzero(ra.SMEA(f=1).weights(x)).flatten().tolist() == [0, 1, 2]
    assert np.allclose(ra.SMEA(f=1)(x).numpy(), R.smea(x, 1), rtol=0, atol=1e-15)
