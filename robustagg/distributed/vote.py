"""No trusted aggregator: replicated aggregation, cross-checked by a bit-exact majority vote.

In ``mode="gather"`` every rank computes the whole aggregate; in ``mode="sharded"`` each
coordinate slice is computed by one rank, or, with ``replicas = r_a > 1``, by ``r_a`` distinct
ranks. A rank that *lies about its slice* (a wrong aggregate, however it came about: a bug, a
bit flip, malice) is a Byzantine aggregator. This module holds what both modes share:

- :func:`slice_holders` / :func:`held_slices`: the placement. Slice ``s`` is computed by ranks
  ``s, s + 1, ..., s + r_a - 1`` (mod ``world``): no two replicas of a slice share a rank and every
  rank computes exactly ``r_a`` slices (the load stays balanced).
- :func:`majority_copy`: the bit-exact vote among the copies of one slice (or of the whole
  aggregate in gather mode).
- :func:`aggregator_requirement`: the honest-replica requirement, printable like a rule's.
- :class:`Lockstep`: a distance-based rule run on each of a rank's ``r_a`` held slices at once, so
  that every partial statistic (a slice's partial Gram matrix, its row norms) can be voted on
  among its ``r_a`` holders before any rank uses the sum.

Requirement (replicated servers as in El-Mhamdi, Guerraoui, Guirguis, Hoang, Rouault, "Genuinely
distributed Byzantine machine learning", PODC 2020, whose servers run asynchronously and compare
approximately; here every replica computes the same bytes in lock-step, so a bit-exact strict
majority suffices): with ``f_a`` lying aggregator ranks placed adversarially, every slice has a
strict majority of honest replicas iff ``r_a >= 2 f_a + 1``; a disagreement is *detected*
(``on_aggregate_mismatch=abort``) iff ``r_a >= f_a + 1``. In gather mode ``r_a`` is the number of
processes (every rank is a replica of the whole aggregate).

What the vote cannot catch: replicas that share a common-mode fault (the same wrong code, the
same wrong input) agree on the same wrong value, and a coalition of more than ``f_a`` liars that
holds the majority of a slice wins its vote (the honest replicas are then the ones named).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, TypeVar

import torch

from ..errors import ConfigError, DesyncError, LyingAggregatorError
from ..integrity import checksum, digest

__all__ = ["MISMATCH_POLICIES", "LIAR_POLICIES", "slice_holders", "held_slices", "Copy", "majority_copy",
           "aggregator_requirement", "LyingAggregatorError", "AggregatorCheck", "sent_bytes", "Lockstep",
           "majority_digest"]

T = TypeVar("T")

#: ``on_aggregate_mismatch``: ``abort`` (a disagreement stops every rank: today's digest check) or
#: ``vote`` (the bit-exact majority is used and the minority is named).
MISMATCH_POLICIES = ("abort", "vote")
#: ``on_lying_aggregator``: ``continue`` (keep the named rank, keep voting) or ``exclude`` (every
#: rank stops the attempt; the launcher's shrink path removes the named rank).
LIAR_POLICIES = ("continue", "exclude")


def slice_holders(world: int, replicas: int) -> list[tuple[int, ...]]:
    """The ranks that compute each of the ``world`` coordinate slices: slice ``s`` -> ``(s, s+1, ..., s+r-1) mod world``.

    Args:
        world: ranks (= slices), >= 1. replicas: ``r_a``, copies of each slice, in ``[1, world]``.

    Returns:
        ``world`` tuples of ``replicas`` distinct ranks; every rank appears in exactly ``replicas``.

    Raises:
        ConfigError: ``replicas`` outside ``[1, world]``.

    Example:
        >>> slice_holders(4, 3)
        [(0, 1, 2), (1, 2, 3), (2, 3, 0), (3, 0, 1)]
    """
    _check_replicas(world, replicas)
    return [tuple((s + j) % world for j in range(replicas)) for s in range(world)]


def held_slices(rank: int, world: int, replicas: int) -> list[int]:
    """The slices ``rank`` computes (its own first): ``(rank - j) mod world`` for ``j = 0 .. r - 1``.

    Example:
        >>> held_slices(0, 4, 3)
        [0, 3, 2]
    """
    _check_replicas(world, replicas)
    return [(rank - j) % world for j in range(replicas)]


def _check_replicas(world: int, replicas: int) -> None:
    if not 1 <= int(replicas) <= int(world):
        raise ConfigError(f"aggregator_replicas must be in [1, world={world}] (no two replicas of a slice on one "
                          f"rank); got {replicas}.")


@dataclass(frozen=True)
class Copy:
    """One replica's copy of a slice: the rank that computed it and its values (``(d_s,)``, any dtype)."""

    rank: int
    values: torch.Tensor


