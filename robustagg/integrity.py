"""Integrity checks on a submission before it enters a rule: checksum, shape, dtype, finiteness.

A *submission* is one worker's flattened gradient, a ``(d,)`` tensor. The sender computes
:func:`checksum` over its bytes and ships it in a header next to the data; the receiver recomputes
it over the bytes it got and :func:`inspect` compares the two. Nothing here mutates a tensor.

Two hashes, for two jobs:

- :func:`checksum` (XXH3-64) detects *accidents*: bytes changed in transit, a rank whose state
  drifted. It runs on every row of every step (about 40 GB/s on one core, 80 times BLAKE2b's
  speed), and wherever it groups copies by value the bytes are then compared with
  :func:`torch.equal`, so a collision can never merge two different tensors.
- :func:`digest` (BLAKE2b-64) is for the places where a digest *alone* decides which bytes are
  accepted from a party that may lie (the replicated reduction accepts a slice whose bytes carry
  the majority's digest): there a forged collision must cost about ``2**64`` work, which a
  non-cryptographic hash such as XXH3 does not promise.

What a check proves, and what it does not: a matching checksum proves the bytes arrived as they
were sent (no corruption in transit); it says nothing about whether the gradient was computed
honestly. Finite, well-formed, checksum-valid but wrong rows are the robust rule's job.

Example:
    >>> import torch
    >>> from robustagg.integrity import checksum, inspect
    >>> g = torch.tensor([1.0, 2.0, 3.0])
    >>> report = inspect(g, expected_checksum=checksum(g), expected_numel=3, expected_dtype=torch.float32)
    >>> report.ok, report.problems
    (True, ())
    >>> bad = inspect(torch.tensor([1.0, float("nan"), 3.0]), expected_numel=3)
    >>> bad.ok, bad.nonfinite
    (False, 1)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import xxhash

from ._tensor import nonfinite_rows
from .errors import ShapeError

__all__ = ["checksum", "digest", "IntegrityReport", "inspect", "inspect_rows"]


#: dtypes whose CPU tensors NumPy can view without a copy (bfloat16 and the float8 types it cannot).
_NUMPY_VIEWABLE = frozenset({torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                             torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128})


def _bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes in C order as a buffer ``hashlib`` reads without a copy (a contiguous CPU
    tensor's own NumPy view, else a ``uint8`` view of a contiguous copy)."""
    if (t.device.type == "cpu" and t.dtype in _NUMPY_VIEWABLE and t.is_contiguous() and not t.is_conj()
            and not t.is_neg()):
        return t.detach().numpy().data  # C-contiguous: its buffer is exactly the row-major bytes
    flat = t.detach().resolve_conj().resolve_neg().reshape(-1)  # a conjugate or negative view: its values
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous()
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data


def checksum(t: torch.Tensor) -> int:
    """XXH3-64 checksum of a tensor's raw bytes (C order), as a signed 64-bit integer: the transport check.

    Definition: ``xxh3_64(bytes(t))`` (seed 0) read as a two's-complement ``int64``, where
    ``bytes(t)`` is the tensor's elements in row-major order in its own dtype (a CUDA tensor is
    copied to the host first). The value fits an ``int64`` tensor, so it can travel in a header.
    It detects accidental changes (any flipped bit changes it except with probability about
    ``2**-64``); it is **not** collision resistant against a party that chooses the bytes: where a
    digest alone decides which bytes are accepted, use :func:`digest`.

    Args:
        t: any tensor (any shape, dtype and device); not modified.

    Returns:
        a Python int in ``[-2**63, 2**63)``. Equal bytes give equal checksums; ``-0.0`` and ``0.0``
        (or two NaN payloads) differ, as they should for a byte-level transport check.

    Never raises for a tensor argument. Needs no (n, f) assumption. Source: Collet, xxHash (XXH3, 2019-2020), through the ``xxhash``
    package.

    Example:
        >>> import torch
        >>> checksum(torch.zeros(3)) == checksum(torch.zeros(3)), checksum(torch.zeros(3)) == checksum(torch.ones(3))
        (True, False)
    """
    v = xxhash.xxh3_64_intdigest(_bytes(t))
    return v - (1 << 64) if v >= 1 << 63 else v


