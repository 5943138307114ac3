"""``protocol=async``: bounded-staleness asynchronous SGD, simulated exactly in virtual time.

See :class:`AsyncSGD` and :mod:`robustagg.protocols.schedule` (the delay model and the schedule).
"""

from __future__ import annotations

import enum
import warnings
from typing import TYPE_CHECKING, Any, ClassVar, Optional, Sequence

import torch

from ..errors import AssumptionError, AssumptionWarning, ConfigError
from .base import Protocol, RoundPlan, Trainer
from .schedule import DelayModel, StalenessSchedule, Update, _int_at_least, as_tuple

if TYPE_CHECKING:  # pragma: no cover
    from ..aggregators.base import Aggregator
    from ..distributed.reduction import Reduced, Transform

__all__ = ["AsyncSGD", "StalenessWeight", "polynomial_staleness"]


class StalenessWeight(str, enum.Enum):
    """What the server does with a row's staleness before the rule (``protocol.staleness_weight``).

    ``none``: nothing. ``inverse``: scale by :func:`polynomial_staleness`. ``drop_above``: leave
    out rows staler than ``protocol.drop_threshold``.
    """

    none = "none"
    inverse = "inverse"
    drop_above = "drop_above"


def polynomial_staleness(staleness: int, a: float) -> float:
    """``s(delta) = (delta + 1) ** (-a)``: the polynomial staleness function of Xie, Koyejo, Gupta,
    "Asynchronous Federated Optimization" (2019), section 5 (``s_a``).

    Args:
        staleness: ``delta >= 0`` (updates).
        a: the exponent ``a >= 0`` (0: no down-weighting).

    Returns:
        the weight in ``(0, 1]`` (1 for a fresh row).
    """
    return float((staleness + 1) ** (-float(a)))


def _refusal(rule: "Aggregator", m: int) -> str:
    """The rule's refusal of ``m`` rows (``""``: accepted), exactly as its call would decide it:
    a strict rule refuses a hard violation; an advisory one (the mean's ``f = 0``) or a rule with
    ``strict=False`` only warns."""
    saved = list(rule.last_violations)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", AssumptionWarning)
            rule.check(m)
        return ""
    except AssumptionError as exc:
        return str(exc)
    finally:
        rule.last_violations = saved


def _through_momentum(trainer: Trainer, w: int, g: torch.Tensor) -> torch.Tensor:
    """Worker ``w``'s momentum row for gradient ``g`` (as DSGD: ``m_0 = 0``, so the first is ``(1 - b) g``)."""
    m, b = trainer.momentum[w], trainer.worker_momentum
    return (1.0 - b) * g if m is None else b * m + (1.0 - b) * g