def majority_copy(copies: Sequence[Copy], *, step: int, what: str) -> tuple[torch.Tensor, list[int], dict[int, int]]:
    """The bit-exact strict-majority value among ``copies``, and the ranks outside it.

    Copies are grouped by their bytes (:func:`~robustagg.integrity.digest`, the same BLAKE2b-64
    digest the replicated return's claims carry, confirmed with :func:`torch.equal`, so a digest
    collision cannot merge two different copies); the largest group wins if it holds more than half
    of the copies.

    Args:
        copies: one :class:`Copy` per replica (>= 1), the same shape and dtype.
        step: the 0-based step id (messages name step ``step + 1``). what: the slice, for messages.

    Returns:
        ``(value, liars, digests)``: the majority's tensor (one of the copies, not a new one), the
        ranks whose copy differs from it (ascending), and every rank's digest (``{}`` when every
        copy agrees: nothing is hashed then).

    Raises:
        DesyncError: no strict majority (the message lists every group).

    Example:
        >>> import torch
        >>> good, bad = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5])
        >>> value, liars, _ = majority_copy([Copy(0, good), Copy(1, bad), Copy(2, good.clone())], step=0, what="slice 0")
        >>> value.tolist(), liars
        ([1.0, 2.0], [1])
    """
    if all(c is copies[0] or torch.equal(c.values, copies[0].values) for c in copies):
        return copies[0].values, [], {}  # the common case: no digest needed
    groups: list[tuple[int, list[Copy]]] = []
    digests: dict[int, int] = {}
    for c in copies:
        h = digest(c.values)
        digests[int(c.rank)] = h
        for dh, members in groups:
            if dh == h and torch.equal(members[0].values, c.values):
                members.append(c)
                break
        else:
            groups.append((h, [c]))
    winner = max(groups, key=lambda g: len(g[1]))
    if 2 * len(winner[1]) <= len(copies):
        listing = "; ".join(f"ranks {[c.rank for c in m]} digest {dh}" for dh, m in groups)
        raise DesyncError(f"step {step + 1}: the {len(copies)} replicas of {what} have no strict majority ({listing}). "
                          "More aggregator ranks lie than the replicas tolerate (r_a >= 2 f_a + 1 is needed).")
    liars = sorted(c.rank for dh, m in groups if m is not winner[1] for c in m)
    return winner[1][0].values, liars, digests


def sent_bytes(d: int, world: int, replicas: int, element_size: int = 4) -> int:
    """Bytes rank 0 sends per step in the sharded exchange with every slice on ``replicas`` ranks.

    Its ``replicas`` framed slices (data plus an 8-byte checksum each) to every rank on the way in;
    with ``replicas > 1`` its ``replicas`` slice digests (8 bytes each) to every rank; and on the way
    back its own aggregated slice to every rank, which is all it sends when nobody lies (a slice goes
    out once, from its first holder whose digest is the majority's; the small all-reduces and the
    fallback after a lie are left out). ``replicas = 1`` is the unreplicated sharded step.

    Example:
        >>> sent_bytes(8, 4, 1), sent_bytes(8, 4, 3)  # d = 8 float32 over 4 ranks: 2 coordinates each
        (96, 320)
    """
    from .sharded import shard_bounds

    r, w = int(replicas), int(world)
    sizes = [b - a for a, b in shard_bounds(int(d), w)]
    digests = w * r * 8 if r > 1 else 0
    return r * (int(d) * element_size + 8 * w) + digests + w * sizes[0] * element_size


