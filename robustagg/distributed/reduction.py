"""The robust reduction contract and the registry of reduction modes (``gather``, later ``sharded``).

A *reduction* turns the submissions of the workers a process hosts into the aggregate every rank
applies: exchange (with a header and a checksum per submission), integrity checks, the robust rule,
and agreement on a digest of the aggregate. Modes differ in how the work is split (every rank
gathers everything, or each rank aggregates a coordinate slice); they are registered by name so a
new mode can live in its own module::

    from robustagg.distributed import Reduction, register_reduction

    @register_reduction("sharded")
    class ShardedReduction(Reduction):
        def reduce(self, rows, *, step, aux=None, want_weights=False, headers=None): ...

The base class provides what every mode shares: :meth:`Reduction.announce` (the header exchange
and its checks), :meth:`Reduction.share` (the honest rows shown to omniscient attackers) and
:meth:`Reduction.verify` (eager digest agreement).
"""

from __future__ import annotations

import abc
import enum
import time
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Mapping, Optional, Sequence, TypeVar

import torch

from .._tensor import nonfinite_rows
from ..aggregators.base import Aggregator
from ..errors import ConfigError, IntegrityError, NonFiniteInputError, ShapeError
from ..integrity import IntegrityReport, checksum, inspect_rows
from .comm import Communicator, LocalComm
from .header import (HEADER_LEN, Header, check_headers, decode_headers, dtype_code, dtype_of, encode_headers,
                     step_name)
from .sharded import AUTO_MIN_D, supports_sharding
from .vote import AggregatorCheck

__all__ = ["NonFinitePolicy", "Reduced", "Reduction", "register_reduction", "reduction_modes", "make_reduction",
           "frame", "unframe", "TAG_REDUCTION", "Transform"]

TAG_REDUCTION = 0
_CS_BYTES = 8


