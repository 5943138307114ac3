"""Pre-aggregation maps: NNM, Bucketing, Clipping, ARC."""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import functional as F
from ..aggregators.base import positive_float, positive_int
from ..registry import register
from ..requirements import linear
from .base import PreAggregator

__all__ = ["NNM", "Bucketing", "Clipping", "ARC"]


@register("nnm")
class NNM(PreAggregator):
    r"""Nearest Neighbour Mixing (NNM).

    Definition: replace each ``x_i`` by the mean of its ``n - f`` nearest rows **including itself**
    (self first by index, then the nearest others by Euclidean distance, lowest index on ties).

    Requirement: ``n >= 2f + 1`` on top of the following rule's own (Allouah, Farhadkhani,
    Guerraoui, Gupta, Pinot, Stephan, "Fixing by Mixing", AISTATS 2023). If the rule F is
    (f, kappa_F)-robust, F o NNM is (f, kappa)-robust with ``kappa <= (8f/(n-f)) (kappa_F + 1)``.

    Args:
        f: declared Byzantine bound.
        strict: raise (default) or warn when the requirement fails.

    Shape: ``(n, d) -> (n, d)``.

    Raises:
        AssumptionError, ShapeError, NonFiniteInputError, ConfigError: see :class:`PreAggregator`.

    Example:
        >>> import torch, robustagg as ra
        >>> ra.NNM(f=1)(torch.tensor([[0.0], [1.0], [3.0], [10.0]]))
        tensor([[1.3333],
                [1.3333],
                [1.3333],
                [4.6667]])
    """

    display_name = "NNM"
    paper = "Allouah et al., AISTATS 2023"

    def __init__(self, *, f: int = 0, strict: bool = True) -> None:
        super().__init__(f=f, strict=strict)
        self.requirement = linear("NNM", 2, 1, self.paper, kappa_formula="(8f/(n-f))(kappa_F + 1)")

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return F.nnm(x, min(self.f, x.shape[0] - 1))

    def mixing(self, x: torch.Tensor) -> torch.Tensor:
        return F.nnm_weights(F.pairwise_sq_distances(x), min(self.f, x.shape[0] - 1))


