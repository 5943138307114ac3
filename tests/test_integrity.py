"""robustagg.integrity: checksums over bytes, reports that name every failed check, no mutation."""

from __future__ import annotations

import hashlib

import pytest
import torch
import xxhash

from robustagg.errors import ShapeError
from robustagg.integrity import checksum, digest, inspect, inspect_rows


def _xxh3_signed(raw: bytes) -> int:
    return int.from_bytes(xxhash.xxh3_64_digest(raw), "big", signed=True)  # the digest's bytes are big-endian


def test_checksum_is_xxh3_64_and_digest_is_blake2b_64_of_the_bytes_as_signed_int64():
    t = torch.tensor([1.0, 2.0], dtype=torch.float32)
    # float32 1.0 = 0x3F800000, 2.0 = 0x40000000, little-endian bytes in C order.
    raw = bytes([0x00, 0x00, 0x80, 0x3F, 0x00, 0x00, 0x00, 0x40])
    assert checksum(t) == _xxh3_signed(raw)
    assert digest(t) == int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little", signed=True)
    for v in (checksum(t), digest(t)):
        assert -(2**63) <= v < 2**63
    # the two's-complement reading covers both halves of the unsigned range
    signs = {checksum(torch.tensor([float(i)])) < 0 for i in range(64)}
    assert signs == {True, False}


def test_the_vote_paths_hash_with_the_collision_resistant_digest():
    """Where a digest alone decides which bytes are accepted (the replicated return), the claims and the
    check on arrival use BLAKE2b-64; the majority of copies records the same digests."""
    import inspect as pyinspect

    from robustagg.distributed import sharded_reduction, vote
    src = pyinspect.getsource(sharded_reduction.ShardedReduction._digest_table)
    assert "digest(ob)" in src and "checksum(" not in src
    assert "if digest(piece) != majority[s]" in pyinspect.getsource(sharded_reduction)
    good, bad = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5])
    _, liars, digests = vote.majority_copy([vote.Copy(0, good), vote.Copy(1, bad), vote.Copy(2, good.clone())],
                                           step=0, what="slice 0")
    assert liars == [1] and digests == {0: digest(good), 1: digest(bad), 2: digest(good)}


def test_checksum_sees_every_bit_and_the_dtype_bytes():
    t = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    flipped = t.clone()
    flipped.view(torch.int32)[537] ^= 1  # one low mantissa bit
    assert checksum(t) != checksum(flipped)
    assert checksum(torch.tensor([0.0])) != checksum(torch.tensor([-0.0]))  # bytes differ, values compare equal
    assert checksum(t) == checksum(t.clone())
    assert checksum(t.reshape(10, 100)) == checksum(t)  # C-order bytes, shape-free
    assert checksum(t[::2]) == checksum(t[::2].contiguous())  # non-contiguous views hash their elements


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                   torch.uint8, torch.bool, torch.complex64])
def test_checksum_is_the_hash_of_the_c_order_bytes_on_every_path(dtype):
    """The zero-copy NumPy buffer (contiguous CPU tensors of the dtypes NumPy knows) and the uint8-copy path
    (bfloat16, strided views) hash the same bytes: those of the elements in row-major order."""
    base = (torch.randn(6, 5, generator=torch.Generator().manual_seed(1)) * 50).to(dtype)

    def raw(t):
        return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()

    def ref_digest(t):
        return int.from_bytes(hashlib.blake2b(raw(t), digest_size=8).digest(), "little", signed=True)

    for t in (base, base[2], base[:, 1], base.T, base[1:3], base[:0]):  # rows at an offset, strided, empty
        assert checksum(t) == _xxh3_signed(raw(t))
        assert digest(t) == ref_digest(t)
    if dtype.is_floating_point:
        leaf = base.clone().requires_grad_(True)
        assert checksum(leaf) == _xxh3_signed(raw(base)) and digest(leaf) == ref_digest(base)


def test_inspect_reports_every_problem_and_never_mutates():
    t = torch.tensor([1.0, float("nan"), float("inf"), 4.0], dtype=torch.float64)
    before = t.clone()
    r = inspect(t, row=2, expected_numel=5, expected_dtype=torch.float32, expected_checksum=123)
    assert torch.equal(t.isnan(), before.isnan()) and torch.equal(t[[0, 2, 3]], before[[0, 2, 3]])
    assert not r.ok and r.nonfinite == 2 and r.corrupted and not r.finite
    text = " | ".join(r.problems)
    assert "row 2: expected 5 entries, got 4" in text
    assert "expected dtype torch.float32, got torch.float64" in text
    assert "2 non-finite value(s)" in text
    assert "checksum mismatch (declared 123" in text
    assert r.shape == (4,) and r.dtype == "torch.float64" and r.numel == 4


def test_inspect_ok_and_rows():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, float("-inf")]])
    sums = [checksum(x[0]), checksum(x[1]) ^ 1, checksum(x[2])]
    reports = inspect_rows(x, sums, expected_dtype=torch.float32)
    assert [r.ok for r in reports] == [True, False, False]
    assert [r.corrupted for r in reports] == [False, True, False]
    assert [r.nonfinite for r in reports] == [0, 0, 1]
    assert [r.row for r in reports] == [0, 1, 2]


def test_inspect_rejects_non_float_and_bad_shapes():
    assert inspect(torch.tensor([1, 2])).problems == ("submission: expected a floating dtype, got torch.int64",)
    with pytest.raises(ShapeError, match=r"x must be \(n, d\)"):
        inspect_rows(torch.zeros(3))
    with pytest.raises(ShapeError, match="one entry per row"):
        inspect_rows(torch.zeros(2, 3), [1])
