"""Optimised perturbations of Shejwalkar & Houmansadr (NDSS 2021): MinMax, MinSum, AGR-tailored."""

from __future__ import annotations

import abc

import copy
import math
from typing import Any, Callable, Optional

import torch

from robustagg.errors import ConfigError

from ._stats import DIRECTIONS, direction, mean64, norm64, pow2_scale
from .base import Attack, Knowledge, choice, positive_float
from .registry import register

__all__ = ["MinMax", "MinSum", "AGRTailored", "line_search", "rule_objective"]

_Rule = Optional[Callable[[torch.Tensor], torch.Tensor]]


def _scaled(honest: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Float64 honest rows divided by a power of two >= max |x| (exact), and that scale."""
    s = pow2_scale(honest)
    return honest.to(torch.float64) / s, s


def _gamma_units(gamma_scaled: float, s: float, kind: str) -> float:
    """gamma in the input's units: ``p`` is scale-free for unit/sign and scales with x for std."""
    return gamma_scaled if kind == "std" else gamma_scaled * s


def line_search(objective: Callable[[float], float], lam_max: float, *, grid: int, refine: int,
                tol: float) -> tuple[float, float]:
    """Maximise a scalar ``objective(lam)`` over ``lam in [0, lam_max]``: grid, then step halving.

    ``objective`` is evaluated at ``0`` and on the geometric grid ``lam_max * 2^-k``,
    ``k = grid - 1 .. 0`` (increasing ``lam``); around the best point a step-halving local search
    (``lam +- step`` within ``[0, lam_max]``, ``step`` starting at ``lam/2`` and halved each round)
    runs until the step is below ``tol * lam`` or ``refine`` rounds have run. Only a strict
    improvement moves ``lam``, so ties keep the smaller one. At most ``1 + grid + 2 * refine``
    evaluations; deterministic for a deterministic ``objective``.

    Args:
        objective: ``lam -> J(lam)``, a finite float (larger is better).
        lam_max: the largest ``lam`` searched, ``> 0``.
        grid: number of grid points ``>= 1``; refine: maximum refinement rounds ``>= 0``;
        tol: relative step at which refinement stops, ``> 0``.

    Returns:
        ``(lam, J(lam))``, the best point found and its objective.

    Example:
        >>> line_search(lambda x: -(x - 3.0) ** 2, 8.0, grid=4, refine=0, tol=1e-5)  # grid 0, 1, 2, 4, 8
        (2.0, -1.0)
    """
    best, best_j = 0.0, objective(0.0)
    for k in range(grid - 1, -1, -1):  # increasing lam: ties keep the smaller one
        lam = math.ldexp(lam_max, -k)
        j = objective(lam)
        if j > best_j:
            best, best_j = lam, j
    step = best / 2
    for _ in range(refine):
        if best == 0.0 or step < tol * best:
            break
        for lam in (best - step, best + step):
            if 0.0 <= lam <= lam_max:
                j = objective(lam)
                if j > best_j:
                    best, best_j = lam, j
        step /= 2
    return best, best_j


def rule_objective(rule: Callable[[torch.Tensor], torch.Tensor], honest: torch.Tensor, mu: torch.Tensor,
                   rows: Callable[[float], torch.Tensor]) -> Callable[[float], float]:
    """``lam -> ||rule(cat(honest, rows(lam))) - mu||`` (float64), the rule's state restored after each call.

    ``rows(lam)`` gives the ``(f, d)`` Byzantine rows in the honest dtype; ``mu`` is the float64
    honest mean ``(d,)``. A stateful rule (``state_dict``/``load_state_dict``) is snapshotted once
    here and restored after every evaluation, so the search never changes the defender's state.
    """
    snap = _snapshot(rule)

    def objective(lam: float) -> float:
        try:
            out = rule(torch.cat([honest, rows(lam)]))
        finally:
            _restore(rule, snap)
        return norm64(out.to(torch.float64) - mu)

    return objective


class _Perturbed(Attack):
    """Shared shell: ``b = x̄_H + gamma * p`` with ``p`` one of the three directions."""

    knowledge = Knowledge.HONEST
    paper = "Shejwalkar, Houmansadr, NDSS 2021"

    def __init__(self, *, direction: str = "std") -> None:
        self.direction = choice(direction, "direction", type(self).__name__, DIRECTIONS)
        #: gamma found by the last call (input units), ``None`` before the first call.
        self.last_gamma: Optional[float] = None

    @abc.abstractmethod
    def _gamma(self, y: torch.Tensor, mu: torch.Tensor, p: torch.Tensor) -> float:
        """The largest gamma satisfying the attack's constraint (closed form), in scaled units."""

    def _craft(self, honest: torch.Tensor, f: int, *, own: Optional[torch.Tensor], rule: _Rule,
               generator: Optional[torch.Generator]) -> torch.Tensor:
        y, s = _scaled(honest)
        mu = y.mean(dim=0)
        p = direction(y, self.direction)
        g = 0.0 if float((p * p).sum()) == 0.0 else self._gamma(y, mu, p)
        self.last_gamma = _gamma_units(g, s, self.direction)
        return (mu + g * p) * s

    def _params(self) -> dict[str, Any]:
        return {"direction": self.direction}


@register("min_max")
class MinMax(_Perturbed):
    r"""Min-Max: the honest mean pushed along ``p`` as far as the largest honest distance allows.

    Definition: ``b = x̄_H + gamma * p`` (all ``f`` rows equal) with ``p`` one of
    ``unit = -x̄_H/||x̄_H||``, ``std = -std_H`` (ddof = 1), ``sign = -sign(x̄_H)``, and ``gamma`` the
    largest value with ``max_{i in H} ||b - x_i|| <= R = max_{i,j in H} ||x_i - x_j||``.

    ``||b - x_i||^2 = ||a_i||^2 + 2 gamma <a_i, p> + gamma^2 ||p||^2`` with ``a_i = x̄_H - x_i``
    is a convex quadratic in gamma that is ``<= R^2`` at ``gamma = 0`` (the mean lies in the hull),
    so gamma is computed **in closed form** as the smallest over i of the larger root
    ``gamma_i = (-<a_i,p> + sqrt(<a_i,p>^2 + ||p||^2 (R^2 - ||a_i||^2))) / ||p||^2`` (evaluated in
    the cancellation-free form when ``<a_i,p> > 0``), in float64 on rows divided by a power of two.
    The value is exposed as :attr:`last_gamma`. A zero direction (zero mean with ``unit``/``sign``,
    zero spread with ``std``) gives ``gamma = 0`` and ``b = x̄_H``.

    Knowledge: ``honest`` (omniscient).

    Args:
        direction: ``"unit"``, ``"std"`` (default, the paper's strongest in most settings) or
            ``"sign"``.

    Shape: ``honest (h, d) -> (f, d)``.

    Raises:
        ConfigError: unknown ``direction``.
        ShapeError, NonFiniteInputError: see :class:`~attacks.Attack`.

    Note:
        The authors' public code finds gamma by a step-halving search from a fixed start, which
        approximates the same largest gamma; the closed form here is exact to float64 rounding.

    Example:
        >>> import torch, attacks
        >>> honest = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
        >>> a = attacks.MinMax(direction="unit")
        >>> a(honest, 1), a.last_gamma  # mean (1, 0), p = (-1, 0), R = 2: gamma = 1
        (tensor([[0., 0.]]), 1.0)

    References:
        Shejwalkar, Houmansadr, "Manipulating the Byzantine: optimizing model poisoning attacks and
        defenses for federated learning", NDSS 2021.
    """

    def _gamma(self, y: torch.Tensor, mu: torch.Tensor, p: torch.Tensor) -> float:
        from robustagg.functional import pairwise_sq_distances

        r2 = float(pairwise_sq_distances(y).max())
        a = mu - y
        b = a @ p
        c = (r2 - (a * a).sum(dim=1)).clamp(min=0.0)
        pp = float((p * p).sum())
        root = torch.sqrt(b * b + pp * c)
        pos = b > 0
        safe = torch.where(pos, b + root, torch.ones_like(b))
        gam = torch.where(pos, c / safe, (root - b) / pp)
        return max(0.0, float(gam.min()))


@register("min_sum")
class MinSum(_Perturbed):
    r"""Min-Sum: the honest mean pushed along ``p`` until its summed squared distance hits the worst.

    Definition: ``b = x̄_H + gamma * p`` (all ``f`` rows equal), ``p`` as in :class:`MinMax`, and
    gamma the largest value with
    ``sum_{i in H} ||b - x_i||^2 <= max_{i in H} sum_{j in H} ||x_i - x_j||^2``.

    Closed form: ``sum_i (x̄_H - x_i) = 0`` so the left side is ``S + h gamma^2 ||p||^2`` with
    ``S = sum_i ||x_i - x̄_H||^2``, and ``sum_j ||x_i - x_j||^2 = h ||x_i - x̄_H||^2 + S``; hence
    ``gamma = max_i ||x_i - x̄_H|| / ||p||`` (float64, on rows divided by a power of two), exposed
    as :attr:`last_gamma`; ``gamma = 0`` for a zero direction.

    Knowledge: ``honest`` (omniscient).

    Args:
        direction: ``"unit"``, ``"std"`` (default) or ``"sign"``.

    Shape: ``honest (h, d) -> (f, d)``.

    Raises:
        ConfigError: unknown ``direction``.
        ShapeError, NonFiniteInputError: see :class:`~attacks.Attack`.

    Note:
        Public code finds gamma by step-halving search; the closed form gives the same largest
        gamma exactly.

    Example:
        >>> import torch, attacks
        >>> honest = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
        >>> a = attacks.MinSum(direction="unit")
        >>> a(honest, 1), a.last_gamma  # max_i ||x_i - mean|| = 1, ||p|| = 1
        (tensor([[0., 0.]]), 1.0)

    References:
        Shejwalkar, Houmansadr, NDSS 2021.
    """

    def _gamma(self, y: torch.Tensor, mu: torch.Tensor, p: torch.Tensor) -> float:
        dev = math.sqrt(float(((y - mu) ** 2).sum(dim=1).max()))
        return dev / math.sqrt(float((p * p).sum()))


@register("agr_tailored")
class AGRTailored(Attack):
    r"""AGR-tailored: search the scale along a direction that moves the defender's own rule farthest.

    Definition: ``b(lam) = x̄_H + lam * p`` (all ``f`` rows equal, cast to the honest dtype), ``p``
    one of ``unit``/``std``/``sign`` (see :class:`MinMax`); choose ``lam >= 0`` maximising
    ``J(lam) = ||rule(cat(honest, b(lam), ...)) - x̄_H||`` where ``rule`` is the defender's actual
    aggregator object (any robustagg rule or Pipeline, pre-aggregation included). Rows are stacked
    honest first, then the ``f`` Byzantine rows.

    Search: ``J`` is evaluated at ``0`` and on the geometric grid ``lam_max * 2^-k``,
    ``k = 0 .. grid - 1``; around the best grid point a step-halving local search
    (``lam +- step`` within ``[0, lam_max]``, ``step`` halved each round, starting at ``lam/2``)
    refines ``lam`` until the step is below ``tol * lam`` or ``refine`` rounds have run. Only a
    strict improvement moves ``lam``, so ties keep the smaller one.
    ``lam_max`` defaults to ``1024 * max(max_i ||x_i - x̄_H||, ||x̄_H||) / ||p||``. At most
    ``1 + grid + 2 * refine`` rule calls; the chosen scale and objective are kept in
    :attr:`last_lambda` and :attr:`last_objective`.

    The rule is simply called (``rule(x)``): a rule built with ``strict=True`` whose requirement
    fails raises :class:`~robustagg.errors.AssumptionError`, which propagates. A stateful rule
    (centred clipping's centre, bucketing's RNG) is snapshotted with ``state_dict()`` before the
    search and restored after every evaluation, so the search never changes the defender's state.

    Knowledge: ``honest+rule`` (omniscient and rule-aware).

    Args:
        direction: ``"unit"``, ``"std"`` (default) or ``"sign"``.
        lambda_max: largest scale searched (positive, input units of ``p``); ``None`` = automatic.
        grid: number of geometric grid points, default 40.
        refine: maximum refinement rounds, default 30.
        tol: relative step at which refinement stops, default 1e-5.

    Shape: ``honest (h, d) -> (f, d)``.

    Raises:
        ConfigError: ``rule`` missing; a parameter out of range.
        AssumptionError: from the rule itself.
        ShapeError, NonFiniteInputError: see :class:`~attacks.Attack`.

    Note:
        The authors' algorithm updates gamma by step halving from a fixed start (success: step
        up, failure: step down), with a rule-specific success test (selection for Krum-type rules,
        deviation for the others). This searches the deviation objective for every rule; the
        grid first avoids the local optima a single step-halving run can stop in.

    Example:
        >>> import torch, attacks, robustagg as ra
        >>> honest = torch.tensor([[0.0], [1.0], [2.0], [3.0]])
        >>> a = attacks.AGRTailored(direction="unit", lambda_max=8.0)
        >>> a(honest, 1, rule=ra.Mean())  # the mean is unbounded: lam_max wins, 1.5 - 8
        tensor([[-6.5000]])

    References:
        Shejwalkar, Houmansadr, NDSS 2021.
    """

    knowledge = Knowledge.HONEST_RULE
    paper = "Shejwalkar, Houmansadr, NDSS 2021"

    def __init__(self, *, direction: str = "std", lambda_max: Optional[float] = None, grid: int = 40,
                 refine: int = 30, tol: float = 1e-5) -> None:
        self.direction = choice(direction, "direction", "AGRTailored", DIRECTIONS)
        self.lambda_max = None if lambda_max is None else positive_float(lambda_max, "lambda_max", "AGRTailored")
        for name, v in (("grid", grid), ("refine", refine)):
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "grid" else 0):
                raise ConfigError(f"AGRTailored: {name} must be an integer >= {1 if name == 'grid' else 0}; got {v!r}.")
        self.grid, self.refine = grid, refine
        self.tol = positive_float(tol, "tol", "AGRTailored")
        self.last_lambda: Optional[float] = None
        self.last_objective: Optional[float] = None

    def _craft(self, honest: torch.Tensor, f: int, *, own: Optional[torch.Tensor], rule: _Rule,
               generator: Optional[torch.Generator]) -> torch.Tensor:
        assert rule is not None
        mu = mean64(honest)
        p = direction(honest, self.direction)
        pn = norm64(p)
        big = torch.finfo(honest.dtype).max

        def rows(lam: float) -> torch.Tensor:
            b = (mu + lam * p).clamp(-big, big).to(honest.dtype)
            return b.unsqueeze(0).expand(f, -1)

        objective = rule_objective(rule, honest, mu, rows)

        if pn == 0.0:
            best, best_j = 0.0, objective(0.0)
        else:
            lam_max: float = self.lambda_max if self.lambda_max is not None else 0.0
            if self.lambda_max is None:
                spread = max(float(((honest.to(torch.float64) - mu) ** 2).sum(dim=1).max()) ** 0.5, norm64(mu))
                lam_max = 1024.0 * (spread if spread > 0 else 1.0) / pn
            best, best_j = line_search(objective, lam_max, grid=self.grid, refine=self.refine, tol=self.tol)
        self.last_lambda, self.last_objective = best, best_j
        return rows(best)

    def _params(self) -> dict[str, Any]:
        return {"direction": self.direction, "lambda_max": self.lambda_max, "grid": self.grid,
                "refine": self.refine, "tol": self.tol}


def _snapshot(rule: Callable[[torch.Tensor], torch.Tensor]) -> Optional[dict[str, Any]]:
    sd = getattr(rule, "state_dict", None)
    if callable(sd) and callable(getattr(rule, "load_state_dict", None)):
        return copy.deepcopy(sd())
    return None


def _restore(rule: Callable[[torch.Tensor], torch.Tensor], snap: Optional[dict[str, Any]]) -> None:
    if snap is not None:
        rule.load_state_dict(copy.deepcopy(snap))  # type: ignore[attr-defined]
