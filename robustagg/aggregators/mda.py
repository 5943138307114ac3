"""Minimum-Diameter Averaging."""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import functional as F
from ..functional.weights import selection_weights
from ..errors import ConfigError
from ..registry import register
from ..requirements import Requirement, linear
from .base import Aggregator, positive_int

__all__ = ["MinimumDiameterAveraging"]


@register("mda")
class MinimumDiameterAveraging(Aggregator):
    r"""Minimum-Diameter Averaging (MDA).

    Definition: among all subsets S of ``n - f`` rows, take the one with the smallest diameter
    ``max_{i,j in S} ||x_i - x_j||`` (the lexicographically first on ties) and output its mean.

    Requirement: ``n >= 2f + 1`` (El Mhamdi, Guerraoui, Rouault, "Distributed momentum for
    Byzantine-resilient SGD", ICLR 2021). Cost: ``C(n, f)`` subsets.

    Args:
        f: declared Byzantine bound.
        max_subsets: refuse inputs with more than this many subsets ``C(n, f)``. Default 200000.
        strict: raise (default) or warn when the requirement fails.

    Shape: ``(n, d) -> (d,)``.

    Raises:
        AssumptionError, ShapeError, NonFiniteInputError: see :class:`Aggregator`.
        ConfigError: ``C(n, f) > max_subsets`` (raise ``max_subsets`` or use Krum/NNM).

    Example:
        >>> import torch, robustagg as ra
        >>> x = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [9.0, 9.0], [1.0, 1.0]])
        >>> ra.MinimumDiameterAveraging(f=1)(x)
        tensor([0.5000, 0.7500])
    """

    display_name = "MDA"
    gram_checks_finite = True
    paper = "El Mhamdi, Guerraoui, Rouault, ICLR 2021"
    selects_rows = True
    breakdown_point = "1/2"

    def __init__(self, *, f: int = 0, max_subsets: int = 200_000, strict: bool = True) -> None:
        super().__init__(f=f, strict=strict)
        self.max_subsets = positive_int(max_subsets, "max_subsets", "MDA")

    @property
    def requirement(self) -> Requirement:
        return linear("MDA", 2, 1, self.paper, breakdown="1/2")

    def _select(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        f = min(self.f, n - 1)
        count = math.comb(n, f)
        if count > self.max_subsets:
            raise ConfigError(f"MDA: C(n={n}, f={f}) = {count} subsets exceeds max_subsets={self.max_subsets}; "
                              "raise max_subsets or use a polynomial rule (krum, nnm).")
        return F.mda_select(F.pairwise_sq_distances(x), f).to(x.device)

    def _aggregate(self, x: torch.Tensor) -> torch.Tensor:
        return F.distance.mean_of_rows(x, self._select(x))

    def _weights(self, x: torch.Tensor) -> torch.Tensor:
        return selection_weights(x.shape[0], self._select(x), x.device)

    def _params(self) -> dict[str, Any]:
        return {"f": self.f, "max_subsets": self.max_subsets}
