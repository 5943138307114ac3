"""Float64 statistics of the honest rows shared by the attacks (no validation here)."""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

__all__ = ["mean64", "std64", "norm64", "direction", "pow2_scale", "randn64", "rand64", "DIRECTIONS"]

#: Perturbation directions of Shejwalkar & Houmansadr (NDSS 2021).
DIRECTIONS = ("unit", "std", "sign")


def mean64(x: torch.Tensor) -> torch.Tensor:
    """Row mean ``(h, d) -> (d,)`` accumulated and returned in float64."""
    return x.mean(dim=0, dtype=torch.float64)


def std64(x: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise standard deviation with ddof = 1 in float64; zero for a single row.

    ``(h, d) -> (d,)`` float64, the bits of ``x.to(torch.float64).std(dim=0, correction=1)``. On
    CPU with ``d >= 2`` it is computed by :func:`_welford_std`, about 2 to 3 times faster than
    torch's kernel (which runs its Welford update one element at a time); otherwise by torch.
    """
    if x.shape[0] < 2:
        return torch.zeros(x.shape[1], dtype=torch.float64, device=x.device)
    if x.device.type != "cpu" or x.shape[1] < 2:
        return x.to(torch.float64).std(dim=0, correction=1)
    return _welford_std(x)


def _welford_std(x: torch.Tensor) -> torch.Tensor:
    """Torch's CPU standard deviation over rows (``dim=0``, ddof = 1), one whole row per update.

    Definition (Welford, Technometrics 1962; the update torch's ``WelfordOps`` applies to each
    column, rows in order, in float64): ``mean_0 = m2_0 = 0``; for row k = 1..h,
    ``delta = x_k - mean``, ``mean <- mean + delta / k``, ``m2 <- m2 + delta * (x_k - mean)``;
    ``std = sqrt(m2 / (h - 1))`` with a correctly rounded square root (``numpy.sqrt``, as torch's
    ``std::sqrt``; ``torch.sqrt`` is not always correctly rounded on CPU). Every operation is one
    IEEE-rounded elementwise operation, so the result is bitwise torch's, tested in
    ``tests/test_attacks.py``; with ``d == 1`` torch reduces a contiguous column by another
    order, so :func:`std64` leaves that case to torch.

    Shape: ``x`` ``(h, d)`` on CPU, any floating dtype, ``h >= 2``; returns ``(d,)`` float64.
    """
    a = x.detach().to(torch.float64).numpy()
    h, d = a.shape
    mean, m2 = np.zeros(d), np.zeros(d)
    delta, tmp = np.empty(d), np.empty(d)
    for k in range(h):
        row = a[k]
        np.subtract(row, mean, out=delta)
        np.divide(delta, float(k + 1), out=tmp)
        mean += tmp
        np.subtract(row, mean, out=tmp)
        tmp *= delta
        m2 += tmp
    m2 /= float(h - 1)
    return torch.from_numpy(np.sqrt(m2, out=m2))


def norm64(v: torch.Tensor) -> float:
    """Euclidean norm of a float64 vector without overflow in the squares (scaled by max |v_j|)."""
    scale = float(v.abs().max()) if v.numel() else 0.0
    if scale == 0.0:
        return 0.0
    return scale * math.sqrt(float(((v / scale) ** 2).sum()))


def direction(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Perturbation direction p ``(d,)`` float64 for the honest rows ``x``.

    ``unit``: ``-mean / ||mean||`` (zero when the mean is zero); ``std``: ``-std`` (ddof = 1, zero
    for one row); ``sign``: ``-sign(mean)``.
    """
    if kind == "std":
        return -std64(x)
    mu = mean64(x)
    if kind == "sign":
        return -torch.sign(mu)
    nrm = norm64(mu)
    return torch.zeros_like(mu) if nrm == 0.0 else -(mu / nrm)


def pow2_scale(x: torch.Tensor) -> float:
    """The smallest power of two >= max |x| (1.0 for an all-zero x): dividing by it is exact."""
    m = float(x.abs().max()) if x.numel() else 0.0
    if m == 0.0 or not math.isfinite(m):
        return 1.0
    return math.ldexp(1.0, math.frexp(m)[1])


def randn64(shape: tuple[int, ...], generator: Optional[torch.Generator], device: torch.device) -> torch.Tensor:
    """Standard normal float64 samples drawn on the generator's device (CPU when None), moved to ``device``."""
    gdev = generator.device if generator is not None else torch.device("cpu")
    return torch.randn(shape, generator=generator, dtype=torch.float64, device=gdev).to(device)


def rand64(shape: tuple[int, ...], generator: Optional[torch.Generator], device: torch.device) -> torch.Tensor:
    """Uniform ``[0, 1)`` float64 samples drawn like :func:`randn64`."""
    gdev = generator.device if generator is not None else torch.device("cpu")
    return torch.rand(shape, generator=generator, dtype=torch.float64, device=gdev).to(device)
