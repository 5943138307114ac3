"""Exact arithmetic for the decisions rounding must not take: which of two top eigenvalues is smaller.

SMEA (:func:`~robustagg.functional.spectral.smea_select`) keeps the first subset among those whose
covariance has the smallest top eigenvalue. Two subsets can tie exactly (mirror images, symmetric
configurations) while their float64 eigenvalues differ in the last bits, either way; and two
eigenvalues that differ by less than rounding cannot be ordered in floating point at all. So the
subsets whose float64 values are within rounding of the best are compared here, exactly:

1. Every float (float16, bfloat16, float32 or float64) is a dyadic rational ``m 2^e``. The rows'
   Gram matrix is computed exactly, as Python integers times one common power of two
   (:func:`exact_gram`): each value is cut into 16-bit limbs, and a float64 matrix product of
   limbs over at most 2^20 columns is exact (every partial sum is an integer below 2^53).
2. The centred Gram block of a subset of ``k`` rows, times ``k^2``, is an integer matrix ``A``
   whose eigenvalues are ``k^3`` times the covariance's (:func:`centred_block`); its
   characteristic polynomial has integer coefficients (:func:`charpoly`, Faddeev-LeVerrier).
3. The largest root of such a polynomial (all roots are real and non-negative) is isolated by
   Sturm sequences at dyadic points; two largest roots are equal exactly when both are roots of
   the two polynomials' greatest common divisor, and otherwise ordered by bisection until their
   intervals separate (:func:`compare_top_roots`).

Cost: the exact Gram is about ``(K n)^2 d`` float64 operations in matrix products, ``K =
ceil(span / 16)`` limbs for a span of ``span`` bits between the largest and the smallest set bit
of any value: 3 or 4 for float32 Gaussian rows of 10^3 to 10^6 entries, but about 130 for float64
rows that mix 1e300 and 1e-300; the polynomials, their roots at 0 divided
out, are of degree at most ``min(k - 1, d)``. None of it runs unless two subsets are within rounding of the best.
"""

from __future__ import annotations

from fractions import Fraction
from math import gcd

import numpy as np
import torch

__all__ = ["exact_gram", "exact_matrix", "centred_block", "charpoly", "compare_top_roots", "LIMB_BITS"]

#: Bits per limb of :func:`exact_gram`: a product of two limbs is below 2^32, so a float64 product
#: over 2^20 columns is an exact integer.
LIMB_BITS = 16
_CHUNK_ELEMENTS = 1 << 22  # float64 limbs per column chunk (32 MB), at most 2^20 columns


