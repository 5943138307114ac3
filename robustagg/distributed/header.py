"""The cheap header every rank sends before its submission: who, which step, which collective, what.

Before the (large) exchange of submissions, ranks all-gather a fixed-size ``int64`` header. If two
ranks disagree on the step id, the collective sequence number, the length or the dtype of what
they are about to exchange, the run is desynchronised: it is detected here, before any data is
mixed, and raised as :class:`~robustagg.errors.DesyncError`. (A data all-gather with mismatched
sizes is not an error gloo reports: it aborts the process. Hence a fixed-size header first.)

The header also carries the digest of the aggregate the sender applied at the previous step
(agreement is checked here, one step later, at no extra collective; :meth:`Reduction.verify`
checks the pending one eagerly), two floating-point side values, the worker's training loss
and compute time, so the main rank learns them without another collective, and two control
fields every rank reads after the exchange: the sender's wall-clock arrival time at the exchange
(so every rank knows who arrived last and how long the others waited for it, see
:class:`~robustagg.training.evidence.StragglerLog`) and a stop request (the number of the signal
that asked the sender to stop, 0 for none): since every rank sees every header, all ranks stop
after the same step without an extra collective. Each submission's
checksum travels with the submission itself (a trailer of its frame, see
:mod:`robustagg.distributed.gather`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..errors import DesyncError, ShapeError

__all__ = ["Header", "HEADER_LEN", "MAGIC", "DTYPE_CODES", "dtype_code", "check_headers", "encode_headers",
           "decode_headers", "step_name"]


def step_name(step_id: int) -> str:
    """How a message names the step with 0-based id ``step_id``: ``"step <step_id + 1>"``.

    The collectives take step *ids* (completed steps before this one: 0 for the first step); people,
    fault specs, metrics and detection records count steps from 1. Every message of the exchange
    (header checks, integrity, non-finite rows) names the step through this function, so a fault
    injected at step 13 is reported at step 13.

    Example:
        >>> step_name(12)
        'step 13'
    """
    return f"step {int(step_id) + 1}"

#: Format marker and version of the header layout (bumped when fields change).
MAGIC = 0x52_41_47_02
#: Number of int64 entries in an encoded header.
HEADER_LEN = 12

#: Stable integer codes of the floating dtypes a submission may have.
DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 1, torch.float64: 2, torch.float16: 3, torch.bfloat16: 4}
_CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


def dtype_code(dtype: torch.dtype) -> int:
    """The header code of ``dtype``.

    Raises:
        ShapeError: ``dtype`` is not a supported floating dtype.
    """
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise ShapeError(f"submissions must be float32, float64, float16 or bfloat16; got {dtype}.") from None


def _f2i(x: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", float(x)))[0])


def _i2f(x: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", int(x)))[0])


@dataclass(frozen=True)
class Header:
    """Metadata of one submission in one collective.

    Attributes:
        step: the sender's optimizer step id (0-based).
        seq: the sequence number of the data collective this header announces (every rank counts
            its collectives; equal counts mean the ranks are at the same point of the program).
        rank: the sender's rank (must equal its row index in the gathered matrix).
        tag: what the step's exchanges are for (0 = a robust reduction); ranks must agree.
        numel: length ``d`` of the submission.
        dtype: :data:`DTYPE_CODES` code of the submission's dtype.
        prev_digest: :func:`~robustagg.integrity.checksum` of the aggregate the sender applied at
            the previous step (0 before the first); ranks must agree.
        loss: the sender's training loss on its batch (float, informational).
        seconds: the sender's compute time for the step so far (float seconds, informational).
        sent_at: the sender's ``time.time()`` (float seconds since the epoch) when it arrived at
            this exchange; comparable across ranks up to the hosts' clock skew (zero on one host).
        stop: the number of the signal that asked the sender to stop (SIGTERM = 15, SIGINT = 2),
            0 when none did; any non-zero value makes every rank stop after this step.
    """

    step: int
    seq: int
    rank: int
    tag: int
    numel: int
    dtype: int
    prev_digest: int
    loss: float = float("nan")
    seconds: float = float("nan")
    sent_at: float = float("nan")
    stop: int = 0

    def encode(self) -> torch.Tensor:
        """The header as an ``int64`` tensor of length :data:`HEADER_LEN` (floats bit-cast)."""
        return torch.tensor(self._values(), dtype=torch.int64)

    def _values(self) -> list[int]:
        return [MAGIC, self.step, self.seq, self.rank, self.tag, self.numel, self.dtype, self.prev_digest,
                _f2i(self.loss), _f2i(self.seconds), _f2i(self.sent_at), self.stop]

    @classmethod
    def decode(cls, t: torch.Tensor) -> "Header":
        """Inverse of :meth:`encode`.

        Raises:
            DesyncError: wrong length or format marker (the peer runs another layout or garbage).
        """
        return cls._from_values([int(a) for a in t.reshape(-1).tolist()])

    @classmethod
    def _from_values(cls, v: list[int]) -> "Header":
        if len(v) != HEADER_LEN or v[0] != MAGIC:
            raise DesyncError(f"received a malformed header {v[:3]}...; every rank must run the same robustagg "
                              "version and call the same collectives in the same order.")
        return cls(step=v[1], seq=v[2], rank=v[3], tag=v[4], numel=v[5], dtype=v[6], prev_digest=v[7],
                   loss=_i2f(v[8]), seconds=_i2f(v[9]), sent_at=_i2f(v[10]), stop=v[11])


def encode_headers(headers: Sequence[Header]) -> torch.Tensor:
    """``(k, HEADER_LEN)`` int64: row i is ``headers[i].encode()``, built in one call (one tensor for a
    process's hosted workers instead of one per worker).

    Example:
        >>> h = [Header(step=1, seq=2, rank=r, tag=0, numel=3, dtype=1, prev_digest=0, loss=0.5, seconds=0.1,
        ...             sent_at=1.0) for r in range(2)]
        >>> torch.equal(encode_headers(h)[1], h[1].encode()), decode_headers(encode_headers(h)) == h
        (True, True)
    """
    return torch.tensor([h._values() for h in headers], dtype=torch.int64).reshape(len(headers), HEADER_LEN)


def decode_headers(t: torch.Tensor) -> list[Header]:
    """Inverse of :func:`encode_headers` on gathered headers ``(m, HEADER_LEN)`` (one ``tolist``).

    Raises:
        DesyncError: as :meth:`Header.decode`, for a row of the wrong layout or marker.
    """
    if t.dim() != 2:
        return [Header.decode(row) for row in t.reshape(1, -1)]
    return [Header._from_values(row) for row in t.tolist()]


def check_headers(headers: Sequence[Header], *, step: int, seq: int, tag: int,
                  members: Optional[Sequence[int]] = None) -> None:
    """Raise :class:`DesyncError` unless every rank announces the same step, collective, tag, d, dtype
    and previous aggregate digest.

    Args:
        headers: one decoded header per rank, in rank order.
        members: the worker rank each header must carry (default ``0..len(headers)-1``).
        step: the id (0-based) of the step this rank itself is about to take; messages name the step
            by its number (:func:`step_name`).
        seq: the collective number this rank itself is about to run.
        tag: the tag of the collective this rank itself is about to run.

    Raises:
        DesyncError: the message lists every disagreeing field with the ranks and values.

    Example:
        >>> h = [Header(step=3, seq=7, rank=r, tag=0, numel=5, dtype=1, prev_digest=0) for r in range(2)]
        >>> check_headers(h, step=3, seq=7, tag=0)
        >>> check_headers([h[0], Header(step=4, seq=7, rank=1, tag=0, numel=5, dtype=1, prev_digest=0)],
        ...               step=3, seq=7, tag=0)
        Traceback (most recent call last):
        ...
        robustagg.errors.DesyncError: ranks disagree before the exchange at step 4, collective 7: step: rank 1 announces step 5 (expected step 4)
    """
    problems: list[str] = []
    ref = headers[0]
    want_ranks = list(range(len(headers))) if members is None else list(members)
    for i, h in enumerate(headers):
        if h.rank != want_ranks[i]:
            problems.append(f"row {i} carries rank {h.rank} (expected {want_ranks[i]})")
        if h.step != step:  # step ids travel; the message names step numbers (step_name)
            problems.append(f"step: rank {i} announces {step_name(h.step)} (expected {step_name(step)})")
        for name, want in (("seq", seq), ("tag", tag), ("numel", ref.numel), ("dtype", ref.dtype)):
            got = getattr(h, name)
            if got != want:
                problems.append(f"{name}: rank {i} has {got} (expected {want})")
    digests = {h.prev_digest for h in headers}
    if len(digests) > 1:
        problems.append(f"the aggregates applied at {step_name(step - 1)} differ: "
                        + ", ".join(f"rank {i} digest {h.prev_digest}" for i, h in enumerate(headers))
                        + "; the ranks' parameters diverged")
    if problems:
        raise DesyncError(f"ranks disagree before the exchange at {step_name(step)}, collective {seq}: "
                          + "; ".join(problems))


def dtype_of(code: int) -> torch.dtype:
    """The dtype of a header code (inverse of :func:`dtype_code`)."""
    return _CODE_DTYPES[code]
