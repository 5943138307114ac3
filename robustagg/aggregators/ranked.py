"""Rules that average the best-ranked ``n - f`` rows: CGE (by norm) and MoNNA (by distance to a trusted row)."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ConfigError
from ..functional import ranked as K
from ..functional.weights import selection_weights
from ..registry import register
from ..requirements import Requirement, linear
from .base import Aggregator

__all__ = ["CGE", "MoNNA"]


@register("cge")
class CGE(Aggregator):
    r"""Comparative Gradient Elimination (CGE): drop the ``f`` largest-norm rows, average the rest.

    Definition: sort the rows by Euclidean norm ``||x_i||`` (float64; lowest index first on equal
    norms), keep the ``n - f`` smallest, output their mean.

    Requirement: ``n >= 2f + 1`` (an honest majority). Gupta & Vaidya ("Fault-tolerance in
    distributed optimization: the case of redundancy", PODC 2020) prove resilience under
    ``2f``-redundancy of the honest costs and a bound on ``f/n`` that depends on the costs'
    smoothness and strong convexity; that bound is not a function of ``(n, f)`` alone and is not
    checked here. No kappa bound is stated.

    Args:
        f: declared Byzantine bound (rows dropped).
        strict: raise (default) or warn when the requirement fails (then at most ``n - 1`` rows are
            dropped).

    Shape: ``(n, d) -> (d,)``.

    Raises:
        AssumptionError, ShapeError, NonFiniteInputError, ConfigError: see :class:`Aggregator`.

    Note:
        The paper's server update *sums* the ``n - f`` kept gradients; this takes their mean (a
        scale ``1/(n - f)`` of the step size), as Multi-Krum does here. Not translation equivariant:
        norms are measured from the origin.

    Example:
        >>> import torch, robustagg as ra
        >>> x = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 4.0], [-1.0, 0.0]])
        >>> ra.CGE(f=1)(x)  # norms 1, 2, 5, 1: drop row 2
        tensor([0.0000, 0.6667])
    """

    display_name = "CGE"
    paper = "Gupta & Vaidya, PODC 2020"
    translation_equivariant = False
    selects_rows = True
    breakdown_point = "1/2"

    def __init__(self, *, f: int = 0, strict: bool = True) -> None:
        super().__init__(f=f, strict=strict)

    @property
    def requirement(self) -> Requirement:
        return linear("CGE", 2, 1, self.paper, breakdown="1/2")

    def _f(self, n: int) -> int:
        return min(self.f, n - 1)  # strict=False past the bound: keep at least one row

    def _aggregate(self, x: torch.Tensor) -> torch.Tensor:
        return K.cge(x, self._f(x.shape[0]))

    def _weights(self, x: torch.Tensor) -> torch.Tensor:
        return selection_weights(x.shape[0], K.cge_select(x, self._f(x.shape[0])), x.device)


@register("monna")
class MoNNA(Aggregator):
    r"""MoNNA: the mean of the ``n - f`` rows nearest to a trusted row (itself included).

    Definition: with ``t = trusted``, keep row ``t`` and the ``n - f - 1`` other rows of smallest
    ``||x_i - x_t||`` (lowest index first on equal distances), output their mean (Farhadkhani,
    Guerraoui, Gupta, Hoang, Pinot, Stephan, "Robust collaborative learning with linear gradient
    overhead", ICML 2023; there the rows are worker momentums in a peer-to-peer round and each
    honest worker is its own trusted row).

    Requirement: ``n >= 2f + 1`` (the paper's honest-majority setting). No kappa bound is stated.

    Args:
        f: declared Byzantine bound.
        trusted: index of the trusted row (a non-negative int, checked against ``n`` at each call).
            Default 0.
        strict: raise (default) or warn when the requirement fails (then at most ``n - 1`` rows
            are left out).

    Shape: ``(n, d) -> (d,)``.

    Raises:
        AssumptionError, ShapeError, NonFiniteInputError: see :class:`Aggregator`.
        ConfigError: ``trusted`` is not a non-negative int (at construction) or not below ``n``
            (at the call).

    Note:
        Not permutation invariant: the trusted row is chosen by position. Distances come from the
        float64 Gram matrix of the rows, as for Krum and NNM (:mod:`robustagg.functional.distance`).

    Example:
        >>> import torch, robustagg as ra
        >>> x = torch.tensor([[0.0], [1.0], [-3.0], [10.0], [2.0]])
        >>> ra.MoNNA(f=2, trusted=0)(x)  # rows 0, 1, 4 (distances 0, 1, 2)
        tensor([1.])
    """

    display_name = "MoNNA"
    gram_checks_finite = True
    paper = "Farhadkhani et al., ICML 2023"
    permutation_invariant = False
    selects_rows = True
    breakdown_point = "1/2"

    def __init__(self, *, f: int = 0, trusted: int = 0, strict: bool = True) -> None:
        super().__init__(f=f, strict=strict)
        if isinstance(trusted, bool) or not isinstance(trusted, int) or trusted < 0:
            raise ConfigError(f"MoNNA: trusted must be a non-negative row index; got {trusted!r}.")
        self.trusted = trusted

    @property
    def requirement(self) -> Requirement:
        return linear("MoNNA", 2, 1, self.paper, breakdown="1/2")

    def _select(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if self.trusted >= n:
            raise ConfigError(f"MoNNA: trusted={self.trusted} is not a row index for n={n} submissions; "
                              f"pass trusted < n.")
        return K.monna_select(x, min(self.f, n - 1), self.trusted)

    def _aggregate(self, x: torch.Tensor) -> torch.Tensor:
        from ..functional.distance import mean_of_rows

        return mean_of_rows(x, self._select(x))

    def _weights(self, x: torch.Tensor) -> torch.Tensor:
        return selection_weights(x.shape[0], self._select(x), x.device)

    def _params(self) -> dict[str, Any]:
        return {"f": self.f, "trusted": self.trusted}
