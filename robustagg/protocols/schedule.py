"""The virtual-time schedule of ``protocol=async``: who arrives at which update, and how stale.

A pure, seeded discrete-event simulation (integer *ticks* of virtual time) that every process
computes identically, so an update's members are known everywhere without a collective and a run
is reproducible bit for bit. No wall clock is read.

Model (one server, n workers; ``version`` = number of updates applied to the parameters)::

    t = 0: every worker starts job 0 on version 0
    worker w's j-th job takes DelayModel.duration(w, j) >= 1 ticks; its row arrives when it ends
    a row computed on version v that arrives while update u is the next one has staleness u - v
      staleness > max_staleness:  rejected on arrival ("discarded"); w restarts at once on version u
      otherwise:                  it waits for update u
    update u happens at the first tick where at least min_arrivals usable rows wait; it takes
      every waiting row (never waits for more); each of those workers starts its next job then,
      on version u + 1

A row is *usable* unless ``drop_above`` is set and its staleness exceeds it (the server receives
such a row but leaves it out of the rule; it does not count towards ``min_arrivals``). Since a row
is always computed on the parameters current when its job starts, the trainer evaluates it in
step ``v`` (while the parameters are version ``v``) and the worker holds it until it arrives: no
parameter history is kept.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from ..errors import ConfigError
from ..training.sampler import mix_seed

__all__ = ["DelayKind", "DelayModel", "Update", "StalenessSchedule"]


class DelayKind(str, enum.Enum):
    """How job durations are drawn (``protocol.delay``); see :class:`DelayModel`."""

    uniform = "uniform"
    fixed = "fixed"
_TAG = 0xA5C0  # separates the delay stream from the other streams derived from the run's seed


def _int_at_least(value: Any, low: int, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"protocol.{key} must be an integer >= {low}; got {value!r}.")
    return int(value)


@dataclass(frozen=True)
class DelayModel:
    """How many ticks of virtual time each job of each worker takes (deterministic, seeded).

    Args:
        kind: ``uniform``: the duration of worker ``w``'s job ``j`` is uniform on the integers
            ``[min_delay, max_delay]``, drawn from ``mix_seed(seed, w, j)`` (independent of every
            other draw and of how workers are spread over processes); ``fixed``: always
            ``delays[w]``.
        min_delay: the smallest duration of ``uniform`` (ticks, ``>= 1``).
        max_delay: the largest duration of ``uniform`` (ticks, ``>= min_delay``).
        delays: ``fixed``: one duration per worker (ticks, each ``>= 1``).
        slow_workers: stragglers: their honest durations are multiplied by ``slow_factor``.
        slow_factor: integer ``>= 1``.
        byzantine: the Byzantine worker ranks, whose timing ``byzantine_delay`` overrides.
        byzantine_delay: ``None`` (Byzantine workers draw like the others) or the duration of
            every Byzantine job (1: always first, so its rows are the freshest).
        seed: the run's seed.

    Raises:
        ConfigError: a value outside the ranges above, naming ``protocol.<key>``.
    """

    kind: "str | DelayKind" = DelayKind.uniform
    min_delay: int = 1
    max_delay: int = 4
    delays: Optional[tuple[int, ...]] = None
    slow_workers: tuple[int, ...] = ()
    slow_factor: int = 1
    byzantine: tuple[int, ...] = ()
    byzantine_delay: Optional[int] = None
    seed: int = 0

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", DelayKind(self.kind))
        except ValueError:
            raise ConfigError(f"protocol.delay must be one of {', '.join(k.value for k in DelayKind)}; "
                              f"got {self.kind!r}.") from None
        lo = _int_at_least(self.min_delay, 1, "min_delay")
        if _int_at_least(self.max_delay, 1, "max_delay") < lo:
            raise ConfigError(f"protocol.max_delay={self.max_delay} is below protocol.min_delay={lo}; "
                              "set max_delay >= min_delay.")
        if self.kind is DelayKind.fixed:
            if not self.delays:
                raise ConfigError("protocol.delay=fixed needs protocol.delays: one duration (ticks) per worker.")
            for i, d in enumerate(self.delays):
                _int_at_least(d, 1, f"delays[{i}]")
        _int_at_least(self.slow_factor, 1, "slow_factor")
        for w in self.slow_workers:
            _int_at_least(w, 0, "slow_workers[]")
        if self.byzantine_delay is not None:
            _int_at_least(self.byzantine_delay, 1, "byzantine_delay")

    def check(self, n: int) -> None:
        """Refuse a model that does not fit ``n`` workers.

        Raises:
            ConfigError: ``delays`` not of length ``n`` or a slow worker ``>= n``.
        """
        if self.kind is DelayKind.fixed and len(self.delays or ()) != n:
            raise ConfigError(f"protocol.delays has {len(self.delays or ())} entries for n={n} workers; give "
                              "one duration per worker.")
        bad = [w for w in self.slow_workers if w >= n]
        if bad:
            raise ConfigError(f"protocol.slow_workers {bad} are out of range for n={n} workers (ranks 0..{n - 1}).")

    def duration(self, w: int, j: int) -> int:
        """Ticks taken by worker ``w``'s job ``j`` (``>= 1``)."""
        if self.byzantine_delay is not None and w in self.byzantine:
            return int(self.byzantine_delay)
        if self.kind is DelayKind.fixed:
            assert self.delays is not None
            d = int(self.delays[w])
        else:
            span = self.max_delay - self.min_delay + 1
            d = self.min_delay + mix_seed(self.seed, _TAG, w, j) % span
        return d * self.slow_factor if w in self.slow_workers else d


