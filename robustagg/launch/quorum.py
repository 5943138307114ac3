"""Membership as a committed fact: epochs in a store, changed only by a strict majority, fenced commits.

The members of a run's group are numbered *epochs* kept in a ``torch.distributed`` store that every
member reaches (the app's launcher hosts a :class:`torch.distributed.TCPStore`; under torchrun it
would be the rendezvous store). Epoch 0 is the group as launched; epoch ``e + 1`` is written once,
by compare-and-set, and only by a proposer that reached a **strict majority** of epoch ``e``'s
members (``> |members| / 2``). Two disjoint sides of a partition cannot both hold a strict
majority, and the compare-and-set lets at most one proposal win, so at most one side continues.

Commits are fenced (:meth:`Membership.claim_commit`): before rank 0 writes a checkpoint's manifest
it increments a per-epoch counter; a proposer *seals* the epoch it replaces by adding
:data:`SEAL` to that same counter before it installs the next one. The store orders the two
``add`` calls, so a commit under a replaced epoch is refused, and a second commit of one step in
one epoch is refused too: two sides never both commit the same step.

Who decides what, in the app's own launcher (one machine, every process its child):

- **partition** (both sides alive; simulated by the injector, which blocks every collective
  across the cut): each worker runs :meth:`Membership.decide` over the store with the members it
  can reach; the majority side installs the next epoch, a minority stops with "lost quorum at
  step N: reached {…} of {…}". The launcher then restarts only the members of the installed
  epoch (after the rule's requirement is re-checked: :func:`~robustagg.launch.job.shrink_job`).
- **crash**: the launcher reaps the dead process and tears the rest of the group down, so no
  member of the old epoch is alive to commit; it installs the survivors as the next epoch
  (:func:`next_epoch`), refusing when they are not a strict majority of the last one.

References: the quorum rule is the majority-quorum argument of Lamport's Paxos ("The Part-Time
Parliament", ACM TOCS 1998) and of Raft's joint membership (Ongaro & Ousterhout, USENIX ATC
2014); per-step quorum with live peers follows TorchFT (pytorch/torchft), which averages and
handles crash faults only.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Iterable, Optional, Sequence

from ..errors import QuorumLostError

__all__ = ["SEAL", "Decision", "Membership", "majority", "fmt_members", "next_epoch"]

#: Added to an epoch's commit counter when the epoch is replaced: any later claim reads >= SEAL.
SEAL = 1 << 40


def majority(members: Sequence[int]) -> int:
    """The size of a strict majority of ``members``: ``len(members) // 2 + 1``.

    Example:
        >>> majority(range(6)), majority(range(5))
        (4, 3)
    """
    return len(tuple(members)) // 2 + 1


def fmt_members(members: Iterable[int]) -> str:
    """``{0, 1, 4}``: worker ids, ascending, in set notation (for messages).

    Example:
        >>> fmt_members([4, 0, 1])
        '{0, 1, 4}'
    """
    return "{" + ", ".join(str(int(w)) for w in sorted(set(int(w) for w in members))) + "}"


@dataclass(frozen=True)
class Decision:
    """What :meth:`Membership.decide` found for one worker.

    Attributes:
        epoch: the last committed epoch the decision started from.
        before: its members (worker ids).
        reached: the members this worker reached (itself included) that announced themselves alive.
        won: this worker is a member of the installed next epoch.
        after: the members of the next epoch the store holds (``()``: none was installed).
        step: the 1-based step at which the membership was lost.
    """

    epoch: int
    before: tuple[int, ...]
    reached: tuple[int, ...]
    won: bool
    after: tuple[int, ...]
    step: int

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (for evidence and lineage)."""
        return {**asdict(self), "before": list(self.before), "reached": list(self.reached),
                "after": list(self.after), "majority": majority(self.before)}

    def lost_message(self) -> str:
        """``lost quorum at step N: reached {…} of {…} (a strict majority needs k); …``."""
        return (f"lost quorum at step {self.step}: reached {fmt_members(self.reached)} of {fmt_members(self.before)} "
                f"(a strict majority needs {majority(self.before)}); this side stops and commits no checkpoint")


def _members(raw: bytes) -> tuple[int, ...]:
    return tuple(int(w) for w in json.loads(raw.decode()))


