"""Pre-aggregation kernels (bucketing, clipping, ARC, row norms) against plain reformulations."""

from __future__ import annotations

import math

import torch

import robustagg.functional as F
from robustagg.functional._alloc import empty_rows
from robustagg.functional.preagg import row_norms


def test_row_norms_are_float64_and_do_not_overflow():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 300_001, generator=g)
    x[3] = 1e20  # squares overflow float32
    want = torch.linalg.vector_norm(x.double(), dim=1)
    got = row_norms(x)
    assert got.dtype == torch.float64
    assert float(((got - want).abs() / want).max()) < 1e-12
    x64 = x.double()
    assert torch.equal(row_norms(x64), torch.linalg.vector_norm(x64, dim=1))


def test_bucketing_equals_gathered_means():
    x = torch.randn(11, 1000, generator=torch.Generator().manual_seed(1))
    for s in (1, 2, 3, 4, 11):
        perm = torch.randperm(11, generator=torch.Generator().manual_seed(5))
        want = torch.stack([x[perm[i:i + s]].mean(dim=0) for i in range(0, 11, s)])
        got = F.bucketing(x, s, torch.Generator().manual_seed(5))
        # s <= 2: the same additions; larger buckets: summation order only.
        assert torch.allclose(got, want, rtol=0, atol=4 * s * 2 ** -23 * float(x.abs().max()))
        if s <= 2:
            assert torch.equal(got, want)


def test_clipping_and_arc_scale_rows_by_their_float64_factors():
    x = torch.randn(8, 2000, generator=torch.Generator().manual_seed(2))
    x[1] *= 1e3
    norms = torch.linalg.vector_norm(x.double(), dim=1)
    factor = torch.clamp(1.0 / norms, max=1.0)  # tau = 1
    assert torch.equal(F.clipping(x, 1.0), x * factor.to(x.dtype)[:, None])
    arc = F.arc(x, 2)
    # k = floor(2 * 2 * 6 / 8) = 3 largest rows scaled to the 4th largest norm.
    k, order = 3, torch.argsort(norms, descending=True)
    assert torch.allclose(torch.linalg.vector_norm(arc[order[:k]].double(), dim=1),
                          norms[order[k]].expand(k), rtol=1e-6)
    assert torch.equal(arc[order[k:]], x[order[k:]])


def test_empty_rows_is_an_ordinary_tensor():
    like = torch.zeros(1, dtype=torch.float32)
    big = empty_rows((3, 1 << 22), like)  # 48 MiB: huge-page hint on Linux
    assert big.shape == (3, 1 << 22) and big.dtype == torch.float32 and big.is_contiguous()
    big.fill_(2.0)
    assert float(big.sum()) == 2.0 * 3 * (1 << 22)
    small = empty_rows((5,), torch.zeros(1, dtype=torch.float64))
    assert small.dtype == torch.float64 and not math.isnan(float(small.fill_(1.0).sum()))