def majority_digest(claims: dict[int, int], *, step: int, what: str) -> tuple[int, list[int]]:
    """The strict-majority digest among ``claims`` (``{rank: digest}``) and the ranks that claimed another.

    The replicated sharded return compares the holders' digests of a slice before any copy moves;
    a copy is then accepted only if its bytes hash to this digest (so a holder that claims the
    majority's digest and sends other bytes is caught where they arrive). Equal digests stand for
    equal bytes here: a wrong copy with the majority's 64-bit BLAKE2b digest would need a second
    preimage.

    Raises:
        DesyncError: no digest is claimed by a strict majority of the holders.

    Example:
        >>> majority_digest({0: 5, 1: 7, 2: 5}, step=0, what="slice 0")
        (5, [1])
    """
    votes: dict[int, list[int]] = {}
    for r, dg in claims.items():
        votes.setdefault(int(dg), []).append(int(r))
    best = max(votes.items(), key=lambda kv: len(kv[1]))
    if 2 * len(best[1]) <= len(claims):
        listing = "; ".join(f"ranks {sorted(rs)} digest {dg}" for dg, rs in votes.items())
        raise DesyncError(f"step {step + 1}: the {len(claims)} replicas of {what} have no strict majority ({listing}). "
                          "More aggregator ranks lie than the replicas tolerate (r_a >= 2 f_a + 1 is needed).")
    return best[0], sorted(r for dg, rs in votes.items() if dg != best[0] for r in rs)


def aggregator_requirement(replicas: int, lying: int, policy: str) -> tuple[str, bool]:
    """The requirement on the replicas of every slice for ``f_a = lying`` lying aggregator ranks.

    Args:
        replicas: ``r_a``, copies of every slice (gather mode: the number of processes).
        lying: ``f_a`` >= 0, the declared number of lying aggregator ranks.
        policy: ``vote`` (every slice correct needs ``r_a >= 2 f_a + 1``) or ``abort`` (every
            disagreement detected needs ``r_a >= f_a + 1``).

    Returns:
        ``(printable requirement with the values, holds)``.

    Raises:
        ConfigError: an unknown policy or a negative ``lying``.

    Example:
        >>> aggregator_requirement(3, 1, "vote")
        ('r_a >= 2 f_a + 1 (every slice correct): r_a=3, f_a=1', True)
        >>> aggregator_requirement(1, 1, "abort")[1]
        False
    """
    if policy not in MISMATCH_POLICIES:
        raise ConfigError(f"on_aggregate_mismatch must be one of {', '.join(MISMATCH_POLICIES)}; got {policy!r}.")
    if int(lying) < 0:
        raise ConfigError(f"lying_aggregators must be >= 0; got {lying}.")
    if policy == "vote":
        return (f"r_a >= 2 f_a + 1 (every slice correct): r_a={replicas}, f_a={lying}",
                int(replicas) >= 2 * int(lying) + 1)
    return f"r_a >= f_a + 1 (every lie detected): r_a={replicas}, f_a={lying}", int(replicas) >= int(lying) + 1


