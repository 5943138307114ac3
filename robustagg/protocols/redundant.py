"""``protocol=redundant``: replica groups, a bit-for-bit majority vote per group, then the robust rule.

Assignment (DETOX-style disjoint groups; Rajput, Wang, Charles, Papailiopoulos, NeurIPS 2019): the
``n`` workers form ``G = n / r`` groups of ``r`` consecutive ranks, group ``g`` being ranks
``g r .. g r + r - 1``; ``r`` is odd and must divide ``n`` (no rule for a remainder: it is refused).
Every replica of a group holds the group's data shard and draws the group's batch and RNG stream
(keyed by the group's first rank), so honest replicas compute bit-identical rows.

Reconstruction rule (stated once, checked at every update): per group, a row that at least
``q = ceil((r + 1) / 2)`` replicas submitted **bit for bit** (equal framed checksums, and equal
bytes) is the group's output; a group without such a row is a detected fault, dropped from the
update or aborting the run (``on_no_majority``). The ``<= G`` group outputs then go through the
configured rule (``rule=mean``: pure redundancy).

Derived requirement: ``f`` Byzantine workers placed adversarially take over at most
``floor(f / q)`` groups, so the rule must meet its own requirement with ``floor(f / q)`` bad rows
among ``G`` (:func:`takeover_bound`, :func:`composed_requirement`).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Optional, Sequence

import numpy as np
import torch

from ..distributed.header import step_name
from ..errors import ConfigError, IntegrityError, ReplicaVoteError
from ..requirements import Requirement
from .base import RoundPlan, Trainer
from .dsgd import DSGD

if TYPE_CHECKING:  # pragma: no cover
    from ..distributed.reduction import Reduced, Transform

__all__ = ["OnNoMajority", "GroupVote", "quorum", "takeover_bound", "groups_of", "majority_vote", "pool_parts",
           "composed_requirement", "Redundant"]


class OnNoMajority(str, enum.Enum):
    """What a group without a bit-identical majority does: ``drop`` it from the update (recorded
    as a detection; the rule sees fewer rows) or ``abort`` the run (:class:`ReplicaVoteError`)."""

    DROP = "drop"
    ABORT = "abort"


def quorum(r: int) -> int:
    """``ceil((r + 1) / 2)``: the replicas that must agree bit for bit (a strict majority of ``r``).

    Example:
        >>> [quorum(r) for r in (1, 3, 5, 7)]
        [1, 2, 3, 4]
    """
    return math.ceil((int(r) + 1) / 2)


def takeover_bound(f: int, r: int) -> int:
    """``floor(f / q)``: the most groups ``f`` adversarially placed Byzantine workers can take over.

    A group's output is Byzantine only when at least ``q = quorum(r)`` of its replicas agree on a
    Byzantine row, so each taken-over group costs the adversary ``q`` workers.

    Example:
        >>> takeover_bound(2, 3), takeover_bound(1, 3), takeover_bound(5, 5)
        (1, 0, 1)
    """
    return int(f) // quorum(r)


def groups_of(n: int, r: int) -> list[tuple[int, ...]]:
    """The disjoint groups of ``r`` consecutive ranks of ``n`` workers.

    Raises:
        ConfigError: ``r`` is not an odd integer >= 1, or does not divide ``n`` (message names
            ``protocol.r`` and the fix).

    Example:
        >>> groups_of(6, 3)
        [(0, 1, 2), (3, 4, 5)]
    """
    if isinstance(r, bool) or not isinstance(r, int) or r < 1 or r % 2 == 0:
        raise ConfigError(f"protocol.r must be an odd integer >= 1 (replicas per group; a tie cannot be voted); "
                          f"got {r!r}. Use e.g. protocol.r=3.")
    if n % r:
        raise ConfigError(f"protocol.r={r} does not divide threat.n={n}: every group needs exactly r replicas (no "
                          f"rule for a remainder). Use threat.n={n - n % r or r} or {n + r - n % r}, or another r.")
    return [tuple(range(g * r, g * r + r)) for g in range(n // r)]


def pool_parts(parts: Sequence[np.ndarray], r: int) -> list[np.ndarray]:
    """Every replica's data: the union (concatenated in rank order) of its group's original parts.

    The data set is first partitioned among the ``n`` workers as configured; each group then pools
    its members' parts so that its replicas hold the same shard and no example is left unused.

    Raises:
        ConfigError: as :func:`groups_of`.

    Example:
        >>> [p.tolist() for p in pool_parts([np.array([0]), np.array([3, 4]), np.array([1])], 1)]
        [[0], [3, 4], [1]]
    """
    out: list[np.ndarray] = []
    for grp in groups_of(len(parts), r):
        pooled = np.concatenate([np.asarray(parts[w], dtype=np.int64) for w in grp])
        out.extend(pooled.copy() for _ in grp)
    return out


@dataclass(frozen=True)
class GroupVote:
    """The vote of one replica group at one update.

    Attributes:
        group: the group id. replicas: its ranks. present: those whose row reached the vote (the
            integrity layer may have dropped a non-finite one). agreed: the ranks that submitted the
            winning row (empty: no majority). digests: ``{rank: framed checksum}`` of the present ones.
        row: the index (into the voted matrix) of the winning row, or ``None``.
    """

    group: int
    replicas: tuple[int, ...]
    present: tuple[int, ...]
    agreed: tuple[int, ...]
    digests: dict[int, int] = field(default_factory=dict)
    row: Optional[int] = None

    @property
    def majority(self) -> bool:
        """True when the group has an output."""
        return self.row is not None

    @property
    def disagreeing(self) -> tuple[int, ...]:
        """Replicas that did not submit the winning row (every replica when there is no majority)."""
        return tuple(w for w in self.replicas if w not in self.agreed)


def majority_vote(x: torch.Tensor, ranks: Sequence[int], sums: Sequence[int],
                  groups: Sequence[tuple[int, ...]], q: int) -> list[GroupVote]:
    """The bit-for-bit majority vote of every group over the rows ``x`` submitted by ``ranks``.

    Rows are bucketed by their framed checksum; a bucket counts only rows whose bytes equal the
    bucket's first row (``torch.equal``), so a checksum collision cannot merge different rows. A
    bucket of at least ``q`` rows wins (at most one can, since ``q > r / 2``); ties by lowest rank.

    Args:
        x: ``(k, d)`` the kept rows, any dtype. ranks: the worker rank of each row (ascending).
        sums: the framed checksum of each row. groups: the groups' ranks. q: the quorum.

    Returns:
        one :class:`GroupVote` per group, in group order.

    Example:
        >>> x = torch.tensor([[1.0], [1.0], [2.0], [5.0], [6.0], [7.0]])
        >>> v = majority_vote(x, [0, 1, 2, 3, 4, 5], [1, 1, 2, 5, 6, 7], [(0, 1, 2), (3, 4, 5)], 2)
        >>> [(g.agreed, g.disagreeing, g.row) for g in v]
        [((0, 1), (2,), 0), ((), (3, 4, 5), None)]
    """
    pos = {int(w): i for i, w in enumerate(ranks)}
    votes = []
    for g, grp in enumerate(groups):
        present = tuple(w for w in grp if w in pos)
        buckets: list[list[int]] = []
        for w in present:
            i = pos[w]
            for b in buckets:
                j = pos[b[0]]
                if int(sums[j]) == int(sums[i]) and torch.equal(x[j], x[i]):
                    b.append(w)
                    break
            else:
                buckets.append([w])
        win = next((b for b in buckets if len(b) >= q), None)
        votes.append(GroupVote(group=g, replicas=tuple(grp), present=present,
                               agreed=tuple(win) if win else (), digests={w: int(sums[pos[w]]) for w in present},
                               row=None if win is None else pos[win[0]]))
    return votes


def composed_requirement(rule: Any, n: int, r: int, f: int) -> list[tuple[Requirement, int, int]]:
    """``(requirement, rows, f)`` to check for ``rule`` behind the vote of ``n / r`` groups.

    The rule's own stages at ``G = n / r`` rows with its configured ``f``, plus the condition that
    the rule's ``f`` covers the ``floor(f / q)`` groups an adversary can take over.

    Raises:
        ConfigError: as :func:`groups_of`.
    """
    groups = len(groups_of(n, r))
    stages = rule.stages(groups) if hasattr(rule, "stages") else [(rule.requirement, groups, rule.f)]
    bad = takeover_bound(f, r)
    q = quorum(r)
    covers = Requirement(f"protocol=redundant (r={r}, quorum {q}, {groups} groups)",
                         f"aggregator.f >= floor(threat.f / {q}) = {bad}", lambda _n, rf: rf >= bad,
                         "Rajput et al., NeurIPS 2019 (DETOX)")
    return [*stages, (covers, groups, int(getattr(rule, "f", 0)))]


class Redundant(DSGD):
    """Replica groups with a bit-for-bit majority vote, then the configured robust rule.

    Per update every worker computes one gradient (through its worker momentum, as
    :class:`~robustagg.protocols.DSGD`) on its group's batch with its group's RNG stream; the
    reduction gathers every row with its checksum; the vote (:func:`majority_vote`) keeps one row
    per group with a bit-identical quorum ``q = ceil((r+1)/2)``; the rule aggregates the ``<= n/r``
    group outputs (labels: group ids); the optimizer steps with the aggregate.

    Guarantees: a Byzantine or faulty replica that is outvoted in its group changes nothing, and it
    is *identified* (a detection record names it). A group is taken over only by ``q`` agreeing
    Byzantine workers, so ``f`` workers take over at most ``floor(f / q)`` groups; the rule then
    needs its requirement for that many bad rows among ``n/r`` (:func:`composed_requirement`).
    Gives up: ``r`` gradient computations per distinct row (effective batch ``n/r x b`` for the
    compute of ``n x b``), and nothing against *common-mode* faults (the same wrong row from every
    replica: a shared bug, a bad input), which pass the vote and meet only the rule.

    Assumption: honest replicas are bit-identical: same device type, CPU with deterministic
    kernels (one thread recommended), same torch build; the caller gives every replica of a group
    the same shard (:func:`pool_parts`). Needs the ``gather`` reduction (every rank votes).

    Args:
        r: replicas per group (odd, divides n). f: the declared Byzantine bound (for
            :meth:`describe`; the apps interpolate ``threat.f``). on_no_majority: an
            :class:`OnNoMajority` value. assignment: ``disjoint`` (the only one implemented).

    Raises:
        ConfigError: a bad ``r`` (in :meth:`bind`, once ``n`` is known), ``on_no_majority`` or
            ``assignment``; shards that are not in-memory (``bind``).
    """

    name: ClassVar[str] = "redundant"
    #: A shrink breaks the replica groups (r must divide n): refused before launch.
    shrinkable: ClassVar[bool] = False
    gathers: ClassVar[bool] = True
    #: Refused: a group's replicas are compared bit for bit, and their processes may batch different
    #: numbers of workers (batched gradients are not bit-identical to the loop in general).
    batched: ClassVar[Optional[str]] = None

    def __init__(self, *, r: int = 3, f: Optional[int] = None, on_no_majority: str = "drop",
                 assignment: str = "disjoint") -> None:
        if isinstance(r, bool) or not isinstance(r, int) or r < 1 or r % 2 == 0:
            raise ConfigError(f"protocol.r must be an odd integer >= 1; got {r!r}. Use e.g. protocol.r=3.")
        try:
            self.on_no_majority = OnNoMajority(on_no_majority)
        except ValueError:
            raise ConfigError(f"protocol.on_no_majority must be drop or abort; got {on_no_majority!r}.") from None
        if assignment != "disjoint":
            raise ConfigError(f"protocol.assignment must be disjoint (DETOX groups; overlapping groups are not "
                              f"implemented); got {assignment!r}.")
        if f is not None and (isinstance(f, bool) or not isinstance(f, int) or f < 0):
            raise ConfigError(f"protocol.f must be a non-negative integer (threat.f); got {f!r}.")
        self.r, self.f, self.assignment = r, f, assignment
        self.q = quorum(r)
        self.groups: list[tuple[int, ...]] = []
        self.batch = 0
        self.rule_desc = ""
        self._votes: list[GroupVote] = []
        self._detections: list[dict[str, Any]] = []

    def group_of(self, rank: int) -> int:
        """The group id of worker ``rank``."""
        return int(rank) // self.r

    def bind(self, trainer: Trainer) -> None:
        """Form the groups and give every hosted replica its group's sampler and RNG stream."""
        from ..training.sampler import ShardSampler, mix_seed

        n = trainer.comm.world_size
        self.groups = groups_of(n, self.r)
        for rank in trainer.comm.local_ranks:
            s = trainer.samplers[rank]
            if not isinstance(s, ShardSampler):
                raise ConfigError("protocol=redundant needs in-memory shards (Shard): replicas must draw the same "
                                  f"batch from the same shard; worker {rank} has a {type(s).__name__}.")
            lead = self.groups[self.group_of(rank)][0]
            trainer.samplers[rank] = ShardSampler(s.size, s.batch, seed=s.seed, rank=lead)
            trainer.worker_rng[rank] = torch.Generator().manual_seed(mix_seed(trainer.seed, lead, 0x5EED)).get_state()
            self.batch = s.batch
        inj = getattr(trainer, "injector", None)
        if inj is not None and hasattr(inj, "peers"):
            inj.peers = {w: grp for grp in self.groups for w in grp}  # common_mode faults hit the whole group
        rule = trainer.reduction.rule
        self.rule_desc = f"{getattr(rule, 'display_name', type(rule).__name__)} with f={getattr(rule, 'f', 0)}"

    def plan(self, trainer: Trainer, step: int) -> RoundPlan:
        """Every worker, fresh; ``plan.info`` gets the vote's numbers when the reduction runs."""
        return RoundPlan(step=step, members=tuple(range(trainer.comm.world_size)), full=True, info={})

    def transform(self, plan: RoundPlan) -> "Transform":
        """The vote of this update (see :func:`majority_vote`); fills ``plan.info`` and the detections.

        Raises (from the returned callable):
            ReplicaVoteError: a group has no majority under ``on_no_majority=abort``.
            IntegrityError: no group has a majority (nothing to aggregate).
        """

        def vote(x: torch.Tensor, ranks: list[int], sums: list[int]) -> tuple[torch.Tensor, list[int]]:
            votes = majority_vote(x, ranks, sums, self.groups, self.q)
            self._votes = [v for v in votes if v.majority]
            self._detections = []
            for v in votes:
                if v.disagreeing:
                    self._detections.append({
                        "kind": "replica_vote", "step": plan.step + 1, "group": v.group, "replicas": list(v.replicas),
                        "agreed": list(v.agreed), "disagreeing": list(v.disagreeing),
                        "missing": [w for w in v.replicas if w not in v.present],
                        "digests": {str(w): f"{d & (2**64 - 1):016x}" for w, d in v.digests.items()},
                        "action": "voted_out" if v.majority else f"no_majority_{self.on_no_majority.value}"})
            lost = [v for v in votes if not v.majority]
            plan.info.update({"vote/groups": len(self._votes), "vote/no_majority": len(lost),
                              "vote/disagreements": sum(1 for v in votes if v.disagreeing)})
            if lost and self.on_no_majority is OnNoMajority.ABORT:
                what = "; ".join(f"group {v.group} (replicas {list(v.replicas)}, digests "
                                 f"{ {w: f'{d & (2**64 - 1):016x}' for w, d in v.digests.items()} })" for v in lost)
                raise ReplicaVoteError(f"{step_name(plan.step)}: no {self.q} of {self.r} replicas agree bit for bit in "
                                       f"{what}. Set protocol.on_no_majority=drop to leave such groups out.")
            if not self._votes:
                raise IntegrityError(f"{step_name(plan.step)}: no replica group has a majority; nothing to aggregate.")
            rows = [v.row for v in self._votes]
            return x[rows], [v.group for v in self._votes]

        return vote

    def detections(self, plan: RoundPlan) -> list[dict[str, Any]]:
        """This update's vote disagreements (one record per group; see ``docs/redundancy.md``)."""
        out, self._detections = self._detections, []
        return out

    def honest_inputs(self, reduced: "Reduced", byzantine: tuple[int, ...]) -> list[bool]:
        """A group output is honest when an honest replica submitted it (else a Byzantine quorum did)."""
        by_group = {v.group: v for v in self._votes}
        return [any(w not in byzantine for w in by_group[g].agreed) for g in reduced.inputs]

    def reference(self, trainer: Trainer, plan: RoundPlan, reduced: "Reduced",
                  byzantine: tuple[int, ...]) -> Optional[torch.Tensor]:
        """The mean over groups holding an honest replica of that replica's row (float64)."""
        x = reduced.matrix
        if x is None:
            return None
        firsts = [next((w for w in grp if w not in byzantine), None) for grp in self.groups]
        rows = [reduced.row_of(w) for w in firsts if w is not None]
        return x[rows].to(torch.float64).mean(dim=0) if rows else None

    def describe(self) -> dict[str, Any]:
        """Settings, cost and the derived requirement (``protocol_*``, ``cost/*`` keys of the summary)."""
        n, g = len(self.groups) * self.r, len(self.groups)
        out: dict[str, Any] = {
            "protocol": self.name, "protocol_r": self.r, "protocol_assignment": self.assignment,
            "protocol_groups": g, "protocol_quorum": self.q, "protocol_on_no_majority": self.on_no_majority.value,
            "cost/gradients_per_update": n, "cost/distinct_gradients_per_update": g,
            "cost/examples_per_update": n * self.batch, "cost/effective_batch": g * self.batch}
        if self.f is not None:
            out["protocol_takeover_bound"] = takeover_bound(self.f, self.r)
            out["protocol_requirement"] = (f"f={self.f} Byzantine workers take over at most floor({self.f}/{self.q}) = "
                                           f"{takeover_bound(self.f, self.r)} of {g} groups; the rule ({self.rule_desc})"
                                           f" sees {g} rows")
        return out
