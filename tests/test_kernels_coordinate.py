"""Fast coordinate-wise kernels against their sort-based references.

The comparator-network kernels must return bitwise the reference's order statistics (median) and
average exactly the same values (trimmed mean, MeaMed), so they may differ only by summation order:
``|fast - ref| <= 4 m eps max|x|`` for an average of ``m`` values (``eps`` of the dtype). Inputs
include ties (small integers), duplicated rows, constant columns, several column chunks (the chunk
size is shrunk so that a few hundred columns already span many chunks) and the torch backend that
CUDA tensors use (forced on CPU).
"""

from __future__ import annotations

import pytest
import torch

import robustagg.functional.coordinate as C
import robustagg.functional.selection as S

DTYPES = [torch.float32, torch.float64, torch.bfloat16]


@pytest.fixture(params=["numpy", "torch"])
def backend(request, monkeypatch):
    monkeypatch.setattr(S, "FORCE_TORCH", request.param == "torch")
    monkeypatch.setattr(S, "CPU_CHUNK_BYTES", 4096)  # many chunks even for small d
    return request.param


def _inputs(n: int, d: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(n, d, generator=g).to(dtype)
    ties = torch.randint(-2, 3, (n, d), generator=g).to(dtype)          # many exact ties
    dup = torch.randn(n, d, generator=g).to(dtype)
    dup[n // 2:] = dup[0]                                               # duplicated rows
    mixed = torch.randn(n, d, generator=g).to(dtype)
    mixed[:, : d // 3] = 1.5                                            # constant columns
    mixed[: max(1, n // 4), d // 3: 2 * d // 3] = 1e6                   # a block of outliers
    return [normal, ties, dup, mixed]


def _tol(x: torch.Tensor, m: int) -> float:
    return 4 * m * torch.finfo(x.dtype).eps * float(x.abs().max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 11, 20, 21])
def test_median_is_bitwise_the_reference(backend, dtype, n):
    for x in _inputs(n, 300, dtype, seed=n):
        assert torch.equal(C.coordinate_median(x), C.coordinate_median_reference(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [3, 4, 5, 8, 11, 20, 21])
def test_trimmed_mean_matches_reference(backend, dtype, n):
    for f in range(0, (n + 1) // 2):
        for x in _inputs(n, 257, dtype, seed=10 * n + f):
            fast, ref = C.trimmed_mean(x, f), C.trimmed_mean_reference(x, f)
            assert torch.allclose(fast, ref, rtol=0, atol=_tol(x, n - 2 * f)), (f, (fast - ref).abs().max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 12, 20, 21])
def test_meamed_matches_reference_including_ties(backend, dtype, n):
    for f in range(0, n):
        for x in _inputs(n, 203, dtype, seed=100 * n + f):
            fast, ref = C.meamed(x, f), C.meamed_reference(x, f)
            assert torch.allclose(fast, ref, rtol=0, atol=_tol(x, n - f)), (f, (fast - ref).abs().max())


def test_meamed_tie_at_the_boundary_keeps_the_lower_row(backend):
    # n = 3, f = 1: median 1; distances |0-1| = |2-1| = 1 tie; the lower row's value is kept.
    x = torch.tensor([[0.0], [2.0], [1.0]])
    assert C.meamed(x, 1).tolist() == [0.5]          # (1 + 0) / 2: row 0 (value 0) kept
    assert C.meamed(x[[1, 0, 2]], 1).tolist() == [1.5]  # (1 + 2) / 2: now the 2 is in row 0
    # Even n: median of [1, 2, 3, 5] is 2.5; keep 3: distances 1.5, 0.5, 0.5, 2.5 -> (1 + 2 + 3) / 3 = 2.
    assert C.meamed(torch.tensor([[5.0], [2.0], [3.0], [1.0]]), 1).tolist() == [2.0]


def test_hand_computed_values(backend):
    x = torch.tensor([[1.0, 9.0], [2.0, 0.0], [4.0, 1.0], [100.0, 3.0], [5.0, 5.0]])
    # column 0 sorted 1 2 4 5 100, column 1 sorted 0 1 3 5 9
    assert C.coordinate_median(x).tolist() == [4.0, 3.0]
    assert torch.allclose(C.trimmed_mean(x, 1), torch.tensor([11 / 3, 3.0]))  # (2+4+5)/3, (1+3+5)/3
    # MeaMed f=1: col 0 drops 100 -> (1+2+4+5)/4 = 3; col 1 median 3 drops 9 -> (0+1+3+5)/4 = 2.25
    assert C.meamed(x, 1).tolist() == [3.0, 2.25]


def test_rows_argument_equals_the_gathered_rows(backend):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(15, 500, generator=g)
    rows = [14, 2, 7, 7, 0, 3, 11, 9, 5]
    sub = x[rows]
    assert torch.equal(C.coordinate_median(x, rows=rows), C.coordinate_median(sub))
    assert torch.equal(C.trimmed_mean(x, 2, rows=rows), C.trimmed_mean(sub, 2))
    assert torch.equal(C.meamed(x, 4, rows=rows), C.meamed(sub, 4))
    assert torch.equal(C.trimmed_mean(x, 0, rows=rows), sub.mean(dim=0))


def test_input_is_not_modified_and_output_is_not_a_view(backend):
    x = torch.randn(9, 1000)
    before = x.clone()
    for out in (C.coordinate_median(x), C.trimmed_mean(x, 2), C.meamed(x, 3)):
        assert out.shape == (1000,) and out.dtype == x.dtype
        assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert torch.equal(x, before)


def test_default_chunking_on_a_wide_input():
    # The default chunk size: a few chunks of real width, with ties in several of them.
    g = torch.Generator().manual_seed(7)
    x = torch.randint(-3, 4, (20, 70_001), generator=g).float()
    x[:, ::7] += torch.randn(20, 10_001, generator=g)
    assert torch.equal(C.coordinate_median(x), C.coordinate_median_reference(x))
    assert torch.allclose(C.trimmed_mean(x, 4), C.trimmed_mean_reference(x, 4), rtol=0, atol=_tol(x, 12))
    assert torch.allclose(C.meamed(x, 4), C.meamed_reference(x, 4), rtol=0, atol=_tol(x, 16))


def test_extreme_finite_values():
    big = torch.finfo(torch.float32).max
    x = torch.tensor([[big, -big, 1e-45], [1e20, -1e20, 0.0], [-big, big, -1e-45], [3.0, 3.0, 1e-45]])
    assert torch.equal(C.coordinate_median(x), C.coordinate_median_reference(x))
    assert torch.equal(C.meamed(x, 1), C.meamed_reference(x, 1))
    assert torch.isfinite(C.trimmed_mean(x, 1)).all()
