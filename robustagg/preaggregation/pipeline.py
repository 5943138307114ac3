"""Composition of pre-aggregation maps with a final rule."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..aggregators.base import Aggregator
from ..errors import ConfigError
from ..requirements import Requirement, enforce
from .base import PreAggregator

__all__ = ["Pipeline"]


class Pipeline(Aggregator):
    r"""A rule applied after pre-aggregation maps: ``rule(pre_k(...pre_1(X)))``.

    Requirement: every stage's own, each checked on the number of rows **that stage sees** with its
    own ``f`` (e.g. Bucketing(s) then Krum checks ``ceil(n/s) >= 2f + 3``).

    Args:
        pre: pre-aggregation maps, applied in order.
        rule: the final :class:`~robustagg.Aggregator`.

    Shape: ``(n, d) -> (d,)``.

    Raises:
        AssumptionError: any stage's requirement fails (all violations listed) and ``rule.strict``.
        ShapeError, NonFiniteInputError: see :class:`Aggregator`.
        ConfigError: ``pre`` holds something that is not a :class:`PreAggregator`, or ``rule`` is
            not an :class:`Aggregator`.

    Example:
        >>> import torch, robustagg as ra
        >>> x = torch.tensor([[0.0], [1.0], [3.0], [10.0], [2.0]])
        >>> ra.Pipeline(pre=[ra.NNM(f=1)], rule=ra.CoordinateWiseTrimmedMean(f=1))(x)
        tensor([1.5000])
    """

    display_name = "Pipeline"

    def __init__(self, *, pre: Sequence[PreAggregator], rule: Aggregator) -> None:
        if not isinstance(rule, Aggregator):
            raise ConfigError(f"Pipeline: rule must be a robustagg Aggregator; got {rule!r}.")
        bad = [p for p in pre if not isinstance(p, PreAggregator)]
        if bad:
            raise ConfigError(f"Pipeline: pre must hold pre-aggregation maps (nnm, bucketing, clipping, arc); "
                              f"got {bad!r}.")
        super().__init__(f=rule.f, strict=rule.strict)
        self.pre = list(pre)
        self.rule = rule
        self.translation_equivariant = rule.translation_equivariant and all(  # type: ignore[misc]
            p.name in ("nnm", "bucketing") for p in self.pre)  # bucket means move with the rows
        # a random permutation of the rows (Bucketing) depends on their order
        self.permutation_invariant = rule.permutation_invariant and all(  # type: ignore[misc]
            p.name != "bucketing" for p in self.pre)
        self.coordinatewise = False  # type: ignore[misc]
        # NNM first: its Gram pass sees every input row, as the distance-based rules' does
        self.gram_checks_finite = (self.pre[0].name == "nnm") if self.pre else rule.gram_checks_finite  # type: ignore[misc]
        self.name = ">".join([p.name for p in self.pre] + [rule.name])  # type: ignore[misc]

    def stages(self, n: int) -> list[tuple[Requirement, int, int]]:
        """``(requirement, rows seen, f)`` for every stage with a requirement, given ``n`` inputs."""
        out = []
        for p in self.pre:
            if p.requirement is not None:
                out.append((p.requirement, n, p.f))
            n = p.output_rows(n)
        out.append((self.rule.requirement, n, self.rule.f))
        return out

    @property
    def requirement(self) -> Requirement:
        """Every stage's requirement; the kappa bound where the literature composes one.

        ``NNM(f)`` then a rule with ``kappa_F``: ``kappa <= (8f/(n-f)) (kappa_F + 1)`` (Allouah et al.,
        AISTATS 2023, Thm. 1). Other compositions carry no kappa bound (``kappa_bound`` is nan).
        """
        parts = [f"{r.rule}: {r.inequality}" for r, _, _ in self.stages(0)]
        inner = self.rule.requirement.kappa
        kappa: Callable[[int, int], float] | None = None
        formula = None
        if inner is not None and len(self.pre) == 1 and self.pre[0].name == "nnm" and self.pre[0].f == self.rule.f:
            kappa_f: Callable[[int, int], float] = inner
            kappa = lambda n, f: (8 * f / (n - f)) * (kappa_f(n, f) + 1)  # noqa: E731
            formula = f"(8f/(n-f))(kappa_F + 1), kappa_F = {self.rule.requirement.kappa_formula}"
        return Requirement(" then ".join(p.display_name for p in self.pre + [self.rule]),  # type: ignore[operator]
                           "; ".join(parts), lambda n, f: not [1 for r, m, g in self.stages(n) if not r.holds(m, g)],
                           "Allouah et al., AISTATS 2023" if kappa is not None else "", kappa=kappa,
                           kappa_formula=formula)

    def violations(self, n: int) -> list[str]:
        return [msg for r, m, g in self.stages(n) for msg in r.check(m, g)]

    def check(self, n: int) -> list[str]:
        self.last_violations = enforce(self.stages(n), strict=self.strict)
        return self.last_violations

    def _aggregate(self, x: torch.Tensor) -> torch.Tensor:
        for p in self.pre:
            x = p.apply(x)
        return self.rule._aggregate(x)

    def _weights(self, x: torch.Tensor) -> torch.Tensor:
        # Shares of the rule over the mapped rows, carried back through each map's mixing matrix.
        mix = torch.eye(x.shape[0], dtype=torch.float64, device=x.device)
        for p in self.pre:
            m = p.mixing(x)
            x = m.to(x.dtype) @ x
            mix = m @ mix
        return self.rule._weights(x) @ mix

    def state_dict(self) -> dict[str, Any]:
        """States of every stage: ``{"rule": name, "stages": [...]}``."""
        return {"rule": self.name, "stages": [s.state_dict() for s in self.pre + [self.rule]]}  # type: ignore[operator]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        for stage, st in zip(self.pre + [self.rule], state["stages"]):  # type: ignore[operator]
            stage.load_state_dict(st)

    def reset(self) -> None:
        self.rule.reset()

    def __repr__(self) -> str:
        return f"Pipeline(pre={self.pre!r}, rule={self.rule!r})"
