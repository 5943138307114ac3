"""Coordinate-wise rules: Mean, CoordinateWiseMedian, CoordinateWiseTrimmedMean, MeaMed."""

from __future__ import annotations

import torch

from .. import functional as F
from ..functional.weights import meamed_weights, order_statistic_weights
from ..registry import register
from ..requirements import Requirement, linear
from .base import Aggregator

__all__ = ["Mean", "CoordinateWiseMedian", "CoordinateWiseTrimmedMean", "MeaMed"]


def _r(n: int, f: int) -> float:
    return f / (n - 2 * f)


@register("mean")
class Mean(Aggregator):
    r"""Arithmetic mean of the submissions, the non-robust baseline.

    Definition: ``F(X) = (1/n) sum_{i=1..n} x_i``.

    Requirement: ``f = 0``. A single Byzantine row moves the output arbitrarily far (breakdown point
    0). Declaring ``f >= 1`` is allowed, as the baseline of robustness studies, with an
    :class:`~robustagg.errors.AssumptionWarning` (never an error).

    Args:
        f: declared Byzantine bound (only used for the warning and the requirement).
        strict: ignored (the mean never refuses); kept for a uniform signature.

    Shape: ``(n, d) -> (d,)``, dtype and device of the input.

    Raises:
        ShapeError, NonFiniteInputError: see :class:`Aggregator`.

    Example:
        >>> import torch, robustagg as ra
        >>> ra.Mean()(torch.tensor([[0.0, 1.0], [2.0, 3.0], [10.0, -4.0]]))
        tensor([4., 0.])
    """

    display_name = "Mean"
    f_matters = False  # f = 0 is the mean's honest declaration
    paper = "baseline (no robustness)"
    coordinatewise = True
    breakdown_point = "0"

    @property
    def requirement(self) -> Requirement:
        return Requirement("Mean", "f = 0", lambda n, f: f == 0 and n >= 1, self.paper, breakdown="0",
                           advisory=True)

    def _aggregate(self, x: torch.Tensor) -> torch.Tensor:
        return F.mean(x)

    def _weights(self, x: torch.Tensor) -> torch.Tensor:
        return torch.full((x.shape[0],), 1.0 / x.shape[0], dtype=torch.float64, device=x.device)


