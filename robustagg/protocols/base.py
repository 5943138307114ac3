"""The protocol seam: per update, who submits, what each submits, and how the server applies the aggregate.

A :class:`Protocol` is the part of a training step that differs between synchronous data-parallel
SGD, rounds of local training with client sampling, bounded-staleness asynchrony and replicated
computation. The :class:`~robustagg.training.Trainer` runs the same step for all of them::

    plan    <- protocol.plan(trainer, step)           # identical on every process (seeded)
    for every hosted member r of plan.members:
        row_r <- protocol.submit(trainer, r, plan)    # honest computation (faults, poisons applied)
    headers, attack, reduction over plan.members      # integrity, protocol.transform, the rule
    protocol.apply(trainer, aggregate, plan)          # the server's update

What a protocol guarantees and what it gives up is stated on each class and in
``docs/protocols.md``. A protocol's state is split like the trainer's: ``replicated`` (the same on
every process: a schedule, the round counter) and per worker id (client optimizer state, a
pending submission), which travels with the worker's checkpointed state.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Optional

import torch

if TYPE_CHECKING:  # pragma: no cover
    from ..distributed.reduction import Reduced, Transform

__all__ = ["RoundPlan", "Protocol", "Trainer"]

#: A :class:`robustagg.training.Trainer` (not imported here: the trainer imports the protocols).
Trainer = Any


@dataclass(frozen=True)
class RoundPlan:
    """Who takes part in one update (the same on every process).

    Attributes:
        step: the update's id (0-based; the trainer's step counter).
        members: the worker ranks whose submissions enter this update, ascending.
        full: True when every worker submits (the reduction gathers without a member list).
        staleness: ``{rank: updates}``: how many updates old the parameters each member's
            submission was computed on (0: fresh).
        info: per-update numbers the protocol reports (merged into the step record, e.g.
            ``round/participants``).
    """

    step: int
    members: tuple[int, ...]
    full: bool = True
    staleness: dict[int, int] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


class Protocol(abc.ABC):
    """Base class of the training protocols (``protocol=<name>`` in the apps).

    Subclasses implement :meth:`plan`, :meth:`submit` and :meth:`apply`; the rest has defaults
    that suit a protocol where every member submits one row that the rule aggregates directly.

    Attributes:
        name: the protocol's name (its config group entry).
        gathers: True when the reduction must hold every member's full row (``mode="gather"``):
            partial participation, a transform, or a protocol-side reference.
    """

    name: ClassVar[str] = ""
    gathers: ClassVar[bool] = True
    #: False when an elastic shrink cannot continue the protocol's state (refused before launch).
    shrinkable: ClassVar[bool] = True
    #: How ``trainer.batched_gradients`` (:mod:`~robustagg.training.batched`) serves the protocol:
    #: ``"members"``: the trainer batches every hosted member's gradient of the update before
    #: :meth:`submit` (which gets it from ``Trainer.worker_gradient``); ``"self"``: the protocol
    #: calls ``Trainer.prefetch_gradients`` for the gradients it computes; ``None``: refused.
    batched: ClassVar[Optional[str]] = None
    #: True for a protocol without a server aggregate (``protocol=gossip``): after the exchange the
    #: trainer hands every member's row to :meth:`mix` instead of the reduction and :meth:`apply`.
    mixes: ClassVar[bool] = False

    def bind(self, trainer: Trainer) -> None:
        """Called once by the trainer it serves (size client state, check the setting).

        Raises:
            ConfigError: the protocol cannot run with this trainer (e.g. a missing optimizer).
        """

    def check(self, *, n: int, rule: Any) -> None:
        """Called before any process starts (``experiments.wiring.validate``): refuse a setting
        that cannot run with ``n`` workers and the configured ``rule`` (an
        :class:`~robustagg.aggregators.base.Aggregator`). The default accepts every setting.

        Raises:
            ConfigError: naming ``protocol.<key>`` and the fix.
        """

    @abc.abstractmethod
    def plan(self, trainer: Trainer, step: int) -> RoundPlan:
        """The members of update ``step`` (deterministic in the run's seed and the state; every
        process computes the same plan without a collective)."""

    @abc.abstractmethod
    def submit(self, trainer: Trainer, rank: int, plan: RoundPlan) -> tuple[torch.Tensor, float]:
        """Hosted member ``rank``'s honest submission for ``plan``: a ``(d,)`` row and its training loss.

        Byzantine members compute it too (data poisons apply inside, see
        :meth:`Trainer.worker_gradient <robustagg.training.Trainer.worker_gradient>`); a gradient
        attack replaces the row afterwards.
        """

    def mix(self, trainer: Trainer, rows: torch.Tensor, plan: RoundPlan,
            byzantine: tuple[int, ...]) -> dict[str, float]:
        """A mixing protocol's update from every member's row ``rows`` ``(len(members), d)`` (all-gathered
        and integrity-checked, members' order); returns its per-step metrics. Only called when
        :attr:`mixes` is true.

        Raises:
            NotImplementedError: the protocol does not mix.
        """
        raise NotImplementedError(f"protocol {self.name} has a server aggregate; it does not mix.")

    def transform(self, plan: RoundPlan) -> Optional["Transform"]:
        """The server-side step between integrity checks and the rule (``None``: the rule sees the
        kept rows as they are). See :class:`~robustagg.distributed.Reduction`."""
        return None

    @abc.abstractmethod
    def apply(self, trainer: Trainer, aggregate: torch.Tensor, plan: RoundPlan) -> None:
        """The server's update with the robust ``aggregate`` ``(d,)`` (every process applies it)."""

    def honest_inputs(self, reduced: "Reduced", byzantine: tuple[int, ...]) -> list[bool]:
        """For every row the rule received (``reduced.inputs``): True when it is an honest one."""
        return [lab not in byzantine for lab in reduced.inputs]

    def reference(self, trainer: Trainer, plan: RoundPlan, reduced: "Reduced",
                  byzantine: tuple[int, ...]) -> Optional[torch.Tensor]:
        """The synchronous full-participation honest mean of this update on the same parameters
        ``(d,)``, or ``None`` when this process cannot evaluate it (``agg/bias_vs_sync``).

        The default is the mean of the honest members' rows (exact when every worker is a member
        and submits a fresh row).
        """
        x = reduced.matrix
        if x is None or not plan.full:
            return None
        honest = [reduced.row_of(r) for r in reduced.members if r not in byzantine]
        if not honest:
            return None
        return x[honest].to(torch.float64).mean(dim=0)

    def detections(self, plan: RoundPlan) -> list[dict[str, Any]]:
        """Detection records of this update (``{"kind", "step", ...}``; the main process writes them to
        ``detections.jsonl``), called once after the reduction. Default: none."""
        return []

    def state_dict(self) -> dict[str, Any]:
        """The replicated state (the same on every process; ``{}`` when stateless)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""

    def worker_state(self, rank: int) -> dict[str, Any]:
        """Hosted worker ``rank``'s own state (checkpointed under its worker id; ``{}``: none)."""
        return {}

    def load_worker_state(self, rank: int, state: dict[str, Any]) -> None:
        """Restore :meth:`worker_state` output for hosted worker ``rank``."""

    def describe(self) -> dict[str, Any]:
        """The protocol's settings for the summary (``protocol`` plus its parameters)."""
        return {"protocol": self.name}