def digest(t: torch.Tensor) -> int:
    """BLAKE2b-64 digest of a tensor's raw bytes (C order), as a signed 64-bit integer.

    Definition: ``int.from_bytes(blake2b(bytes(t), digest_size=8), "little", signed=True)``, with
    ``bytes(t)`` as in :func:`checksum`. Use it where a digest alone decides which bytes are
    accepted from a party that may lie (a forged second preimage of a 64-bit BLAKE2b digest costs
    about ``2**64`` hash evaluations); it is some 80 times slower than :func:`checksum` (about
    0.5 GB/s on one core here), so the per-row transport check does not use it.

    Args:
        t: any tensor (any shape, dtype and device); not modified.

    Returns:
        a Python int in ``[-2**63, 2**63)``; equal bytes give equal digests.

    Never raises for a tensor argument. Needs no (n, f) assumption. Source: Aumasson, Neves, Wilcox-O'Hearn, Winnerlein, "BLAKE2"
    (ACNS 2013; RFC 7693), through Python's ``hashlib``.

    Example:
        >>> import torch
        >>> digest(torch.zeros(3)) == digest(torch.zeros(3)), digest(torch.zeros(3)) == digest(torch.ones(3))
        (True, False)
    """
    h = hashlib.blake2b(_bytes(t), digest_size=8)
    return int.from_bytes(h.digest(), "little", signed=True)


@dataclass(frozen=True)
class IntegrityReport:
    """What :func:`inspect` found about one submission.

    Attributes:
        row: the submission's index (the worker's rank), or ``None``.
        shape: the tensor's shape.
        dtype: the tensor's dtype, as text (``"torch.float32"``).
        numel: number of elements.
        nonfinite: how many entries are NaN or +-inf.
        checksum: :func:`checksum` of the bytes received.
        expected_checksum: the checksum the sender declared, or ``None`` when none was given.
        problems: one message per failed check (empty when everything holds).
    """

    row: Optional[int]
    shape: tuple[int, ...]
    dtype: str
    numel: int
    nonfinite: int
    checksum: int
    expected_checksum: Optional[int] = None
    problems: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        """True when every check passed."""
        return not self.problems

    @property
    def corrupted(self) -> bool:
        """True when a declared checksum does not match the bytes received."""
        return self.expected_checksum is not None and self.expected_checksum != self.checksum

    @property
    def finite(self) -> bool:
        """True when no entry is NaN or +-inf."""
        return self.nonfinite == 0


def inspect(t: torch.Tensor, *, row: Optional[int] = None, expected_numel: Optional[int] = None,
            expected_dtype: Optional[torch.dtype] = None, expected_checksum: Optional[int] = None) -> IntegrityReport:
    """Check one submission: 1-D, expected length and dtype, finite, checksum as declared.

    Args:
        t: the submission, a ``(d,)`` tensor as received; never modified.
        row: its index (rank), used in the messages.
        expected_numel: the model's ``d``; ``None`` skips the length check.
        expected_dtype: the agreed dtype; ``None`` skips the dtype check.
        expected_checksum: the sender's :func:`checksum`; ``None`` skips the comparison.

    Shape: ``t`` is ``(d,)`` of any floating dtype on any device.

    Returns:
        an :class:`IntegrityReport`; ``report.ok`` is True when every check passed.

    Raises:
        nothing: failures are reported, the caller decides (drop the row or abort).

    Example:
        >>> import torch
        >>> r = inspect(torch.ones(2, 2), row=3, expected_numel=4)
        >>> r.problems
        ('row 3: expected a 1-D submission (d,), got shape (2, 2)',)
    """
    problems: list[str] = []
    who = f"row {row}" if row is not None else "submission"
    if t.dim() != 1:
        problems.append(f"{who}: expected a 1-D submission (d,), got shape {tuple(t.shape)}")
    if expected_numel is not None and t.numel() != expected_numel:
        problems.append(f"{who}: expected {expected_numel} entries, got {t.numel()}")
    if expected_dtype is not None and t.dtype != expected_dtype:
        problems.append(f"{who}: expected dtype {expected_dtype}, got {t.dtype}")
    floating = t.is_floating_point() or t.is_complex()
    return _report(t, problems, who, row, expected_checksum,
                   int((~torch.isfinite(t)).sum().item()) if floating else 0, checksum(t))