@register("coordinate_median")
class CoordinateWiseMedian(Aggregator):
    r"""Coordinate-wise median (CWMed).

    Definition: for each coordinate j, the median of ``x_1[j], ..., x_n[j]``; for even ``n`` the
    **average of the two middle values**.

    Requirement: ``n >= 2f + 1`` (Yin, Chen, Ramchandran, Bartlett, ICML 2018). Then it is
    (f, kappa)-robust with ``kappa <= 4 (1 + f/(n-2f))^2`` (Allouah et al., AISTATS 2023).
    Breakdown point 1/2 per coordinate.

    Args:
        f: declared Byzantine bound (keyword-only).
        strict: raise (default) or warn when the requirement fails.

    Shape: ``(n, d) -> (d,)``.

    Raises:
        AssumptionError, ShapeError, NonFiniteInputError, ConfigError: see :class:`Aggregator`.

    Note:
        ``torch.median`` (and some public Byzantine-ML code built on it) returns the *lower* middle
        for even n; this rule averages the two middles, as ``numpy.median`` does.

    Example:
        >>> import torch, robustagg as ra
        >>> x = torch.tensor([[1.0, 9.0], [2.0, 0.0], [4.0, 1.0], [100.0, 3.0]])
        >>> ra.CoordinateWiseMedian(f=1)(x)
        tensor([3., 2.])
    """

    display_name = "Coordinate-wise median"
    paper = "Yin et al., ICML 2018"
    coordinatewise = True
    breakdown_point = "1/2"

    def __init__(self, *, f: int = 0, strict: bool = True) -> None:
        super().__init__(f=f, strict=strict)

    @property
    def requirement(self) -> Requirement:
        return linear("Coordinate-wise median", 2, 1, self.paper,
                      kappa=lambda n, f: 4 * (1 + _r(n, f)) ** 2, kappa_formula="4(1 + f/(n-2f))^2",
                      breakdown="1/2")

    def _aggregate(self, x: torch.Tensor) -> torch.Tensor:
        return F.coordinate_median(x)

    def _weights(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        lo, hi = (n - 1) // 2, n // 2
        return order_statistic_weights(x, [lo] if lo == hi else [lo, hi], 1.0 if lo == hi else 0.5)


@register("trimmed_mean")
class CoordinateWiseTrimmedMean(Aggregator):
    r"""Coordinate-wise trimmed mean (CWTM).

    Definition: for each coordinate, sort the n values, drop the ``f`` largest and the ``f``
    smallest, and average the remaining ``n - 2f``.

    Requirement: ``n >= 2f + 1`` (Yin et al., ICML 2018); (f, kappa)-robust with
    ``kappa <= (6f/(n-2f)) (1 + f/(n-2f))`` (Allouah et al., AISTATS 2023). Breakdown point f/n < 1/2.

    Args:
        f: declared Byzantine bound; exactly ``f`` values are trimmed at each end.
        strict: raise (default) or warn when the requirement fails.

    Shape: ``(n, d) -> (d,)``.

    Raises:
        AssumptionError, ShapeError, NonFiniteInputError, ConfigError: see :class:`Aggregator`.

    Note:
        Some public code trims a fraction ``beta`` of n (rounded); here the count ``f`` is explicit.

    Example:
        >>> import torch, robustagg as ra
        >>> x = torch.tensor([[1.0, 9.0], [2.0, 0.0], [4.0, 1.0], [100.0, 3.0], [5.0, 5.0]])
        >>> ra.CoordinateWiseTrimmedMean(f=1)(x)
        tensor([3.6667, 3.0000])
    """

    display_name = "Trimmed mean"
    paper = "Yin et al., ICML 2018"
    coordinatewise = True
    breakdown_point = "f/n < 1/2"

    def __init__(self, *, f: int = 0, strict: bool = True) -> None:
        super().__init__(f=f, strict=strict)

    @property
    def requirement(self) -> Requirement:
        return linear("Trimmed mean", 2, 1, self.paper,
                      kappa=lambda n, f: (6 * _r(n, f)) * (1 + _r(n, f)),
                      kappa_formula="(6f/(n-2f))(1 + f/(n-2f))", breakdown="f/n")

    def _aggregate(self, x: torch.Tensor) -> torch.Tensor:
        if 2 * self.f >= x.shape[0]:  # strict=False past the bound: nothing left to average
            return F.coordinate_median(x)
        return F.trimmed_mean(x, self.f)

    def _weights(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if 2 * self.f >= n:
            return CoordinateWiseMedian()._weights(x)
        return order_statistic_weights(x, list(range(self.f, n - self.f)), 1.0 / (n - 2 * self.f))


@register("meamed")
class MeaMed(Aggregator):
    r"""Mean around the median (MeaMed).

    Definition: for each coordinate j, with ``m_j`` the coordinate median (even-n average of the two
    middles), average the ``n - f`` values ``x_i[j]`` closest to ``m_j``.

    Requirement: ``n >= 2f + 1`` (Xie, Koyejo, Gupta, "Generalized Byzantine-tolerant SGD", 2018).
    No kappa bound is stated here.

    Args:
        f: declared Byzantine bound.
        strict: raise (default) or warn when the requirement fails.

    Shape: ``(n, d) -> (d,)``.

    Raises:
        AssumptionError, ShapeError, NonFiniteInputError, ConfigError: see :class:`Aggregator`.

    Note:
        Values at equal distance from the median are kept lowest row index first.

    Example:
        >>> import torch, robustagg as ra
        >>> x = torch.tensor([[1.0, 9.0], [2.0, 0.0], [4.0, 1.0], [100.0, 3.0], [5.0, 5.0]])
        >>> ra.MeaMed(f=1)(x)
        tensor([3.0000, 2.2500])
    """

    display_name = "MeaMed"
    paper = "Xie, Koyejo, Gupta, 2018"
    coordinatewise = True
    breakdown_point = "1/2"

    def __init__(self, *, f: int = 0, strict: bool = True) -> None:
        super().__init__(f=f, strict=strict)

    @property
    def requirement(self) -> Requirement:
        return linear("MeaMed", 2, 1, self.paper, breakdown="1/2")

    def _aggregate(self, x: torch.Tensor) -> torch.Tensor:
        return F.meamed(x, min(self.f, x.shape[0] - 1))

    def _weights(self, x: torch.Tensor) -> torch.Tensor:
        return meamed_weights(x, min(self.f, x.shape[0] - 1), F.coordinate_median(x))
