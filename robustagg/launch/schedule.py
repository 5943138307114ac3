"""A membership schedule for simulated runs: the reference a healed run is compared with.

A run with a crash, a shrink and a rejoin (:mod:`~robustagg.launch.grow`) follows a trajectory of
its own: availability does not preserve the original one. To say *which* trajectory it follows,
the same membership changes can be replayed without any failure: ``trainer.membership`` lists
absences, each ``{workers: [ids], absent: [a, b]}`` = those worker ids take no part in the 1-based
steps ``a, a+1, ..., b-1`` (``b = 0``: they never come back). In ``simulated`` mode the library
rebuilds the group at every change exactly as the app's launcher does after a failure
(:func:`~robustagg.launch.job.shrink_job`, :func:`~robustagg.launch.job.grow_job`: normalisation
over the members, effective batch, the rule's requirement re-checked) and writes the same
``shrink`` / ``grow`` lineage records.

**What an absent worker's own state is when it comes back.** An absent worker computes nothing: its
data position, momentum buffer, RNG streams and per-worker protocol state stay as they were after
step ``a - 1`` (frozen), and it resumes them at step ``b``. That is the choice the real run makes
when its survivors restore the checkpoint of step ``a - 1`` (the last commit the lost worker took
part in) and its replacement takes its own state from that same commit (on disk, or from a peer's
memory: :mod:`~robustagg.launch.peer`): the steps the lost worker computed between that commit and
its crash are discarded with everybody else's. So a real run whose worker ``w`` crashed after the
commit of step ``R`` and rejoined with ``join_step = B`` (the survivors admit it after ``B``
completed steps) has the reference ``{workers: [w], absent: [R + 1, B + 1]}``: the test
``tests/test_membership.py::test_a_healed_run_is_bit_equal_to_its_reference_membership_schedule``
checks parameters, optimizer state and every worker's own state bit for bit.

Assumption: the schedule never leaves fewer members than the rule needs (``n' >= ...`` is
re-checked at every change; a strict rule raises :class:`~robustagg.errors.AssumptionError`), and
never empties the group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from ..errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from ..training import Trainer

__all__ = ["Absence", "parse_membership", "members_at", "sizes", "MembershipWatch"]


@dataclass(frozen=True)
class Absence:
    """Worker ids that take no part in the 1-based steps ``start .. stop - 1`` (``stop = 0``: for good).

    Attributes:
        workers: the absent worker ids (sorted, distinct).
        start: the first 1-based step without them (>= 1).
        stop: the first 1-based step with them again (> ``start``), or 0.
    """

    workers: tuple[int, ...]
    start: int
    stop: int = 0

    def covers(self, step: int) -> bool:
        """True when the 1-based ``step`` is one of the absence's."""
        return self.start <= int(step) and (self.stop == 0 or int(step) < self.stop)

    def overlaps(self, other: "Absence") -> bool:
        """True when some step is one of both absences' (whatever their workers)."""
        return self.covers(other.start) or other.covers(self.start)