class Lockstep:
    """Run one function per held slice, in threads that meet at every global-statistic request.

    A distance-based rule on coordinate slices asks for global statistics (a partial Gram matrix
    summed over slices, row norms) between its own computations, and what it asks next depends
    on the answer. With ``r_a`` held slices per rank, the rule runs once per held slice, each in
    its own thread on its own block exactly as a rank holding that block alone would (so honest
    replicas of a slice compute the same bytes); at every request all ``k`` threads hand in their
    partial (the :class:`~robustagg.distributed.sharded.SliceStatistics` reducer of thread ``j``
    is :meth:`reducer` ``(j)``), ``combine`` turns the ``k`` partials into the global value once
    (the vote of :meth:`~robustagg.distributed.sharded_reduction.ShardedReduction._voted_sum`:
    one collective per request, the same on every rank) and every thread goes on with its copy.

    Honest threads ask the same sequence of requests (every decision is taken on the global
    value, which is the same for all), so they meet at each. A thread that raises breaks the
    meeting point: the others stop, and :meth:`run` raises the first real error.

    Args:
        k: the number of held slices (threads), >= 1.
        combine: ``(list of k partials, each float64 of one shape) -> global value``.
        timeout_s: how long a thread waits for the others at a request (a desync guard:
            :class:`~robustagg.errors.DesyncError` after it).

    Example:
        >>> import torch
        >>> ls = Lockstep(2, lambda parts: parts[0] + parts[1])
        >>> [t.tolist() for t in ls.run([lambda red: red(torch.tensor([1.0])), lambda red: red(torch.tensor([2.0]))])]
        [[3.0], [3.0]]
    """

    def __init__(self, k: int, combine: Callable[[list[torch.Tensor]], torch.Tensor], *, timeout_s: float = 300.0) -> None:
        if int(k) < 1:
            raise ConfigError(f"Lockstep: k={k} threads; need at least one held slice.")
        self.k, self.combine, self.timeout_s = int(k), combine, float(timeout_s)
        self._parts: list[Optional[torch.Tensor]] = [None] * self.k
        self._result: Optional[torch.Tensor] = None
        self._barrier = threading.Barrier(self.k, action=self._meet, timeout=self.timeout_s)
        self._lock = threading.Lock()
        self._done: set[int] = set()

    def _meet(self) -> None:
        parts = list(self._parts)
        if any(p is None or p.shape != parts[0].shape for p in parts):  # type: ignore[union-attr]
            raise DesyncError("the held slices' rules asked for different statistics at the same point "
                              f"(shapes {[None if p is None else tuple(p.shape) for p in parts]}).")
        self._result = self.combine([p for p in parts if p is not None])
        self._parts = [None] * self.k

    def reducer(self, j: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """Thread ``j``'s reducer: hands in its partial, waits for the others, returns the global value (a copy)."""
        def reduce(t: torch.Tensor) -> torch.Tensor:
            with self._lock:
                if self._done:  # another thread returned: nobody will meet this request
                    raise _Broken()
                self._parts[j] = t.to(torch.float64)
            try:
                self._barrier.wait()
            except threading.BrokenBarrierError:
                raise _Broken() from None
            assert self._result is not None
            return self._result.clone()
        return reduce

    def run(self, fns: Sequence[Callable[[Callable[[torch.Tensor], torch.Tensor]], T]]) -> list[T]:
        """Call ``fns[j](self.reducer(j))`` for every ``j`` (thread 0 is the caller's); their results in order.

        Raises:
            DesyncError: the threads did not meet within ``timeout_s``, or one returned while
                another still asked. Any other error: the first that a function (or ``combine``) raised.
        """
        if len(fns) != self.k:
            raise ConfigError(f"Lockstep.run: {len(fns)} functions for k={self.k} held slices.")
        results: list[Any] = [None] * self.k
        errors: list[Optional[BaseException]] = [None] * self.k
        grad = torch.is_grad_enabled()

        def work(j: int) -> None:
            try:
                with torch.set_grad_enabled(grad):
                    results[j] = fns[j](self.reducer(j))
            except BaseException as exc:  # handed to the caller's thread below
                errors[j] = exc
                self._barrier.abort()  # the others stop at their next (or current) request
            with self._lock:
                self._done.add(j)
                if self._barrier.n_waiting:  # someone waits for a request this thread will never make
                    self._barrier.abort()

        threads = [threading.Thread(target=work, args=(j,), name=f"robustagg-slice-{j}", daemon=True)
                   for j in range(1, self.k)]
        for t in threads:
            t.start()
        work(0)
        for t in threads:
            t.join()
        real = [e for e in errors if e is not None and not isinstance(e, _Broken)]
        if real:
            raise real[0]
        if any(e is not None for e in errors):
            raise DesyncError(f"the {self.k} held slices' rules did not meet at every statistic request "
                              f"within {self.timeout_s:g} s (one finished while another still asked).")
        return results


class _Broken(Exception):
    """A thread's meeting point was broken by another thread (its error, or its end)."""


def _of(outcome: Sequence[Any]) -> str:
    return str(outcome[6]) if len(outcome) > 6 else "aggregate"


def _record(step: int, rank: int, action: str, slices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"kind": "lying_aggregator", "step": int(step) + 1, "ranks": [int(rank)], "slices": slices,
            "action": action}


@dataclass
class AggregatorCheck:
    """The cross-check of the aggregate a :class:`~robustagg.distributed.Reduction` applies (one per reduction).

    Args:
        replicas: ``r_a``, ranks that compute each coordinate slice in ``mode="sharded"`` (1: each
            slice once, no cross-check; gather mode ignores it: every rank is a replica).
        on_mismatch: ``abort`` (a disagreement stops every rank: the next header's digest check, or
            at once where the copies are compared) or ``vote`` (the bit-exact strict majority is used,
            the minority named in :attr:`detections`).
        on_liar: ``continue`` (keep voting with the named rank) or ``exclude`` (its ranks are listed in
            :attr:`exclude`; the trainer stops the attempt so that the launcher's shrink path removes them).
        injector: a fault injector with ``lie(step, rank)`` and ``lied(fault, values, previous)``
            (``aggregator_lie`` faults; ``None``: none).

    Attributes:
        detections: this step's ``lying_aggregator`` records (1-based ``step``, ``ranks``, ``slices``:
            ``[{"slice", "start", "end", "of", "digest", "majority_digest"}]``, ``of``: ``aggregate``
            or ``statistic``, ``action``).
        exclude: this step's ranks to exclude (``on_liar="exclude"``), ascending.
        previous: the previous step's aggregate, kept only while a lie is configured (``stale``).

    Raises:
        ConfigError: an unknown policy, or ``replicas < 1``.
    """

    replicas: int = 1
    on_mismatch: str = "abort"
    on_liar: str = "continue"
    injector: Any = None
    detections: list[dict[str, Any]] = field(default_factory=list)
    exclude: list[int] = field(default_factory=list)
    previous: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.on_mismatch not in MISMATCH_POLICIES:
            raise ConfigError(f"on_aggregate_mismatch must be one of {', '.join(MISMATCH_POLICIES)}; "
                              f"got {self.on_mismatch!r}.")
        if self.on_liar not in LIAR_POLICIES:
            raise ConfigError(f"on_lying_aggregator must be one of {', '.join(LIAR_POLICIES)}; got {self.on_liar!r}.")
        if int(self.replicas) < 1:
            raise ConfigError(f"aggregator_replicas must be >= 1; got {self.replicas}.")
        self.replicas = int(self.replicas)

    @property
    def lies(self) -> bool:
        """True when ``aggregator_lie`` faults are configured."""
        return self.injector is not None and self.injector.has("aggregator_lie")

    def begin(self) -> None:
        """Forget the previous step's records (called at the start of every reduction's cross-check)."""
        self.detections, self.exclude = [], []

    def lie_of(self, step: int, rank: int) -> Optional[Any]:
        """The ``aggregator_lie`` fault of worker ``rank`` at 0-based ``step`` (fires once), else ``None``."""
        return self.injector.lie(step, rank) if self.lies else None

    def lied(self, fault: Any, values: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """The liar's copy of the coordinates ``[start, end)`` whose honest value is ``values``."""
        prev = None if self.previous is None else self.previous[start:end]
        return self.injector.lied(fault, values, prev)

    def remember(self, aggregate: torch.Tensor) -> torch.Tensor:
        """Keep ``aggregate`` for a ``stale`` lie at the next step (only while lies are configured); returns it."""
        if self.lies:
            self.previous = aggregate.detach().clone()
        return aggregate

    def judge(self, step: int, outcomes: Sequence[tuple[Any, ...]], convicted: Optional[Sequence[int]] = None) -> None:
        """Turn per-slice vote outcomes into records, or stop (``abort``).

        Args:
            step: the 0-based step id.
            outcomes: ``(slice, start, end, liars, digests, majority digest[, of])`` of every slice
                that had a disagreement; ``of`` is ``"aggregate"`` (default: the aggregated slice)
                or ``"statistic"`` (a distance-based rule's partial statistic of that slice).
            convicted: the ranks every rank agreed to name (processes mode; default: every liar).

        Raises:
            DesyncError: a disagreement under ``on_mismatch="abort"``.
        """
        named = sorted({r for o in outcomes for r in o[3]} if convicted is None else {int(r) for r in convicted})
        if not named and not outcomes:
            return
        if self.on_mismatch == "abort":
            where = "; ".join(f"slice {o[0]} [{o[1]}, {o[2]}){' partial statistic' if _of(o) == 'statistic' else ''}: "
                              f"rank(s) {o[3]} differ from the majority" for o in outcomes) \
                or f"rank(s) {named} named by the other ranks"
            raise DesyncError(f"step {step + 1}: the replicas of the aggregate disagree ({where}). A rank computed a "
                              "wrong aggregate; set trainer.on_aggregate_mismatch=vote to use the majority and name it, "
                              "or restore every rank from one committed checkpoint.")
        action = "excluded" if self.on_liar == "exclude" else "outvoted"
        for r in named:
            slices = [{"slice": int(o[0]), "start": int(o[1]), "end": int(o[2]), "of": _of(o),
                       "digest": int(o[4].get(r, 0)), "majority_digest": int(o[5])} for o in outcomes if r in o[3]]
            self.detections.append(_record(step, r, action, slices))
        if self.on_liar == "exclude":
            self.exclude = named

    def settle_local(self, aggregate: torch.Tensor, step: int, placement: Sequence[tuple[int, int, tuple[int, ...]]]
                     ) -> torch.Tensor:
        """Cross-check in one process (the simulated mode): every simulated rank's copy of every slice.

        Honest holders' copies are the computed ``aggregate`` itself (their equality is by
        construction, so nothing is copied unless a lie fires); a lying holder's copy is its lie.

        Args:
            aggregate: ``(d,)`` the honestly computed aggregate.
            step: the 0-based step id.
            placement: ``(start, end, holders)`` of every slice (gather: one slice held by every rank).

        Returns:
            the aggregate every rank applies: the majority of every slice (``vote``); a slice
            whose only holder lies carries the lie (``r_a = 1`` cannot catch it).

        Raises:
            DesyncError: a disagreement under ``abort``, or a slice without a strict majority.
        """
        self.begin()
        if not self.lies:
            return self.remember(aggregate)
        faults = {r: f for r in sorted({r for _, _, h in placement for r in h})
                  if (f := self.lie_of(step, r)) is not None}
        if not faults:
            return self.remember(aggregate)
        out = aggregate.clone()
        outcomes = []
        for s, (a, b, holders) in enumerate(placement):
            liars_here = [r for r in holders if r in faults]
            if not liars_here:
                continue
            honest = aggregate[a:b]
            copies = [Copy(r, self.lied(faults[r], honest, a, b) if r in faults else honest) for r in holders]
            if len(copies) == 1:
                out[a:b] = copies[0].values  # one holder: nobody to compare with
                continue
            value, liars, digests = majority_copy(copies, step=step, what=f"slice {s} [{a}, {b})")
            out[a:b] = value
            if liars:
                outcomes.append((s, a, b, liars, digests, digests[next(c.rank for c in copies
                                                                      if c.rank not in liars)]))
        self.judge(step, outcomes)
        return self.remember(out)

    def settle_gathered(self, aggregate: torch.Tensor, step: int, comm: Any) -> torch.Tensor:
        """Cross-check in gather mode over a process group (one worker per process): every rank is a replica.

        This rank's copy is its computed ``aggregate`` (or its lie). Under ``abort`` nothing more
        happens here: the copy's digest travels in the next step's header, where any difference
        stops every rank (:func:`~robustagg.distributed.header.check_headers`). Under ``vote`` every
        rank contributes its copy's digest (one ``int64`` control-plane exchange per step); only when
        they differ are the copies themselves all-gathered (``world x d``) and the bit-exact majority
        used on every rank, the liars as their copies (not their claims) show.

        Raises:
            DesyncError: no strict majority. CollectiveError: as the collectives.
        """
        self.begin()
        fault = self.lie_of(step, comm.local_ranks[0]) if self.lies else None
        mine = aggregate if fault is None else self.lied(fault, aggregate, 0, aggregate.numel())
        if self.on_mismatch == "abort":
            return self.remember(mine)
        claims = comm.vote(checksum(mine), op="aggregate-digest")
        if len(set(claims)) == 1:
            return self.remember(mine)
        rows = comm.all_gather({comm.local_ranks[0]: mine})
        value, liars, digests = majority_copy([Copy(i, rows[i]) for i in range(rows.shape[0])], step=step,
                                              what="the aggregate")
        honest = next(i for i in range(rows.shape[0]) if i not in liars)
        self.judge(step, [(0, 0, aggregate.numel(), liars, digests, digests[honest])])
        return self.remember(value.clone())