@register("bucketing")
class Bucketing(PreAggregator):
    r"""Bucketing: average random buckets of ``s`` rows.

    Definition: permute the rows with ``torch.randperm(n, generator=generator)``, split into
    buckets of ``s`` consecutive rows (the last may be smaller), output the ``ceil(n/s)`` bucket
    means (Karimireddy, He, Jaggi, "Byzantine-robust learning on heterogeneous datasets via
    bucketing", ICLR 2022).

    Requirement: none of its own; the following rule sees ``ceil(n/s)`` rows and still up to ``f``
    bad ones, and :class:`~robustagg.Pipeline` checks the rule's requirement on that count.

    Args:
        s: bucket size (integer >= 1).
        generator: a CPU ``torch.Generator`` for the permutation (its state is this map's state);
            ``None`` creates one seeded with 0.
        f: declared Byzantine bound (informational).

    Shape: ``(n, d) -> (ceil(n/s), d)``.

    Raises:
        ShapeError, NonFiniteInputError: see :class:`PreAggregator`.
        ConfigError: ``s`` not an integer >= 1.

    Example:
        >>> import torch, robustagg as ra
        >>> b = ra.Bucketing(s=2, generator=torch.Generator().manual_seed(0))
        >>> b(torch.tensor([[0.0], [1.0], [2.0], [3.0], [4.0]])).shape
        torch.Size([3, 1])
    """

    display_name = "Bucketing"
    f_matters = False
    paper = "Karimireddy, He, Jaggi, ICLR 2022"

    def __init__(self, *, s: int = 2, generator: torch.Generator | None = None, f: int = 0,
                 strict: bool = True) -> None:
        super().__init__(f=f, strict=strict)
        self.s = positive_int(s, "s", "Bucketing")
        self.generator = generator if generator is not None else torch.Generator().manual_seed(0)

    def output_rows(self, n: int) -> int:
        return math.ceil(n / self.s)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return F.bucketing(x, self.s, self.generator)

    def mixing(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        probe = torch.Generator().manual_seed(0)
        probe.set_state(self.generator.get_state())  # same permutation as the next apply(), no state change
        perm = torch.randperm(n, generator=probe)
        m = torch.zeros(self.output_rows(n), n, dtype=torch.float64)
        for b, start in enumerate(range(0, n, self.s)):
            idx = perm[start:start + self.s]
            m[b, idx] = 1.0 / idx.numel()
        return m.to(x.device)

    def state_dict(self) -> dict[str, Any]:
        """``{"rule": "bucketing", "generator": ByteTensor}``: the permutation RNG state."""
        return {"rule": self.name, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.generator.set_state(state["generator"])

    def __repr__(self) -> str:
        return f"Bucketing(s={self.s})"


@register("clipping")
class Clipping(PreAggregator):
    r"""Static norm clipping: ``x_i * min(1, tau / ||x_i||)`` (zero rows stay zero).

    Requirement: none (it bounds each row's norm; robustness comes from the following rule).

    Args:
        tau: clipping radius (> 0), gradient-norm units.

    Shape: ``(n, d) -> (n, d)``.

    Raises:
        ShapeError, NonFiniteInputError: see :class:`PreAggregator`. ConfigError: bad ``tau``.

    Example:
        >>> import torch, robustagg as ra
        >>> ra.Clipping(tau=1.0)(torch.tensor([[3.0, 4.0], [0.3, 0.4]]))
        tensor([[0.6000, 0.8000],
                [0.3000, 0.4000]])
    """

    display_name = "Clipping"
    f_matters = False
    paper = "static clipping"

    def __init__(self, *, tau: float = 1.0, f: int = 0, strict: bool = True) -> None:
        super().__init__(f=f, strict=strict)
        self.tau = positive_float(tau, "tau", "Clipping")

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return F.clipping(x, self.tau)

    def mixing(self, x: torch.Tensor) -> torch.Tensor:
        return torch.diag(F.clipping_factors(x, self.tau))

    def __repr__(self) -> str:
        return f"Clipping(tau={self.tau})"


@register("arc")
class ARC(PreAggregator):
    r"""Adaptive Robust Clipping (ARC).

    Definition: with ``k = floor(2 (f/n) (n - f))``, the ``k`` rows of largest norm are scaled to
    the norm of the ``(k+1)``-th largest; other rows are unchanged (Allouah, Guerraoui, Gupta,
    Pinot, Rizk, "Boosting robustness by clipping gradients in distributed learning", 2024).

    Requirement: ``n >= 2f + 1``.

    Args:
        f: declared Byzantine bound.
        strict: raise (default) or warn when the requirement fails.

    Shape: ``(n, d) -> (n, d)``.

    Raises:
        AssumptionError, ShapeError, NonFiniteInputError, ConfigError: see :class:`PreAggregator`.

    Example:
        >>> import torch, robustagg as ra
        >>> ra.ARC(f=1)(torch.tensor([[1.0, 0.0], [0.0, 2.0], [30.0, 40.0], [3.0, 0.0]]))
        tensor([[1.0000, 0.0000],
                [0.0000, 2.0000],
                [1.8000, 2.4000],
                [3.0000, 0.0000]])
    """

    display_name = "ARC"
    paper = "Allouah et al., 2024"

    def __init__(self, *, f: int = 0, strict: bool = True) -> None:
        super().__init__(f=f, strict=strict)
        self.requirement = linear("ARC", 2, 1, self.paper)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return F.arc(x, self.f)

    def mixing(self, x: torch.Tensor) -> torch.Tensor:
        return torch.diag(F.arc_factors(x, self.f))