class AsyncSGD(Protocol):
    """Bounded-staleness asynchronous robust SGD on a seeded virtual clock.

    Worker ``w``'s ``j``-th job starts when the server hands it the current parameters: it computes
    its gradient on its next batch there (through its momentum when ``trainer.worker_momentum > 0``)
    and its row arrives :meth:`DelayModel.duration` ticks later. The server performs update ``u`` at
    the first tick where at least ``min_arrivals`` rows wait, aggregates every waiting row with the
    configured rule (never waits for more) and steps the ``optimizer``; each of those workers then
    starts its next job on the new parameters. A row computed on parameters ``delta`` updates old
    has staleness ``delta``; one with ``delta > max_staleness`` is rejected on arrival
    (``round/discarded``) and its worker restarts at once on the current parameters. The schedule
    is :class:`~robustagg.protocols.schedule.StalenessSchedule`: a pure function of the seed and its
    replicated state, the same on every process, so :meth:`plan` needs no collective; a worker's row
    in flight is its own (checkpointed) state.

    ``staleness_weight``:

    - ``none``: the rule sees the rows as computed.
    - ``inverse``: row ``i`` is multiplied by ``s(delta_i) = (delta_i + 1)^(-a)`` before the rule
      (:func:`polynomial_staleness`; Xie, Koyejo, Gupta 2019, "Asynchronous Federated Optimization",
      polynomial staleness function ``s_a``, ``a = staleness_a``). A stale row moves the model less,
      as FedAsync's mixing weight ``alpha * s(delta)`` does; the weights are not renormalised.
    - ``drop_above``: rows with ``delta > drop_threshold`` are received (their workers restart at the
      update) but left out of the rule and do not count towards ``min_arrivals`` (the server waits
      for usable ones). This is ``s(delta) = 1[delta <= b]``, the ``a -> infinity`` limit of the
      same paper's hinge function; unlike ``max_staleness`` it acts at the server after transfer.

    Guarantees: every aggregated row is at most ``max_staleness`` updates stale, and the staleness
    is the server's own record (which parameter version it handed out, and when the row arrived),
    never a worker's claim; every update's rows number at least ``min_arrivals`` and the rule's
    requirement is checked on the actual number. Gives up: the aggregate is a robust summary of
    stale gradients of a subset of workers, not of fresh gradients of all of them; its bias
    against the synchronous full-participation honest mean is measured (``agg/bias_vs_sync``).
    What a Byzantine worker controls: its row, and *when* it submits (``byzantine_delay``: e.g. 1,
    always the minimum, so its rows are always fresh, never discarded or down-weighted, and it
    takes part in more updates than an honest worker); it cannot claim a staleness.

    Assumption: the rule's requirement holds for every number of rows in ``[min_arrivals, n]``
    with its declared ``f`` (checked before launch by :meth:`check`); an update with more Byzantine
    rows than ``f`` is counted (``round/over_f``).

    Args:
        max_staleness: ``tau >= 0`` (updates). ``tau = 0`` with ``min_arrivals = n`` is
            :class:`~robustagg.protocols.DSGD` bit for bit.
        min_arrivals: rows the server waits for, in ``[1, n]``.
        staleness_weight: ``none`` | ``inverse`` | ``drop_above`` (above).
        staleness_a: the exponent ``a >= 0`` of ``inverse``.
        drop_threshold: the ``b >= 0`` of ``drop_above`` (required there).
        delay: ``uniform`` | ``fixed``: the kind of
            :class:`~robustagg.protocols.schedule.DelayModel` (all durations in ticks).
        min_delay: the smallest ``uniform`` duration (``>= 1``).
        max_delay: the largest ``uniform`` duration (``>= min_delay``).
        delays: ``fixed``: one duration per worker (``n`` entries).
        slow_workers: stragglers (worker ranks): their durations are ``slow_factor`` times longer.
        slow_factor: integer ``>= 1``.
        byzantine_delay: ``None`` or the duration of every Byzantine job (1: always first).

    Raises:
        ConfigError: a setting out of range, naming ``protocol.<key>`` (more in :meth:`check`).
    """

    name: ClassVar[str] = "async"
    gathers: ClassVar[bool] = True
    #: the schedule is over a fixed n: no elastic shrink (refused before launch).
    shrinkable: ClassVar[bool] = False
    batched: ClassVar[Optional[str]] = "self"  # the jobs starting on the same parameters, batched in plan

    def __init__(self, *, max_staleness: int = 4, min_arrivals: int = 1,
                 staleness_weight: "str | StalenessWeight" = "none",
                 staleness_a: float = 0.5, drop_threshold: Optional[int] = None, delay: str = "uniform",
                 min_delay: int = 1, max_delay: int = 4, delays: Optional[Sequence[int]] = None,
                 slow_workers: Optional[Sequence[int]] = None, slow_factor: int = 1,
                 byzantine_delay: Optional[int] = None) -> None:
        try:
            weighting = StalenessWeight(staleness_weight)
        except ValueError:
            allowed = ", ".join(w.value for w in StalenessWeight)
            raise ConfigError(f"protocol.staleness_weight must be one of {allowed}; got {staleness_weight!r}.") from None
        staleness_weight = weighting.value
        if isinstance(staleness_a, bool) or not isinstance(staleness_a, (int, float)) or not staleness_a >= 0:
            raise ConfigError(f"protocol.staleness_a must be a number >= 0; got {staleness_a!r}.")
        drops = weighting is StalenessWeight.drop_above
        if drops and drop_threshold is None:
            raise ConfigError("protocol.staleness_weight=drop_above needs protocol.drop_threshold (an integer >= 0).")
        if not drops and drop_threshold is not None:
            raise ConfigError(f"protocol.drop_threshold={drop_threshold} has no effect with "
                              f"protocol.staleness_weight={staleness_weight}; set staleness_weight=drop_above or "
                              "drop_threshold=null.")
        if delay != "fixed" and delays:
            raise ConfigError(f"protocol.delays is read by protocol.delay=fixed only (got delay={delay!r}); set "
                              "delay=fixed or delays=null.")
        self.settings = {"max_staleness": max_staleness, "min_arrivals": min_arrivals,
                         "staleness_weight": staleness_weight, "staleness_a": float(staleness_a),
                         "drop_threshold": drop_threshold, "delay": delay, "min_delay": min_delay,
                         "max_delay": max_delay, "byzantine_delay": byzantine_delay, "slow_factor": slow_factor}
        self.weighting = weighting
        self.a = float(staleness_a)
        self._delay_args: dict[str, Any] = {"kind": delay, "min_delay": min_delay, "max_delay": max_delay,
                                            "delays": as_tuple(delays) or None, "slow_workers": as_tuple(slow_workers),
                                            "slow_factor": slow_factor, "byzantine_delay": byzantine_delay}
        self._schedule_args: dict[str, Any] = {
            "max_staleness": max_staleness, "min_arrivals": min_arrivals,
            "drop_above": drop_threshold if drops else None}
        # every value checked now; the n-dependent ones in check (before launch) and bind
        self._delays(())
        _int_at_least(max_staleness, 0, "max_staleness")
        _int_at_least(min_arrivals, 1, "min_arrivals")
        if drops:
            _int_at_least(drop_threshold, 0, "drop_threshold")
        self.schedule: Optional[StalenessSchedule] = None
        #: hosted worker -> (row in flight, its batch loss): computed when its job started.
        self.pending: dict[int, tuple[torch.Tensor, float]] = {}
        #: hosted worker -> the row its job started at this step computed (for the bias reference).
        self._fresh: dict[int, torch.Tensor] = {}
        self._rule_f = 0
        self._byzantine: tuple[int, ...] = ()

    def _delays(self, byzantine: tuple[int, ...], seed: int = 0) -> DelayModel:
        return DelayModel(byzantine=byzantine, seed=seed, **self._delay_args)

    # --- before launch and binding -------------------------------------------------------------
    def check(self, *, n: int, rule: "Aggregator") -> None:
        """Refuse, before any process starts, a setting that cannot run with ``n`` workers and ``rule``.

        Raises:
            ConfigError: ``min_arrivals`` outside ``[1, n]``, ``delays`` not of length ``n``, a slow
                worker out of range, or a number of rows in ``[min_arrivals, n]`` that the rule
                refuses (a hard requirement under ``strict``; the message names the smallest
                valid ``protocol.min_arrivals``).
        """
        StalenessSchedule(n, delays=self._delays(()), **self._schedule_args)
        m0 = int(self._schedule_args["min_arrivals"])
        refusals = {m: _refusal(rule, m) for m in range(1, n + 1)}
        bad = [m for m in range(m0, n + 1) if refusals[m]]
        if bad:
            ok = [m for m in range(1, n + 1) if not any(refusals[k] for k in range(m, n + 1))]
            fix = f"protocol.min_arrivals>={ok[0]}" if ok else f"a rule whose requirement holds for {m0}..{n} rows"
            raise ConfigError(f"protocol.min_arrivals={m0}: an update may aggregate as few as {m0} rows, and the "
                              f"rule {rule.name} (f={rule.f}) refuses {bad[0]} rows: {refusals[bad[0]]} "
                              f"Use {fix}.")

    def bind(self, trainer: Trainer) -> None:
        """Build the schedule for the trainer's ``n``, seed and Byzantine workers (fresh state).

        Raises:
            ConfigError: as :meth:`check`, for the trainer's ``n`` and rule.
        """
        self.check(n=trainer.comm.world_size, rule=trainer.reduction.rule)
        byz = trainer.byzantine
        ranks = tuple(int(r) for r in byz.ranks) if byz is not None else ()
        self._byzantine = ranks
        self.schedule = StalenessSchedule(trainer.comm.world_size, delays=self._delays(ranks, trainer.seed),
                                          **self._schedule_args)
        self._rule_f = int(getattr(trainer.reduction.rule, "f", 0))
        self.pending.clear()

    # --- the step ------------------------------------------------------------------------------
    def plan(self, trainer: Trainer, step: int) -> RoundPlan:
        """Advance the schedule to update ``step``; start the jobs that begin on these parameters.

        Every hosted worker whose job starts on the current parameters computes its row now
        (:meth:`Trainer.worker_gradient <robustagg.training.Trainer.worker_gradient>`, then its
        momentum) and holds it until it arrives.

        Raises:
            ConfigError: the schedule is at another update than the trainer (a state mismatch).
        """
        sched = self.schedule
        assert sched is not None, "AsyncSGD.plan before bind"
        if sched.updates != step:
            raise ConfigError(f"protocol=async: the schedule is at update {sched.updates}, the trainer at step "
                              f"{step}; restore both from the same checkpoint.")
        up = sched.advance()
        hosted = set(trainer.comm.local_ranks)
        self._fresh = {}
        starting = [w for w in up.started if w in hosted]
        if starting:
            trainer.model.train()
            trainer.prefetch_gradients(starting, step)  # one vmap with trainer.batched_gradients, else nothing
        for w in starting:
            self.pending[w] = self._start_job(trainer, w, step)
        n = trainer.comm.world_size
        return RoundPlan(step=step, members=up.members, full=len(up.members) == n,
                         staleness=dict(up.staleness), info=self._info(trainer, up))

    def _start_job(self, trainer: Trainer, w: int, step: int) -> tuple[torch.Tensor, float]:
        g, loss = trainer.worker_gradient(w, step)
        if trainer.worker_momentum > 0:
            g = _through_momentum(trainer, w, g)
            trainer.momentum[w] = g
        if trainer.measure_bias:
            self._fresh[w] = g
        return g, loss

    def _info(self, trainer: Trainer, up: Update) -> dict[str, Any]:
        byz = trainer.byzantine
        active = byz is not None and byz.active(up.step)
        used = up.usable
        stale = [up.staleness[w] for w in used]
        n_byz = sum(1 for w in used if active and w in self._byzantine)
        info: dict[str, Any] = {
            "round/participants": len(used), "round/byzantine": n_byz, "round/over_f": int(n_byz > self._rule_f),
            "round/staleness_mean": sum(stale) / len(stale), "round/staleness_max": max(stale),
            "round/discarded": len(up.discarded) + len(up.members) - len(used), "round/virtual_time": up.time}
        info.update({f"round/staleness/{w}": up.staleness[w] for w in used})
        tau = int(self._schedule_args["max_staleness"])
        for s in range(tau + 1):
            info[f"round/staleness_hist/{s}"] = stale.count(s)
        return info

    def submit(self, trainer: Trainer, rank: int, plan: RoundPlan) -> tuple[torch.Tensor, float]:
        """The row member ``rank`` computed when its job started (``plan.staleness[rank]`` updates ago).

        Raises:
            ConfigError: the worker holds no row (its state was not restored).
        """
        try:
            return self.pending.pop(rank)
        except KeyError:
            raise ConfigError(f"protocol=async: worker {rank} arrives at update {plan.step} but holds no row; "
                              "its protocol state was not restored.") from None

    def transform(self, plan: RoundPlan) -> Optional["Transform"]:
        """``inverse``: scale each row by :func:`polynomial_staleness`; ``drop_above``: drop the rows
        staler than ``drop_threshold``; ``none``: ``None``."""
        stale = dict(plan.staleness)
        if self.weighting is StalenessWeight.inverse:
            a = self.a

            def weigh(x: torch.Tensor, ranks: list[int], sums: list[int]) -> tuple[torch.Tensor, list[int]]:
                w = torch.tensor([polynomial_staleness(stale[r], a) for r in ranks], dtype=x.dtype, device=x.device)
                return x * w[:, None], list(ranks)

            return weigh
        if self.weighting is StalenessWeight.drop_above:
            b = int(self._schedule_args["drop_above"])

            def drop(x: torch.Tensor, ranks: list[int], sums: list[int]) -> tuple[torch.Tensor, list[int]]:
                keep = [i for i, r in enumerate(ranks) if stale[r] <= b]
                return x[keep], [ranks[i] for i in keep]

            return drop
        return None

    def apply(self, trainer: Trainer, aggregate: torch.Tensor, plan: RoundPlan) -> None:
        """One optimizer (and scheduler) step with the aggregate as gradient."""
        trainer.apply(aggregate)

    def reference(self, trainer: Trainer, plan: RoundPlan, reduced: "Reduced",
                  byzantine: tuple[int, ...]) -> Optional[torch.Tensor]:
        """The mean ``(d,)`` float64 of every honest worker's fresh gradient at the current parameters
        (``None`` unless this process hosts every worker, i.e. simulated mode).

        "Fresh" is the row the worker would submit if its job started now: a worker whose job did
        start on these parameters contributes that row; any other honest worker's gradient is
        computed on the batch it would draw next (through its momentum buffer, which is left
        as it is), with its data position, its RNG stream and the process's RNG restored
        afterwards, so measuring does not change the run. This is :class:`~robustagg.protocols.DSGD`'s
        reference when every update is synchronous; the bias against it measures staleness and
        partial participation.
        """
        n = trainer.comm.world_size
        if sorted(trainer.comm.local_ranks) != list(range(n)):
            return None
        honest = [w for w in range(n) if w not in self._byzantine]
        if not honest:
            return None
        saved = torch.get_rng_state()
        rows = []
        for w in honest:
            g = self._fresh.get(w)
            if g is None:
                pos, rng = trainer.samplers[w].state_dict(), trainer.worker_rng[w].clone()
                g, _ = trainer.worker_gradient(w, plan.step)
                trainer.samplers[w].load_state_dict(pos)
                trainer.worker_rng[w] = rng
                if trainer.worker_momentum > 0:  # what it would submit now (its buffer untouched)
                    g = _through_momentum(trainer, w, g)
            rows.append(g.to(torch.float64))
        torch.set_rng_state(saved)
        return torch.stack(rows).mean(dim=0)

    # --- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"schedule": ...}``: the replicated virtual-time schedule."""
        return {} if self.schedule is None else {"schedule": self.schedule.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (``{}``: keep the fresh schedule)."""
        if state and self.schedule is not None:
            self.schedule.load_state_dict(state["schedule"])

    def worker_state(self, rank: int) -> dict[str, Any]:
        """``{"row", "loss"}`` of hosted worker ``rank``'s row in flight (``{}``: none)."""
        if rank not in self.pending:
            return {}
        row, loss = self.pending[rank]
        return {"row": row.clone(), "loss": float(loss)}

    def load_worker_state(self, rank: int, state: dict[str, Any]) -> None:
        """Restore :meth:`worker_state` output."""
        self.pending.pop(rank, None)
        if state:
            self.pending[rank] = (state["row"].clone(), float(state["loss"]))

    def describe(self) -> dict[str, Any]:
        """``protocol`` and every setting as ``protocol.<key>``."""
        out: dict[str, Any] = {"protocol": self.name}
        out.update({f"protocol.{k}": v for k, v in self.settings.items()})
        return out
