"""``protocol=dsgd``: synchronous data-parallel SGD, every worker, one fresh gradient per update."""

from __future__ import annotations

from typing import ClassVar, Optional

import torch

from .base import Protocol, RoundPlan, Trainer

__all__ = ["DSGD"]


class DSGD(Protocol):
    """Synchronous robust data-parallel SGD (the trainer's protocol before protocols existed).

    Per update every one of the n workers computes the gradient of its loss on one batch of its
    shard at the current parameters (with worker momentum ``m <- beta m + (1 - beta) g`` when the
    trainer has it; Karimireddy, He, Jaggi, ICML 2021), the rule aggregates the n rows, and the
    trainer's optimizer steps with the aggregate as gradient.

    Guarantees: every honest row is fresh (staleness 0) and every worker takes part, so the rule's
    requirement at ``(n, f)`` holds at every update when it holds for the run. Gives up: an update
    waits for the slowest worker (a straggler stalls everyone; a crash stops the group).

    Assumption: the rule's requirement at the run's ``(n, f)``.
    """

    name: ClassVar[str] = "dsgd"
    gathers: ClassVar[bool] = False
    batched: ClassVar[Optional[str]] = "members"

    def plan(self, trainer: Trainer, step: int) -> RoundPlan:
        """Every worker, fresh."""
        return RoundPlan(step=step, members=tuple(range(trainer.comm.world_size)), full=True)

    def submit(self, trainer: Trainer, rank: int, plan: RoundPlan) -> tuple[torch.Tensor, float]:
        """One gradient at the current parameters, through the worker's momentum."""
        g, loss = trainer.worker_gradient(rank, plan.step)
        if trainer.worker_momentum > 0:
            m = trainer.momentum[rank]
            b = trainer.worker_momentum  # m_0 = 0, so the first step submits (1 - b) g
            g = (1.0 - b) * g if m is None else b * m + (1.0 - b) * g
            trainer.momentum[rank] = g
        return g, loss

    def apply(self, trainer: Trainer, aggregate: torch.Tensor, plan: RoundPlan) -> None:
        """The aggregate is the gradient of one optimizer (and scheduler) step."""
        trainer.apply(aggregate)
