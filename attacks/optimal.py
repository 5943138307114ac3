"""Optimal ALIE and optimal IPM: the attack's scale chosen by a line search against the defender's rule.

The "optimal" variants keep the attack's family of rows (ALIE: ``x̄_H - z sigma_H``; IPM:
``-epsilon x̄_H``) and choose the scalar (``z`` or ``epsilon``) that maximises the distance of the
defender's actual aggregate (rule and pre-aggregation pipeline, the ``rule=`` object) from the
honest mean, with the deterministic search of :func:`attacks.shejwalkar.line_search`.

Relation to :class:`~attacks.AGRTailored`:

- ``opt_alie`` **is** ``agr_tailored`` with ``direction="std"``: its rows ``x̄_H + lam * (-sigma_H)``
  are ALIE's rows with ``z = lam``, and the search, grid and default bound are the same, so both
  return the same bits (a test checks it). It is registered under its own name so that a sweep can
  name it; :attr:`OptALIE.last_z` is ``last_lambda``.
- ``opt_ipm`` is **not** an alias: its rows ``-epsilon x̄_H`` lie on ``agr_tailored``'s
  ``direction="unit"`` ray at ``lam = (1 + epsilon) ||x̄_H||``, but ``agr_tailored`` also searches
  ``lam < ||x̄_H||`` (rows between the honest mean and zero, which IPM never sends) and puts its grid
  points elsewhere, so the two searches pick different rows in general.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from robustagg.errors import ConfigError

from ._stats import mean64, norm64
from .base import Attack, Knowledge, positive_float
from .registry import register
from .shejwalkar import AGRTailored, line_search, rule_objective

__all__ = ["OptALIE", "OptIPM"]


def _search_args(name: str, grid: object, refine: object, tol: object) -> tuple[int, int, float]:
    for arg, v, lo in (("grid", grid, 1), ("refine", refine, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ConfigError(f"{name}: {arg} must be an integer >= {lo}; got {v!r}.")
    assert isinstance(grid, int) and isinstance(refine, int)
    return grid, refine, positive_float(tol, "tol", name)


@register("opt_alie")
class OptALIE(AGRTailored):
    r"""Optimal ALIE: ALIE's rows ``x̄_H - z sigma_H`` with ``z`` searched against the defender's rule.

    Definition: ``b(z) = x̄_H - z * sigma_H`` (all ``f`` rows equal; ``sigma_H`` the coordinate-wise
    standard deviation, ddof = 1), with ``z >= 0`` maximising
    ``J(z) = ||rule(cat(honest, b(z), ...)) - x̄_H||`` (float64). This is exactly
    :class:`~attacks.AGRTailored` with ``direction="std"`` (``lam = z``): same rows, same search.

    Search (:func:`~attacks.shejwalkar.line_search`): ``J`` at ``z = 0`` and at
    ``z_max * 2^-k``, ``k = grid - 1 .. 0``, then step halving around the best point until the step
    is below ``tol * z`` or ``refine`` rounds have run; ties keep the smaller ``z``. ``z_max``
    defaults to ``1024 * max(max_i ||x_i - x̄_H||, ||x̄_H||) / ||sigma_H||``. At most
    ``1 + grid + 2 * refine`` rule calls. A zero spread (``sigma_H = 0``) gives ``z = 0`` and
    ``b = x̄_H``. The chosen ``z`` and ``J`` are kept in :attr:`last_z` and ``last_objective``.

    Knowledge: ``honest+rule`` (omniscient and rule-aware, as ``agr_tailored``).

    Args:
        z_max: largest ``z`` searched (positive); ``None`` = automatic (above).
        grid: number of geometric grid points ``>= 1``, default 40.
        refine: maximum refinement rounds ``>= 0``, default 30.
        tol: relative step at which refinement stops, default 1e-5.

    Shape: ``honest (h, d) -> (f, d)``.

    Raises:
        ConfigError: ``rule`` missing; a parameter out of range.
        AssumptionError: from the rule itself (a strict rule whose requirement fails).
        ShapeError, NonFiniteInputError: see :class:`~attacks.Attack`.

    Note:
        The paper's z (:func:`~attacks.alie_z`) is one point of this family; the search replaces
        it by the z that hurts this rule most, as in the "optimised" ALIE of Allouah et al.
        (AISTATS 2023) and ByzFL's line search over the factor.

    Example:
        >>> import torch, attacks, robustagg as ra
        >>> honest = torch.tensor([[0.0], [2.0]])  # mean 1, sigma = sqrt(2)
        >>> a = attacks.OptALIE(z_max=4.0, grid=3, refine=0)
        >>> out = a(honest, 1, rule=ra.Mean())  # the mean is unbounded in z: z_max wins
        >>> a.last_z, round(float(out), 4)      # 1 - 4 * sqrt(2)
        (4.0, -4.6569)

    References:
        Baruch, Baruch, Goldberg, "A little is enough", NeurIPS 2019 (the family);
        Allouah, Farhadkhani, Guerraoui, Gupta, Pinot, Stephan, "Fixing by mixing", AISTATS 2023
        (the factor chosen by search against the aggregate).
    """

    knowledge = Knowledge.HONEST_RULE
    paper = "Baruch et al., NeurIPS 2019; Allouah et al., AISTATS 2023"

    def __init__(self, *, z_max: Optional[float] = None, grid: int = 40, refine: int = 30, tol: float = 1e-5) -> None:
        z = None if z_max is None else positive_float(z_max, "z_max", "OptALIE")
        g, r, t = _search_args("OptALIE", grid, refine, tol)
        super().__init__(direction="std", lambda_max=z, grid=g, refine=r, tol=t)

    @property
    def last_z(self) -> Optional[float]:
        """The ``z`` chosen by the last call (``None`` before the first)."""
        return self.last_lambda

    def _params(self) -> dict[str, Any]:
        return {"z_max": self.lambda_max, "grid": self.grid, "refine": self.refine, "tol": self.tol}


@register("opt_ipm")
class OptIPM(Attack):
    r"""Optimal IPM: IPM's rows ``-epsilon x̄_H`` with ``epsilon`` searched against the defender's rule.

    Definition: ``b(eps) = -eps * x̄_H`` (all ``f`` rows equal, cast to the honest dtype) with
    ``eps >= 0`` maximising ``J(eps) = ||rule(cat(honest, b(eps), ...)) - x̄_H||`` (float64); rows
    are stacked honest first, then the ``f`` Byzantine rows.

    Search (:func:`~attacks.shejwalkar.line_search`): ``J`` at ``eps = 0`` and at
    ``eps_max * 2^-k``, ``k = grid - 1 .. 0``, then step halving around the best point until the
    step is below ``tol * eps`` or ``refine`` rounds have run; ties keep the smaller ``eps``.
    ``eps_max`` defaults to ``1024 * max(1, max_i ||x_i - x̄_H|| / ||x̄_H||)``. At most
    ``1 + grid + 2 * refine`` rule calls; a stateful rule's state is restored after each. A zero
    honest mean makes every ``b(eps)`` zero: ``eps = 0``. The chosen ``eps`` and ``J`` are kept in
    :attr:`last_epsilon` and :attr:`last_objective`.

    Knowledge: ``honest+rule`` (omniscient and rule-aware).

    Args:
        epsilon_max: largest ``eps`` searched (positive); ``None`` = automatic (above).
        grid: number of geometric grid points ``>= 1``, default 40.
        refine: maximum refinement rounds ``>= 0``, default 30.
        tol: relative step at which refinement stops, default 1e-5.

    Shape: ``honest (h, d) -> (f, d)``.

    Raises:
        ConfigError: ``rule`` missing; a parameter out of range.
        AssumptionError: from the rule itself.
        ShapeError, NonFiniteInputError: see :class:`~attacks.Attack`.

    Note:
        Not an alias of :class:`~attacks.AGRTailored` (see the module docstring): its rows stay in
        IPM's family ``-eps x̄_H``, ``eps >= 0``.

    Example:
        >>> import torch, attacks, robustagg as ra
        >>> honest = torch.tensor([[1.0], [3.0]])   # mean 2
        >>> a = attacks.OptIPM(epsilon_max=4.0, grid=3, refine=0)
        >>> a(honest, 1, rule=ra.Mean()), a.last_epsilon   # the mean rule: eps_max wins, -4 * 2
        (tensor([[-8.]]), 4.0)

    References:
        Xie, Koyejo, Gupta, "Fall of empires", UAI 2019 (the family); Allouah et al., "Fixing by
        mixing", AISTATS 2023 (the factor chosen by search against the aggregate).
    """

    knowledge = Knowledge.HONEST_RULE
    paper = "Xie, Koyejo, Gupta, UAI 2019; Allouah et al., AISTATS 2023"

    def __init__(self, *, epsilon_max: Optional[float] = None, grid: int = 40, refine: int = 30,
                 tol: float = 1e-5) -> None:
        self.epsilon_max = None if epsilon_max is None else positive_float(epsilon_max, "epsilon_max", "OptIPM")
        self.grid, self.refine, self.tol = _search_args("OptIPM", grid, refine, tol)
        self.last_epsilon: Optional[float] = None
        self.last_objective: Optional[float] = None

    def _craft(self, honest: torch.Tensor, f: int, *, own: Optional[torch.Tensor],
               rule: Optional[Callable[[torch.Tensor], torch.Tensor]],
               generator: Optional[torch.Generator]) -> torch.Tensor:
        assert rule is not None
        mu = mean64(honest)
        mn = norm64(mu)
        big = torch.finfo(honest.dtype).max

        def rows(eps: float) -> torch.Tensor:
            return (-eps * mu).clamp(-big, big).to(honest.dtype).unsqueeze(0).expand(f, -1)

        objective = rule_objective(rule, honest, mu, rows)
        if mn == 0.0:
            best, best_j = 0.0, objective(0.0)
        else:
            eps_max = self.epsilon_max
            if eps_max is None:
                spread = float(((honest.to(torch.float64) - mu) ** 2).sum(dim=1).max()) ** 0.5
                eps_max = 1024.0 * max(1.0, spread / mn)
            best, best_j = line_search(objective, eps_max, grid=self.grid, refine=self.refine, tol=self.tol)
        self.last_epsilon, self.last_objective = best, best_j
        return rows(best)

    def _params(self) -> dict[str, Any]:
        return {"epsilon_max": self.epsilon_max, "grid": self.grid, "refine": self.refine, "tol": self.tol}