def frame(t: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A submission's wire form: its bytes then the 8 bytes of its checksum (``uint8``, on ``t``'s device).

    ``out``: an optional ``uint8`` buffer of exactly ``t.nbytes + 8`` bytes on ``t``'s device to
    write the frame into (returned), so that a caller can reuse one wire buffer across steps.

    Example:
        >>> import torch
        >>> x = torch.tensor([1.0, -2.0])
        >>> rows, sums = unframe(torch.stack([frame(x), frame(2 * x)]), torch.float32)
        >>> rows.tolist(), sums == [checksum(x), checksum(2 * x)]
        ([[1.0, -2.0], [2.0, -4.0]], True)
    """
    flat = t.detach().reshape(-1).contiguous()
    cs = torch.tensor([checksum(flat)], dtype=torch.int64).view(torch.uint8).to(flat.device)
    if out is None:
        return torch.cat([flat.view(torch.uint8), cs])
    body = flat.numel() * flat.element_size()
    out[:body].copy_(flat.view(torch.uint8))
    out[body:].copy_(cs)
    return out


def unframe(buffers: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, list[int]]:
    """Split gathered frames ``(n, bytes)`` into the rows ``(n, d)`` of ``dtype`` and the declared checksums.

    Raises:
        ShapeError: the frame length does not fit ``dtype``.
    """
    size = torch.empty((), dtype=dtype).element_size()
    body = buffers.shape[1] - _CS_BYTES
    if buffers.dim() != 2 or body < 0 or body % size:
        raise ShapeError(f"frames of {buffers.shape[1]} bytes do not hold {dtype} rows plus an 8-byte checksum.")
    rows = buffers[:, :body].contiguous().view(dtype)
    # a copy: the checksum bytes of a single frame start at offset body, which int64 views refuse
    sums = buffers[:, body:].reshape(-1).clone().cpu().view(torch.int64).tolist()
    return rows, [int(s) for s in sums]


#: ``transform(x (k, d), worker ranks, framed checksums) -> (rows for the rule (m, d), a label per row)``.
Transform = Callable[[torch.Tensor, list[int], list[int]], tuple[torch.Tensor, list[int]]]


class NonFinitePolicy(str, enum.Enum):
    """What the integrity layer does with a submission holding NaN or inf.

    ``ABORT`` (default): raise :class:`~robustagg.errors.NonFiniteInputError` on every rank (the
    group stops at the step where it happened). ``DROP``: leave the row out of the rule's input
    and count it as a detected fault; the rule then sees fewer rows and its requirement is checked
    on that number.
    """

    ABORT = "abort"
    DROP = "drop"


@dataclass
class Reduced:
    """The outcome of one reduction, identical on every rank (except ``weights``).

    Attributes:
        aggregate: ``(d,)`` the rule's output, the update every rank applies.
        step: the step id.
        seq: the collective sequence number of the submissions' exchange.
        headers: one :class:`Header` per rank (checksums, losses, compute times).
        matrix: ``(n, d)`` every submission as received, or ``None`` in modes where no rank holds
            all of them.
        kept: rows (ranks) that entered the rule, ascending.
        dropped: rows left out by the integrity layer (non-finite under ``DROP``).
        reports: the integrity report of every row (empty when the mode cannot inspect full rows).
        digest: :func:`~robustagg.integrity.checksum` of ``aggregate`` (agreed by every rank).
        weights: ``(len(inputs),)`` float64 share of each row the rule received (``rule.weights``),
            when requested.
        members: the worker rank of every row of ``matrix`` (and of ``headers``), ascending: every
            worker, or the round's participants under a protocol with partial participation.
        inputs: a label for every row the rule received: the kept worker ranks, or what the
            reduction's ``transform`` returned (e.g. replica-group ids).
        rule_input: ``(len(inputs), d)`` the rows the rule received when a ``transform`` changed
            them, else ``None`` (they are ``matrix``'s kept rows).

    ``kept`` and ``dropped`` are worker ranks; :meth:`rule_rows` gives the rows the rule received.
    """

    aggregate: torch.Tensor
    step: int
    seq: int
    headers: list[Header]
    matrix: Optional[torch.Tensor]
    kept: list[int]
    dropped: list[int] = field(default_factory=list)
    reports: list[IntegrityReport] = field(default_factory=list)
    digest: int = 0
    weights: Optional[torch.Tensor] = None
    members: list[int] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)
    rule_input: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if not self.members:
            self.members = [h.rank for h in self.headers] if self.headers else list(self.kept) + list(self.dropped)
        if not self.inputs and self.rule_input is None:
            self.inputs = list(self.kept)

    def row_of(self, rank: int) -> int:
        """The row of ``matrix`` that holds worker ``rank``'s submission.

        Raises:
            KeyError: ``rank`` did not take part in this reduction.
        """
        try:
            return self.members.index(int(rank))
        except ValueError:
            raise KeyError(f"worker {rank} is not a member of this reduction (members {self.members}).") from None

    def rule_rows(self) -> Optional[torch.Tensor]:
        """``(len(inputs), d)``: the rows the rule received (``None`` when no rank holds them)."""
        if self.rule_input is not None:
            return self.rule_input
        if self.matrix is None:
            return None
        if self.members == self.kept:
            return self.matrix
        return self.matrix[[self.row_of(r) for r in self.kept]]


class Reduction(abc.ABC):
    """Base class of the robust reduction modes.

    Args:
        rule: the robust rule (any :class:`~robustagg.Aggregator`, a Pipeline included); its
            requirement is checked on the number of rows it receives.
        comm: the :class:`~robustagg.distributed.comm.Communicator` of the run.
        on_nonfinite: a :class:`NonFinitePolicy` (or its value).
        check_digest: compare the aggregate's digest across ranks: in the next step's headers (no
            extra collective), and eagerly with :meth:`verify`.

    Raises:
        ConfigError: ``on_nonfinite`` is not a policy name.
    """

    mode: ClassVar[str] = ""

    def __init__(self, rule: Aggregator, comm: Communicator, *, on_nonfinite: NonFinitePolicy | str = "abort",
                 check_digest: bool = True) -> None:
        try:
            self.on_nonfinite = NonFinitePolicy(on_nonfinite)
        except ValueError:
            raise ConfigError(f"on_nonfinite must be one of {[p.value for p in NonFinitePolicy]}; "
                              f"got {on_nonfinite!r}.") from None
        self.rule = rule
        self.comm = comm
        self.check_digest = bool(check_digest)
        #: Rows dropped so far, as ``(step, rank)`` pairs (detected faults).
        self.faults: list[tuple[int, int]] = []
        #: Digest of the last aggregate (0 before the first); part of the trainer's replicated state.
        self.last_digest = 0
        #: Fault-injection hook: ``tamper(step, rank, frame) -> frame`` is applied to each hosted
        #: worker's wire frame *after* its checksum was taken (``None``: off). Modes that do not
        #: exchange frames through :meth:`_gather_rows` ignore it.
        self.tamper: Optional[Callable[[int, int, torch.Tensor], torch.Tensor]] = None
        #: :meth:`share`'s frames, reused by the same step's reduce for the very same unmodified rows
        #: (rank -> (step, tensor, its version counter, dtype, frame)); emptied by that reduce.
        self._frames: dict[int, tuple[int, torch.Tensor, int, torch.dtype, torch.Tensor]] = {}
        #: The same for the checksums of the in-process path (:meth:`_stack_rows`): rank -> (step,
        #: tensor, its version counter, dtype, checksum).
        self._sums: dict[int, tuple[int, torch.Tensor, int, torch.dtype, int]] = {}
        #: The headers of the last :meth:`announce` (who submits, length, dtype): the same step's
        #: :meth:`share` gathers those members' rows.
        self._announced: list[Header] = []
        #: The cross-check of the aggregate (no trusted aggregator: replicas, the vote, injected lies);
        #: off by default (``abort``: the next header's digest check, no extra collective).
        self.check = AggregatorCheck()

    def _placement(self, d: int) -> list[tuple[int, int, tuple[int, ...]]]:
        """``(start, end, holders)`` of every slice of a ``d``-long aggregate as the process-group run would
        compute it (gather: one slice, every rank a holder); the simulated cross-check replays it."""
        return [(0, d, tuple(range(self.comm.world_size)))]

    def _cross_check(self, aggregate: torch.Tensor, step: int) -> torch.Tensor:
        """The aggregate this rank applies after the cross-check of :attr:`check` (see
        :mod:`~robustagg.distributed.vote`); ``aggregate`` itself when nothing is checked."""
        chk = self.check
        if not chk.lies and chk.on_mismatch == "abort":
            chk.begin()
            return aggregate
        if self.comm.num_processes == 1:
            return chk.settle_local(aggregate, step, self._placement(aggregate.numel()))
        return chk.settle_gathered(aggregate, step, self.comm)

    def announce(self, rows: Mapping[int, torch.Tensor], *, step: int,
                 aux: Optional[Mapping[int, tuple[float, float]]] = None, stop: int = 0,
                 members: Optional[Sequence[int]] = None) -> list[Header]:
        """Exchange and check the headers of this step (call once per step, before any data).

        Every header also carries the sender's arrival time (``time.time()`` just before the
        exchange) and its stop request, which every rank reads from the result.

        Args:
            rows: ``{rank: (d,) tensor}`` of the hosted workers (only length and dtype are read).
            step: this rank's step id. aux: ``{rank: (loss, seconds)}`` to carry along.
            stop: the signal number that asked this process to stop (0: none), see
                :func:`robustagg.distributed.lifeline.stop_requested`.
            members: the worker ranks that submit at this step, ascending (default: every worker);
                ``rows`` holds the hosted ones. Every process takes part (one hosting no member
                passes ``rows={}``). The same step's :meth:`share` and :meth:`reduce` gather the
                members' rows only. A process hosting no member cannot announce a stop request
                (it is carried by the members' headers).

        Returns:
            every member's decoded :class:`Header`, in rank order.

        Raises:
            DesyncError: step, collective number, tag, length, dtype or previous digest differ.
            CollectiveError: the collective failed or timed out.
        """
        comm = self.comm
        seq = comm.seq + 1
        prev = self.last_digest if self.check_digest else 0
        now = time.time()
        mine = []
        for r, t in rows.items():
            loss, secs = (aux or {}).get(r, (float("nan"), float("nan")))
            mine.append(Header(step=step, seq=seq, rank=r, tag=TAG_REDUCTION, numel=t.numel(),
                               dtype=dtype_code(t.dtype), prev_digest=prev, loss=loss, seconds=secs, sent_at=now,
                               stop=int(stop)))
        block = encode_headers(mine).to(comm.device)  # one tensor for every hosted worker, one decode below
        enc = {h.rank: block[i] for i, h in enumerate(mine)}
        like = torch.zeros(HEADER_LEN, dtype=torch.int64, device=comm.device)
        headers = decode_headers(comm.all_gather(enc, members=members, like=like).cpu())
        check_headers(headers, step=step, seq=seq, tag=TAG_REDUCTION,
                      members=None if members is None else list(members))
        self._announced = headers
        return headers

    def _gather_rows(self, rows: Mapping[int, torch.Tensor], dtype: torch.dtype,
                     step: int = -1, keep: bool = False,
                     headers: Optional[Sequence[Header]] = None) -> tuple[torch.Tensor, list[int]]:
        """All-gather the hosted rows, framed with their checksums; ``(m, d)`` rows and declared checksums.

        ``step`` is handed to :attr:`tamper` (fault injection) when one is set. ``keep``: remember the
        frames for this step's reduce (:meth:`share`); without it the remembered ones are released.
        ``headers``: this step's (the members and the length; default: every worker).
        """
        if self._in_process():
            return self._stack_rows(rows, dtype, step, keep, headers)
        frames = {r: self._frame(r, t, dtype, step, keep) for r, t in rows.items()}
        if not keep:
            self._frames.clear()
        if self.tamper is not None:
            frames = {r: self.tamper(step, r, f) for r, f in frames.items()}
        members, like = None, None
        if headers is not None and len(headers) != self.comm.world_size:
            members = [h.rank for h in headers]
            size = torch.empty((), dtype=dtype).element_size()
            like = torch.zeros(headers[0].numel * size + _CS_BYTES, dtype=torch.uint8, device=self.comm.device)
        buffers = self.comm.all_gather(frames, members=members, like=like)
        return unframe(buffers, dtype)

    def _frame(self, r: int, t: torch.Tensor, dtype: torch.dtype, step: int, keep: bool) -> torch.Tensor:
        """``frame(t.to(dtype))``; the frame :meth:`share` made of this very tensor at this step when it is
        unchanged since (same object, same in-place version counter) and no tamper hook could have touched it."""
        hit = self._frames.get(r)
        if hit is not None and hit[0] == step and hit[1] is t and hit[2] == t._version and hit[3] == dtype:
            return hit[4]
        out = frame(t.to(dtype))
        if keep and self.tamper is None:
            self._frames[r] = (step, t, t._version, dtype, out)
        return out

    def _stack_rows(self, rows: Mapping[int, torch.Tensor], dtype: torch.dtype, step: int, keep: bool,
                    headers: Optional[Sequence[Header]]) -> tuple[torch.Tensor, list[int]]:
        """:meth:`_gather_rows` where every worker lives in this process and nothing can touch a frame
        (:meth:`_in_process`): the rows are stacked as they are and each checksum is taken on the row
        itself, so no frame is built (a copy of each row) and none is split again (a copy of the matrix).
        The same rows, the same checksums (of the same bytes) and the same collective count as the
        framed exchange; a checksum :meth:`share` took of the very same unchanged tensor at this step
        is reused (as :meth:`_frame` reuses frames)."""
        local: dict[int, torch.Tensor] = {}
        sums: dict[int, int] = {}
        for r, t in rows.items():
            hit = self._sums.get(r)
            flat = t.detach().reshape(-1).to(dtype)
            local[r] = flat
            if hit is not None and hit[0] == step and hit[1] is t and hit[2] == t._version and hit[3] == dtype:
                sums[r] = hit[4]
                continue
            sums[r] = checksum(flat)
            if keep:
                self._sums[r] = (step, t, t._version, dtype, sums[r])
        if not keep:
            self._sums.clear()
        members, like = None, None
        if headers is not None and len(headers) != self.comm.world_size:
            members = [h.rank for h in headers]
            like = torch.zeros(headers[0].numel, dtype=dtype, device=self.comm.device)
        order = members if members is not None else range(self.comm.world_size)
        return self.comm.all_gather(local, members=members, like=like), [sums[r] for r in order]

    def _in_process(self) -> bool:
        """True when the gathered frames are the very bytes their senders hashed: every worker in this
        process (exactly :class:`~robustagg.distributed.LocalComm`, which stacks the frames; a subclass
        may change them) and no :attr:`tamper` hook, so hashing them again on receipt cannot find a
        difference (and is skipped)."""
        return type(self.comm) is LocalComm and self.tamper is None

    def share(self, rows: Mapping[int, torch.Tensor], *, step: int) -> torch.Tensor:
        """All-gather the hosted workers' honest submissions (what omniscient attackers see).

        Call-order contract: after :meth:`announce` and before :meth:`reduce` of the same step,
        on every rank or on none.

        Returns:
            ``(m, d)`` every member's honestly computed submission (the members of this step's
            :meth:`announce`, in rank order).

        Raises:
            IntegrityError: a row does not match its framed checksum. CollectiveError: as above.
        """
        headers = self._announced
        dtype = dtype_of(headers[0].dtype) if headers else next(iter(rows.values())).dtype
        x, sums = self._gather_rows(rows, dtype, step, keep=True, headers=headers or None)
        bad = [] if self._in_process() else [i for i, r in enumerate(inspect_rows(x, sums)) if r.corrupted]
        if bad:
            raise IntegrityError(f"{step_name(step)}: shared rows of rank(s) {bad} do not match their checksums.")
        return x

    def finite_rows(self, x: torch.Tensor, rows: list[int], *, step: int) -> list[int]:
        """Apply :attr:`on_nonfinite` to ``rows`` of ``x`` *before* anyone reads their values.

        The trainer calls it on the rows :meth:`share` returned, so an omniscient attack sees
        exactly the honest rows the rule will see: ``x`` is identical on every rank (an
        all-gather), so every rank keeps the same rows. The dropped rows are not counted in
        :attr:`faults` here: :meth:`reduce` counts them when they arrive again.

        Args:
            x: ``(n, d)`` the shared submissions (any floating dtype); not modified.
            rows: the row indices to check (e.g. the honest ranks), ascending.
            step: the 0-based step id (messages name step ``step + 1``).

        Returns:
            the finite ones of ``rows``, in the given order (every one under ``DROP`` when all are
            finite; ``rows`` itself under ``ABORT``, which raises otherwise).

        Raises:
            NonFiniteInputError: a listed row holds NaN or inf under ``ABORT`` (the same error
                :meth:`reduce` would raise at this step).
            IntegrityError: under ``DROP``, every listed row is non-finite.
        """
        suspects = set(nonfinite_rows(x)) if rows else set()  # one row sum over the matrix, confirmed exactly
        bad = [i for i in rows if i in suspects]
        if not bad:
            return list(rows)
        if self.on_nonfinite is NonFinitePolicy.ABORT:
            raise NonFiniteInputError(f"{step_name(step)}: submissions of rank(s) {bad} hold NaN or inf. Set "
                                      "on_nonfinite='drop' to leave such rows out and count them as faults.")
        kept = [i for i in rows if i not in bad]
        if not kept:
            raise IntegrityError(f"{step_name(step)}: every checked submission (rank(s) {bad}) is non-finite.")
        return kept

    @abc.abstractmethod
    def reduce(self, rows: Mapping[int, torch.Tensor], *, step: int,
               aux: Optional[Mapping[int, tuple[float, float]]] = None, want_weights: bool = False,
               headers: Optional[list[Header]] = None, members: Optional[Sequence[int]] = None,
               transform: Optional[Transform] = None) -> Reduced:
        """Aggregate one submission per worker; every rank returns the same aggregate.

        Call-order contract: every rank calls, once per step and with the same ``step``,
        :meth:`announce` (or passes ``headers=None`` here, which announces), optionally
        :meth:`share`, then ``reduce``.

        Args:
            rows: ``{rank: (d,) tensor}`` for the workers this process hosts.
            step: the 0-based step id (checked against every other rank's); messages name the step by its
                1-based number (:func:`~robustagg.distributed.header.step_name`).
            aux: ``{rank: (loss, seconds)}`` carried in the headers (informational).
            want_weights: also compute ``rule.weights`` of the kept rows (for metrics).
            headers: this step's headers from :meth:`announce` (they name the members).
            members: the submitting worker ranks when ``headers`` is ``None`` (see :meth:`announce`).
            transform: ``transform(x, ranks, checksums) -> (x', labels)``, applied to the kept rows
                ``x`` (``(k, d)``, worker ``ranks``, their framed checksums) before the rule: a
                protocol's server-side step (a replica vote, staleness weights). Modes that hold
                no full rows refuse it.

        Raises:
            DesyncError: step, collective number, shape or dtype differ across ranks, or the
                previous step's aggregate digests differ.
            IntegrityError: a checksum does not match the bytes received.
            NonFiniteInputError: a row is non-finite under ``ABORT``.
            AssumptionError: the rule's requirement fails for the rows it receives.
            CollectiveError: a collective failed or timed out.
        """

    def verify(self, step: int) -> None:
        """Check now that every rank holds the same digest of the last aggregate (one collective).

        Raises:
            DesyncError: the digests differ. CollectiveError: the collective failed.
        """
        self.comm.agree(self.last_digest, what="aggregate digest", step=step)


_MODES: dict[str, type[Reduction]] = {}
R = TypeVar("R", bound=type[Reduction])


def register_reduction(name: str) -> Callable[[R], R]:
    """Class decorator registering a :class:`Reduction` subclass as mode ``name``.

    Raises:
        ConfigError: ``name`` is already registered.
    """

    def deco(cls: R) -> R:
        if name in _MODES:
            raise ConfigError(f"reduction mode {name!r} is already registered ({_MODES[name].__qualname__}).")
        _MODES[name] = cls
        cls.mode = name
        return cls

    return deco


def reduction_modes() -> list[str]:
    """Names of the registered reduction modes, plus ``"auto"`` (sharded where the rule supports it)."""
    return sorted([*_MODES, "auto"])


def make_reduction(mode: str, rule: Aggregator, comm: Communicator, **kwargs: object) -> Reduction:
    """Build the reduction registered as ``mode``.

    ``mode="auto"`` picks ``"sharded"`` when the rule has a sharded implementation
    (:func:`~robustagg.distributed.sharded.supports_sharding`), else ``"gather"``; sharded then
    gathers submissions shorter than :data:`~robustagg.distributed.sharded.AUTO_MIN_D` coordinates.

    Raises:
        ConfigError: unknown mode (the message lists the registered ones).
    """
    if mode == "auto":
        if not supports_sharding(rule):
            mode = "gather"
        else:
            mode = "sharded"
            kwargs.setdefault("min_d", AUTO_MIN_D)
    try:
        cls = _MODES[mode]
    except KeyError:
        raise ConfigError(f"unknown reduction mode {mode!r}; available: {', '.join(reduction_modes())}.") from None
    return cls(rule, comm, **kwargs)  # type: ignore[arg-type]