def _report(t: torch.Tensor, problems: list[str], who: str, row: Optional[int], expected_checksum: Optional[int],
            nonfinite: int, got: int) -> IntegrityReport:
    """The rest of :func:`inspect`, given the non-finite count and the checksum of the received bytes."""
    if not (t.is_floating_point() or t.is_complex()) and not problems:
        problems.append(f"{who}: expected a floating dtype, got {t.dtype}")
    if nonfinite:
        problems.append(f"{who}: {nonfinite} non-finite value(s) (NaN or inf)")
    if expected_checksum is not None and int(expected_checksum) != got:
        problems.append(f"{who}: checksum mismatch (declared {int(expected_checksum)}, received {got}): "
                        "the bytes changed in transit")
    return IntegrityReport(row=row, shape=tuple(t.shape), dtype=str(t.dtype), numel=t.numel(), nonfinite=nonfinite,
                           checksum=got, expected_checksum=None if expected_checksum is None else int(expected_checksum),
                           problems=tuple(problems))


def inspect_rows(x: torch.Tensor, expected_checksums: Optional[Sequence[int]] = None, *,
                 expected_dtype: Optional[torch.dtype] = None,
                 received_checksums: Optional[Sequence[int]] = None) -> list[IntegrityReport]:
    """Run :func:`inspect` on every row of stacked submissions ``x`` (the non-finite counts in one pass).

    Args:
        x: ``(n, d)`` stacked submissions (row i from rank i); never modified.
        expected_checksums: the n declared checksums, or ``None``.
        expected_dtype: the agreed dtype, or ``None``.
        received_checksums: the n checksums of the rows' bytes when the caller knows them without
            hashing again: an in-process transport that handed over the very bytes the sender
            hashed (the simulated mode without a tamper hook); ``None`` (default) recomputes them.

    Returns:
        one :class:`IntegrityReport` per row, in row order.

    Raises:
        ShapeError: ``x`` is not 2-D, or ``expected_checksums`` or ``received_checksums`` does not
            have n entries.

    Example:
        >>> import torch
        >>> x = torch.tensor([[1.0, 2.0], [3.0, float("inf")]])
        >>> [r.ok for r in inspect_rows(x, [checksum(x[0]), checksum(x[1])])]
        [True, False]
    """
    if x.dim() != 2:
        raise ShapeError(f"x must be (n, d) stacked submissions; got shape {tuple(x.shape)}.")
    if expected_checksums is not None and len(expected_checksums) != x.shape[0]:
        raise ShapeError(f"expected_checksums must have one entry per row ({x.shape[0]}); "
                         f"got {len(expected_checksums)}.")
    if received_checksums is not None and len(received_checksums) != x.shape[0]:
        raise ShapeError(f"received_checksums must have one entry per row ({x.shape[0]}); "
                         f"got {len(received_checksums)}.")
    counts = [0] * x.shape[0]
    if x.is_floating_point() or x.is_complex():  # one row sum; only rows whose sum is not finite are counted
        for i in nonfinite_rows(x):
            counts[i] = int((~torch.isfinite(x[i])).sum())
    out = []
    for i in range(x.shape[0]):
        t, who = x[i], f"row {i}"
        problems = [] if expected_dtype is None or t.dtype == expected_dtype else [
            f"{who}: expected dtype {expected_dtype}, got {t.dtype}"]
        got = checksum(t) if received_checksums is None else int(received_checksums[i])
        out.append(_report(t, problems, who, i, None if expected_checksums is None else int(expected_checksums[i]),
                           int(counts[i]), got))
    return out