class Membership:
    """The committed membership of one run, kept in a ``torch.distributed`` store.

    Keys (under ``prefix``): ``epoch/<e>`` = the JSON list of epoch ``e``'s worker ids (written once,
    by compare-and-set); ``alive/<e>/<w>`` = worker ``w`` reached the store after losing epoch
    ``e``; ``fence/<e>`` = commits claimed in epoch ``e`` (>= :data:`SEAL` once sealed);
    ``commit/<e>/<step>`` = claims of that step in epoch ``e``.

    Args:
        store: a ``torch.distributed.Store`` (``TCPStore``, ``PrefixStore``, ``HashStore`` for tests)
            every member and the launcher reach.
        prefix: the key prefix of this run.

    Example:
        >>> import torch.distributed as dist
        >>> m = Membership(dist.HashStore())
        >>> m.install([0, 1, 2])
        (0, (0, 1, 2))
        >>> m.propose(0, [0, 1])  # 2 of 3: a strict majority
        (0, 1)
        >>> m.current()
        (1, (0, 1))
    """

    def __init__(self, store: Any, *, prefix: str = "robustagg/membership") -> None:
        self.store = store
        self.prefix = prefix.rstrip("/")

    @classmethod
    def connect(cls, host: str, port: int, *, timeout_s: float = 30.0, prefix: str = "robustagg/membership"
                ) -> "Membership":
        """A client of the launcher's ``TCPStore`` at ``host:port``.

        Raises:
            QuorumLostError: the store cannot be reached within ``timeout_s`` (this worker cannot
                take part in any membership decision).
        """
        import torch.distributed as dist

        try:
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=float(timeout_s)))
        except RuntimeError as exc:
            raise QuorumLostError(f"cannot reach the membership store at {host}:{port} within {timeout_s:g} s "
                                  f"({type(exc).__name__}: {exc})") from exc
        return cls(store, prefix=prefix)

    def _k(self, *parts: Any) -> str:
        return "/".join([self.prefix, *(str(p) for p in parts)])

    def _has(self, key: str) -> bool:
        return bool(self.store.check([key]))

    # --- reading ---------------------------------------------------------------------------------
    def members(self, epoch: int) -> tuple[int, ...]:
        """The worker ids of ``epoch``.

        Raises:
            QuorumLostError: no such epoch was installed.
        """
        key = self._k("epoch", int(epoch))
        if not self._has(key):
            raise QuorumLostError(f"membership epoch {epoch} was never installed in the store.")
        return _members(self.store.get(key))

    def epoch(self) -> int:
        """The newest installed epoch (``-1`` before :meth:`install`)."""
        e = -1
        while self._has(self._k("epoch", e + 1)):
            e += 1
        return e

    def current(self) -> tuple[int, tuple[int, ...]]:
        """``(newest epoch, its members)``.

        Raises:
            QuorumLostError: nothing was installed yet.
        """
        e = self.epoch()
        if e < 0:
            raise QuorumLostError("no membership was installed in the store (call install first).")
        return e, self.members(e)

    # --- writing ---------------------------------------------------------------------------------
    def install(self, members: Sequence[int]) -> tuple[int, tuple[int, ...]]:
        """Install epoch 0 (the group as launched) unless one exists; returns :meth:`current`.

        Raises:
            QuorumLostError: ``members`` is empty or repeats a worker id.
        """
        mem = tuple(int(w) for w in members)
        if not mem or len(set(mem)) != len(mem):
            raise QuorumLostError(f"a membership needs distinct worker ids; got {list(mem)}.")
        self.store.compare_set(self._k("epoch", 0), "", json.dumps(sorted(mem)))
        return self.current()

    def seal(self, epoch: int) -> None:
        """Refuse every later commit claim in ``epoch`` (called before it is replaced)."""
        self.store.add(self._k("fence", int(epoch)), SEAL)

    def propose(self, epoch: int, members: Sequence[int]) -> tuple[int, ...]:
        """Install epoch ``epoch + 1`` = ``members`` if none is installed yet; return what the store holds.

        Requirement: ``members`` must be a strict majority of epoch ``epoch``'s members (a
        proposer that reached fewer must not propose; :meth:`decide` enforces it). Seals
        ``epoch`` first, then compare-and-sets the next epoch: exactly one proposal wins.

        Raises:
            QuorumLostError: ``members`` is not a strict majority of epoch ``epoch``, or names a
                worker that was not a member of it.
        """
        before = self.members(epoch)
        mem = tuple(sorted(set(int(w) for w in members)))
        if not set(mem) <= set(before):
            raise QuorumLostError(f"cannot propose {fmt_members(mem)}: only members of epoch {epoch} "
                                  f"{fmt_members(before)} decide its successor (a joiner is added by a grow).")
        if len(mem) < majority(before):
            raise QuorumLostError(f"cannot propose {fmt_members(mem)} of {fmt_members(before)}: a strict majority "
                                  f"needs {majority(before)} members.")
        self.seal(epoch)
        stored = self.store.compare_set(self._k("epoch", int(epoch) + 1), "", json.dumps(list(mem)))
        return _members(stored)

    def claim_commit(self, epoch: int, step: int) -> None:
        """Claim the right to commit the checkpoint of ``step`` under ``epoch`` (rank 0, before the manifest).

        Raises:
            QuorumLostError: ``epoch`` was sealed (a newer membership was installed: this side
                lost quorum), or ``step`` was already claimed in ``epoch``.
        """
        if int(self.store.add(self._k("fence", int(epoch)), 1)) >= SEAL:
            newest = self.epoch()
            raise QuorumLostError(f"refusing to commit step {step}: membership epoch {epoch} was replaced by epoch "
                                  f"{newest} {fmt_members(self.members(newest)) if newest >= 0 else ''}; this side "
                                  "lost quorum and must stop.")
        if int(self.store.add(self._k("commit", int(epoch), int(step)), 1)) != 1:
            raise QuorumLostError(f"refusing to commit step {step}: it was already committed under membership "
                                  f"epoch {epoch} (two committers of one step: split brain prevented).")

    # --- the decision after a lost collective ---------------------------------------------------------
    def decide(self, epoch: int, me: int, reachable: Iterable[int], *, step: int, wait_s: float = 5.0,
               poll_s: float = 0.02) -> Decision:
        """Run the quorum protocol for worker ``me`` after its group failed at ``step``.

        1. announce ``alive/<epoch>/<me>``;
        2. wait (at most ``wait_s`` seconds) until every member of ``epoch`` in ``reachable``
           has announced itself; those that did are *reached*;
        3. with a strict majority of epoch ``epoch`` reached: :meth:`propose` them (the first
           proposal wins); otherwise propose nothing.

        Args:
            epoch: the last committed epoch (this worker's).
            me: this worker's id (a member of ``epoch``).
            reachable: the worker ids this worker can still exchange data with (itself included);
                on a real partition, the side it is on; without one, every member.
            step: the 1-based step at which the group failed (for the message).
            wait_s: how long to wait for the reachable members' announcements (> 0 seconds).
            poll_s: the store poll interval (seconds).

        Returns:
            a :class:`Decision` with ``won=True`` when ``me`` is in the installed next epoch.

        Raises:
            QuorumLostError: this side reached no strict majority, or the installed epoch leaves
                ``me`` out (message: :meth:`Decision.lost_message`).
            ValueError: ``wait_s`` is not positive, or ``me`` is not a member of ``epoch``.
        """
        if not wait_s > 0:
            raise ValueError(f"decide: wait_s must be > 0 seconds; got {wait_s}.")
        before = self.members(epoch)
        if int(me) not in before:
            raise ValueError(f"decide: worker {me} is not a member of epoch {epoch} {fmt_members(before)}.")
        self.store.set(self._k("alive", int(epoch), int(me)), "1")
        wanted = [w for w in before if w in set(int(r) for r in reachable) | {int(me)}]
        deadline = time.monotonic() + float(wait_s)
        while True:
            reached = tuple(w for w in wanted if self._has(self._k("alive", int(epoch), w)))
            if len(reached) == len(wanted) or time.monotonic() >= deadline:
                break
            time.sleep(poll_s)
        after: tuple[int, ...] = ()
        if len(reached) >= majority(before):
            after = self.propose(epoch, reached)
        elif self._has(self._k("epoch", int(epoch) + 1)):
            after = self.members(int(epoch) + 1)
        decision = Decision(epoch=int(epoch), before=before, reached=reached, won=int(me) in after, after=after,
                            step=int(step))
        if not decision.won:
            raise QuorumLostError(decision.lost_message())
        return decision