def parse_membership(items: Iterable[Any], *, key: str = "trainer.membership", n: int = 0) -> tuple[Absence, ...]:
    """Check and parse a schedule: a list of ``{"workers": [ids], "absent": [a, b]}``.

    Args:
        items: the configured list (plain containers or Hydra nodes).
        key: the configuration key, for messages.
        n: the group's size (worker ids must be ``< n``; 0: unchecked).

    Raises:
        ConfigError: an entry is not a mapping with exactly ``workers`` and ``absent``, a worker id
            or step is not a whole number, a worker is listed twice in one entry, a worker id is
            negative or ``>= n``, ``a < 1``, ``b`` is neither 0 nor ``> a``, two entries make one
            worker absent at the same step, or at some step every worker would be absent.
    """
    out: list[Absence] = []
    for i, item in enumerate(items or ()):
        where = f"{key}[{i}]"
        if not isinstance(item, Mapping) or set(item) != {"workers", "absent"}:
            raise ConfigError(f"{where} must be {{workers: [worker ids], absent: [first step, first step back]}}; "
                              f"got {item!r}.")
        raw_workers, raw_absent = item["workers"], item["absent"]
        if (isinstance(raw_workers, (str, bytes)) or not isinstance(raw_workers, Iterable)
                or isinstance(raw_absent, (str, bytes)) or not isinstance(raw_absent, Iterable)
                or not all(_whole(v) for v in (*raw_workers, *raw_absent)) or len(list(raw_absent)) != 2):
            raise ConfigError(f"{where}: workers must be a list of worker ids and absent a pair [a, b] of 1-based "
                              f"steps, all whole numbers; got {dict(item)!r}.")
        listed = [int(w) for w in raw_workers]
        workers = tuple(sorted(set(listed)))
        a, b = (int(v) for v in raw_absent)
        if len(listed) != len(workers):
            twice = sorted({w for w in listed if listed.count(w) > 1})
            raise ConfigError(f"{where}.workers lists worker(s) {twice} more than once; name each worker once.")
        if not workers or min(workers) < 0 or (n and max(workers) >= n):
            top = n - 1 if n else "n-1"
            raise ConfigError(f"{where}.workers must name worker ids in 0..{top}; got {list(workers)}.")
        if a < 1 or (b != 0 and b <= a):
            raise ConfigError(f"{where}.absent = [{a}, {b}]: the workers are absent in the 1-based steps a..b-1, so "
                              "a >= 1 and b > a (or b = 0: they never come back).")
        new = Absence(workers, a, b)
        for j, old in enumerate(out):
            both = sorted(set(old.workers) & set(workers))
            if both and old.overlaps(new):
                raise ConfigError(f"{where} and {key}[{j}] both make worker(s) {both} absent at step "
                                  f"{max(old.start, new.start)}; merge them into one entry (an absence is one "
                                  "interval of steps per worker).")
        out.append(new)
    sched = tuple(out)
    if n:
        for s in sorted({x.start for x in sched}):
            if not members_at(sched, range(n), s):
                raise ConfigError(f"{key}: every worker is absent at step {s}; at least one must remain.")
    return sched


def _whole(v: Any) -> bool:
    """True for a whole number (``3``, ``3.0``); ``3.5``, ``True`` and ``"3"`` are not steps or worker ids."""
    return not isinstance(v, bool) and (isinstance(v, int) or (isinstance(v, float) and v.is_integer()))


def sizes(schedule: Sequence[Absence], n: int) -> dict[int, int]:
    """``{1-based step: the number of members from that step on}`` at every change of the schedule.

    Example:
        >>> sizes([Absence((4, 5), 3, 5)], 6)
        {3: 4, 5: 6}
    """
    changes = sorted({x.start for x in schedule} | {x.stop for x in schedule if x.stop})
    return {s: len(members_at(schedule, range(int(n)), s)) for s in changes}


def members_at(schedule: Sequence[Absence], workers: Iterable[int], step: int) -> tuple[int, ...]:
    """The worker ids of ``workers`` that take part in the 1-based ``step`` under ``schedule``.

    Example:
        >>> members_at([Absence((5,), 3, 7)], range(6), 3), members_at([Absence((5,), 3, 7)], range(6), 7)
        ((0, 1, 2, 3, 4), (0, 1, 2, 3, 4, 5))
    """
    gone = {w for x in schedule if x.covers(step) for w in x.workers}
    return tuple(sorted(int(w) for w in workers if int(w) not in gone))


class MembershipWatch:
    """A ``fit`` callback (simulated mode): after ``k`` completed steps, stop ``fit`` when the members
    of step ``k + 1`` differ from the workers the trainer hosts.

    Raises :class:`~robustagg.launch.grow.Regroup` (the same exception the live grow uses) so the
    worker loop rebuilds the group at that boundary; nothing after ``last_step``.

    Args:
        schedule: the parsed absences.
        workers: every worker id of the original group.
        last_step: the run's last step.
    """

    def __init__(self, schedule: Sequence[Absence], workers: Sequence[int], *, last_step: int) -> None:
        self.schedule, self.workers, self.last_step = tuple(schedule), tuple(workers), int(last_step)

    def __call__(self, trainer: "Trainer", out: Any) -> None:
        from .grow import Regroup

        k = trainer.step_id
        if k < self.last_step and members_at(self.schedule, self.workers, k + 1) != tuple(
                sorted(trainer.identities.values())):
            raise Regroup(k)