@dataclass(frozen=True)
class Update:
    """One update of the schedule.

    Attributes:
        step: the update's id ``u`` (the parameters are version ``u`` until it is applied).
        time: the tick at which the server performs it.
        members: the workers whose rows the server receives at this update, ascending.
        staleness: ``{member: u - version its row was computed on}``.
        usable: the members whose rows enter the rule (all of them unless ``drop_above``).
        started: the workers whose job starts on version ``u``, ascending: their rows are computed
            in step ``u`` (the members of update ``u - 1``, every worker at ``u = 0``, and those
            restarted after a discard).
        discarded: workers whose rows arrived more than ``max_staleness`` stale before this
            update (rejected; they restarted at once), ascending.
    """

    step: int
    time: int
    members: tuple[int, ...]
    staleness: dict[int, int] = field(default_factory=dict)
    usable: tuple[int, ...] = ()
    started: tuple[int, ...] = ()
    discarded: tuple[int, ...] = ()


class StalenessSchedule:
    """The replicated state of the simulation (see the module docstring) and its next update.

    Args:
        n: workers (``>= 1``).
        max_staleness: ``tau >= 0``: rows more stale are never aggregated.
        min_arrivals: usable rows the server waits for, in ``[1, n]``.
        delays: the :class:`DelayModel`.
        drop_above: ``None`` or a staleness above which an arrived row is left out of the rule.

    Raises:
        ConfigError: a value out of range, naming ``protocol.<key>``.

    Example:
        >>> s = StalenessSchedule(3, max_staleness=1, min_arrivals=1,
        ...                       delays=DelayModel(kind="fixed", delays=(1, 2, 3)))
        >>> [(u.time, u.members, u.staleness, u.discarded) for u in (s.advance(), s.advance(), s.advance())]
        [(1, (0,), {0: 0}, ()), (2, (0, 1), {0: 0, 1: 1}, ()), (3, (0,), {0: 0}, (2,))]
    """

    def __init__(self, n: int, *, max_staleness: int, min_arrivals: int, delays: DelayModel,
                 drop_above: Optional[int] = None) -> None:
        self.n = _int_at_least(n, 1, "n (threat.n)")
        self.tau = _int_at_least(max_staleness, 0, "max_staleness")
        self.min_arrivals = _int_at_least(min_arrivals, 1, "min_arrivals")
        if self.min_arrivals > self.n:
            raise ConfigError(f"protocol.min_arrivals={min_arrivals} exceeds the n={n} workers; use a value in "
                              f"[1, {n}].")
        self.drop_above = None if drop_above is None else _int_at_least(drop_above, 0, "drop_threshold")
        delays.check(self.n)
        self.delays = delays
        self.now = 0
        self.version = [0] * self.n
        self.jobs = [0] * self.n
        self.arrive = [delays.duration(w, 0) for w in range(self.n)]
        self.updates = 0

    def advance(self) -> Update:
        """Simulate up to the next update, perform it, and return it (mutates the state)."""
        u = self.updates
        started = [w for w in range(self.n) if self.version[w] == u]
        arrived: list[int] = []
        discarded: list[int] = []
        usable = 0
        t = self.now
        horizon = self.now + 2 * self.n * max(self._longest(), 1) + 2  # every worker arrives twice by then
        while usable < self.min_arrivals:
            t += 1
            if t > horizon:  # pragma: no cover - the model guarantees progress; a bug otherwise
                raise RuntimeError(f"async schedule: no update {u} by tick {t}; state {self.state_dict()}")
            for w in range(self.n):
                if self.arrive[w] != t:
                    continue
                s = u - self.version[w]
                if s > self.tau:  # rejected on arrival: the worker restarts at once on version u
                    discarded.append(w)
                    self._start(w, t, u)
                    started.append(w)
                else:
                    arrived.append(w)
                    usable += int(self.drop_above is None or s <= self.drop_above)
        members = tuple(sorted(arrived))
        staleness = {w: u - self.version[w] for w in members}
        keep = tuple(w for w in members if self.drop_above is None or staleness[w] <= self.drop_above)
        for w in members:  # each starts its next job now, on the parameters after this update
            self._start(w, t, u + 1)
        self.now, self.updates = t, u + 1
        return Update(step=u, time=t, members=members, staleness=staleness, usable=keep,
                      started=tuple(sorted(started)), discarded=tuple(sorted(discarded)))

    def _start(self, w: int, t: int, version: int) -> None:
        self.jobs[w] += 1
        self.version[w] = version
        self.arrive[w] = t + self.delays.duration(w, self.jobs[w])

    def _longest(self) -> int:
        d = self.delays
        top = max(d.delays or (1,)) if d.kind is DelayKind.fixed else d.max_delay
        return max(top * d.slow_factor, d.byzantine_delay or 1)

    def state_dict(self) -> dict[str, Any]:
        """``{"now", "updates", "version", "jobs", "arrive"}`` (plain ints; replicated)."""
        return {"now": self.now, "updates": self.updates, "version": list(self.version), "jobs": list(self.jobs),
                "arrive": list(self.arrive)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            ConfigError: the state is for a different number of workers.
        """
        for key in ("version", "jobs", "arrive"):
            if len(state[key]) != self.n:
                raise ConfigError(f"the checkpointed async schedule is for {len(state[key])} workers, this run has "
                                  f"n={self.n}; protocol=async cannot change n (no elastic shrink).")
        self.now, self.updates = int(state["now"]), int(state["updates"])
        self.version = [int(v) for v in state["version"]]
        self.jobs = [int(v) for v in state["jobs"]]
        self.arrive = [int(v) for v in state["arrive"]]


def as_tuple(values: Optional[Sequence[Any]]) -> tuple[Any, ...]:
    """``None`` -> ``()``; a list (e.g. from Hydra) -> a tuple."""
    return () if values is None else tuple(values)