def _bits(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``|v| = m 2^(e - 53)`` with ``m`` an integer below 2^53 (``uint64``) and ``e`` (``int64``)."""
    mant, expo = np.frexp(v)
    return np.abs(mant * 2.0**53).astype(np.uint64), expo.astype(np.int64)


def _limbs(m: np.ndarray, expo: np.ndarray, sign: np.ndarray, low: int, count: int) -> np.ndarray:
    """Signed 16-bit limbs of ``v 2^-low`` for ``|v| = m 2^(expo - 53)``.

    Returns ``(count, *m.shape)`` float64 integers with ``v = 2^low sum_k limb_k 2^(16 k)``.
    """
    shift = expo - 53 - low  # |v| 2^-low = m 2^shift, an integer
    mask = np.uint64((1 << LIMB_BITS) - 1)
    out = np.empty((count, *m.shape), dtype=np.float64)
    for k in range(count):
        r = LIMB_BITS * k - shift  # limb k holds bits [16k, 16k + 16) of m 2^shift
        right = np.right_shift(m, np.clip(r, 0, 63).astype(np.uint64))
        left = np.left_shift(m, np.clip(-r, 0, LIMB_BITS).astype(np.uint64))
        out[k] = np.where(r >= 0, right, left) & mask
    return out * sign


def exact_gram(x: torch.Tensor) -> tuple[list[list[int]], int]:
    """Exact Gram matrix of finite float rows: integers times a power of two.

    Args:
        x: ``(n, d)`` finite rows of any float dtype (converted to float64, which is exact).

    Returns:
        ``(G, e)``: an ``n x n`` nested list of Python integers with ``<x_i, x_j> = G[i][j] 2^e``
        exactly (``e`` twice the exponent of the lowest set bit of any value).
    """
    v = x.detach().to(device="cpu", dtype=torch.float64).numpy()
    n, d = v.shape
    m, expo = _bits(v)
    nz = m != 0
    if not nz.any():
        return [[0] * n for _ in range(n)], 0
    mz, ez = m[nz], expo[nz]
    low = int((ez - 53 + np.log2((mz & (~mz + np.uint64(1))).astype(np.float64)).astype(np.int64)).min())
    count = -(-int((ez - low).max()) // LIMB_BITS)  # limbs of the largest |v| 2^-low
    total = np.zeros((count * n, count * n), dtype=np.int64)
    sign = np.sign(v)
    width = min(1 << 20, max(1, _CHUNK_ELEMENTS // (count * n)))
    for c in range(0, d, width):
        cols = slice(c, c + width)
        part = _limbs(m[:, cols], expo[:, cols], sign[:, cols], low, count).reshape(count * n, -1)
        total += (part @ part.T).astype(np.int64)  # exact: sums of at most 2^20 products below 2^32
    out = [[0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i, n):
            out[i][j] = out[j][i] = sum(int(total[a * n + i, b * n + j]) << (LIMB_BITS * (a + b))
                                        for a in range(count) for b in range(count))
    return out, 2 * low


def exact_matrix(g: torch.Tensor) -> tuple[list[list[int]], int]:
    """The float entries of ``g`` exactly, as :func:`exact_gram` returns them: ``(ints, e)``, ``g = ints 2^e``."""
    v = g.detach().to(device="cpu", dtype=torch.float64).numpy()
    m, expo = _bits(v)
    nz = m != 0
    if not nz.any():
        return [[0] * v.shape[1] for _ in range(v.shape[0])], 0
    low = int((expo - 53)[nz].min())
    return [[(int(m[i, j]) << int(expo[i, j] - 53 - low)) * (1 if v[i, j] > 0 else -1) if nz[i, j] else 0
             for j in range(v.shape[1])] for i in range(v.shape[0])], low


def centred_block(g: list[list[int]], rows: tuple[int, ...]) -> list[list[int]]:
    """``k^2 H G_SS H`` as integers (``H = I - 11^T/k``, ``k = len(rows)``): ``k^3`` times the covariance's Gram.

    Its eigenvalues are ``k^3`` times those of ``Sigma_S = (1/k) sum_{i in S} (x_i - mu_S)(x_i - mu_S)^T``
    (``H G_SS H = Y Y^T`` for the centred rows ``Y``, whose non-zero eigenvalues are ``k`` times
    ``Sigma_S``'s), the same factor for every subset of ``k`` rows.
    """
    k = len(rows)
    sub = [[g[i][j] for j in rows] for i in rows]
    r = [sum(row) for row in sub]
    t = sum(r)
    return [[k * k * sub[i][j] - k * (r[i] + r[j]) + t for j in range(k)] for i in range(k)]


def charpoly(a: list[list[int]]) -> list[int]:
    """Characteristic polynomial ``det(t I - A)`` of an integer matrix, lowest degree first (Faddeev-LeVerrier).

    Every division is exact: the coefficients of an integer matrix's characteristic polynomial are integers.
    """
    k = len(a)
    coeffs = [0] * k + [1]
    m = [[0] * k for _ in range(k)]
    for step in range(1, k + 1):
        for i in range(k):
            m[i][i] += coeffs[k - step + 1]
        am = [[sum(a[i][l] * m[l][j] for l in range(k)) for j in range(k)] for i in range(k)]
        coeffs[k - step] = -sum(am[i][i] for i in range(k)) // step
        m = am
    return coeffs


# --- integer polynomials, lowest degree first -------------------------------------------------------------
def _trim(p: list[int]) -> list[int]:
    while len(p) > 1 and p[-1] == 0:
        p = p[:-1]
    return p


def _primitive(p: list[int]) -> list[int]:
    """``p`` divided by the gcd of its coefficients (a positive number: signs are kept)."""
    c = 0
    for v in p:
        c = gcd(c, v)
    return [v // c for v in p] if c > 1 else p


def _rem(a: list[int], b: list[int]) -> list[int]:
    """A positive multiple of the remainder of ``a`` by ``b`` (integer pseudo-division), made primitive."""
    a, lead = list(a), b[-1]
    scale = abs(lead)
    while len(a) >= len(b) and any(a):
        q = a[-1]
        shift = len(a) - len(b)
        a = [v * scale for v in a]
        sq = q if lead > 0 else -q
        for i, bv in enumerate(b):
            a[shift + i] -= sq * bv
        a = _trim(a[:-1]) if len(a) > 1 else [0]
    return _primitive(_trim(a))


def _gcd(a: list[int], b: list[int]) -> list[int]:
    a, b = _primitive(_trim(a)), _primitive(_trim(b))
    while any(b):
        a, b = b, _rem(a, b)
    return a


def _sturm(p: list[int]) -> list[list[int]]:
    deriv = [i * p[i] for i in range(1, len(p))] or [0]
    seq = [p, _primitive(_trim(deriv))]
    while len(seq[-1]) > 1:
        r = _rem(seq[-2], seq[-1])
        if not any(r):
            break
        seq.append([-v for v in r])
    return seq


def _sign_at(p: list[int], x: Fraction) -> int:
    """Sign of ``p(x)`` for a dyadic ``x >= 0`` (integer arithmetic: ``2^(e deg p) p(num / 2^e)``)."""
    num, den = x.numerator, x.denominator
    e = den.bit_length() - 1
    deg = len(p) - 1
    acc = p[-1]
    for i in range(deg - 1, -1, -1):
        acc = acc * num + (p[i] << (e * (deg - i)))
    return (acc > 0) - (acc < 0)


def _changes(values: list[int]) -> int:
    """Sign changes along ``values``, zeros skipped."""
    s = [v > 0 for v in values if v]
    return sum(1 for u, w in zip(s, s[1:]) if u != w)


class _TopRoot:
    """The largest root of ``p`` (all roots real and >= 0), isolated in an open dyadic interval ``(lo, hi)``.

    ``guess``: dyadic ``(lo, hi)`` believed to hold the largest root and no other root; used when
    Sturm's count confirms it, else the search starts from ``(0, Cauchy's bound)``.
    """

    def __init__(self, p: list[int], guess: tuple[Fraction, Fraction] | None = None) -> None:
        p = _trim(p)
        while len(p) > 1 and p[0] == 0:  # divide out the roots at 0
            p = p[1:]
        self.p = _primitive(p) if any(p) else p
        self.zero = len(self.p) == 1  # every root is 0
        if self.zero:
            return
        self.seq = _sturm(self.p)
        if guess is not None:
            lo, hi = max(guess[0], Fraction(0)), guess[1]
            if (lo < hi and _sign_at(self.p, lo) and _sign_at(self.p, hi) and self.above(lo) == 1
                    and self.above(hi) == 0):
                self.lo, self.hi = lo, hi
                return
        bound = 1 + max(abs(Fraction(c, self.p[-1])) for c in self.p[:-1])  # Cauchy: every root below
        self.lo, self.hi = Fraction(0), Fraction(1 << int(bound).bit_length())
        while self.above(self.lo) > 1:
            self.bisect()

    def above(self, x: Fraction, seq: list[list[int]] | None = None) -> int:
        """Distinct roots of ``seq[0]`` (default ``p``) above ``x``, ``x`` not a root of it (Sturm)."""
        seq = self.seq if seq is None else seq
        return _changes([_sign_at(q, x) for q in seq]) - _changes([q[-1] for q in seq])

    def bisect(self) -> None:
        """Halve ``(lo, hi)``, keeping the largest root inside (the midpoint moves off a root of ``p``)."""
        mid, step = (self.lo + self.hi) / 2, (self.hi - self.lo) / 4
        while _sign_at(self.p, mid) == 0:
            step /= 2
            mid += step
        if self.above(mid) >= 1:
            self.lo = mid
        else:
            self.hi = mid

    def root_of(self, h: list[int]) -> bool:
        """Whether the largest root of ``p`` is a root of ``h`` (a divisor of ``p``)."""
        if len(h) == 1:
            return False
        return self.above(self.lo, _sturm(h)) >= 1  # p has no other root above lo


def compare_top_roots(p: list[int], q: list[int], guess_p: tuple[Fraction, Fraction] | None = None,
                      guess_q: tuple[Fraction, Fraction] | None = None) -> int:
    """Sign of ``max root(p) - max root(q)``, exactly, for integer polynomials with real roots >= 0 only.

    Characteristic polynomials of positive semi-definite integer matrices (:func:`charpoly` of
    :func:`centred_block`) are such polynomials. ``guess_p``, ``guess_q``: optional dyadic
    intervals thought to isolate each largest root (e.g. a float estimate plus its error bound):
    they save the search from Cauchy's bound, and are checked before use. Returns -1, 0 or 1.
    """
    a, b = _TopRoot(p, guess_p), _TopRoot(q, guess_q)
    if a.zero or b.zero:
        return (not a.zero) - (not b.zero)
    h = _gcd(a.p, b.p)
    if len(h) > 1 and a.root_of(h) and b.root_of(h):
        return 0
    while not (a.hi <= b.lo or b.hi <= a.lo):  # unequal: the intervals separate
        a.bisect()
        b.bisect()
    return -1 if a.hi <= b.lo else 1