def next_epoch(ms: Membership, epoch: int, lost: Sequence[int], *, step: Optional[int],
               reports: Sequence[str] = ()) -> tuple[int, tuple[int, ...], str]:
    """The launcher's view after a failed attempt: the epoch the next attempt runs under.

    If the workers' own quorum installed a newer epoch (a partition), that one is taken.
    Otherwise, when no worker reported a lost quorum, every process of ``epoch`` is gone (the
    launcher reaped or stopped them), so the launcher itself seals ``epoch`` and installs its
    members minus ``lost`` — provided they are a strict majority of ``epoch``.

    Args:
        ms: the run's :class:`Membership`.
        epoch: the epoch of the failed attempt.
        lost: worker ids the launcher saw die or had to stop.
        step: the 1-based step at which the attempt failed (``None``: unknown), for messages.
        reports: the messages of workers that raised :class:`~robustagg.errors.QuorumLostError`.

    Returns:
        ``(new epoch, its members, who decided: "quorum" or "launcher")``.

    Raises:
        QuorumLostError: no side reached a strict majority (the message quotes every side's
            report), or the survivors of a crash are not a strict majority of ``epoch``.
    """
    before = ms.members(epoch)
    newest = ms.epoch()
    if newest > epoch:
        return newest, ms.members(newest), "quorum"
    at = f" at step {step}" if step is not None else ""
    if reports:
        sides = "; ".join(dict.fromkeys(str(r).splitlines()[0] for r in reports))
        raise QuorumLostError(f"no side of the group holds a strict majority of the last committed membership "
                              f"{fmt_members(before)}{at} (a strict majority needs {majority(before)}): {sides}. "
                              "The run stops; no side committed a checkpoint after the failure. Heal the network "
                              "and run the same command to resume from the last committed checkpoint.")
    survivors = tuple(w for w in before if w not in {int(x) for x in lost})
    if len(survivors) < majority(before):
        raise QuorumLostError(f"lost quorum{at}: {fmt_members(survivors)} of {fmt_members(before)} survive (a strict "
                              f"majority needs {majority(before)}); the run stops. Run the same command to resume "
                              "from the last committed checkpoint with every worker.")
    return epoch + 1, ms.propose(epoch, survivors), "launcher"
