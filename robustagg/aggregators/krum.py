"""Distance-based selection rules: Krum, Multi-Krum, Bulyan."""

from __future__ import annotations

import torch

from .. import functional as F
from ..functional.weights import meamed_weights, selection_weights
from ..errors import ConfigError
from ..registry import register
from ..requirements import Requirement, linear
from .base import Aggregator

__all__ = ["Krum", "MultiKrum", "Bulyan"]


@register("krum")
class Krum(Aggregator):
    r"""Krum: the submission closest to its neighbours.

    Definition: ``score(i) = sum_{j in N_i} ||x_i - x_j||^2`` where ``N_i`` are the ``n - f - 2``
    rows closest to ``x_i`` among the **other** rows (self excluded by index, so an exact duplicate
    is a real neighbour at distance 0). Output ``x_{i*}`` with ``i*`` the lowest score (lowest index
    on ties).

    Requirement: ``n >= 2f + 3`` (Blanchard, El Mhamdi, Guerraoui, Stainer, NeurIPS 2017). Then
    (f, kappa)-robust with ``kappa <= 6 (1 + f/(n-2f))`` (Allouah et al., AISTATS 2023).

    Args:
        f: declared Byzantine bound.
        strict: raise (default) or warn when the requirement fails (neighbour counts below zero are
            then clamped to zero).

    Shape: ``(n, d) -> (d,)``; the output is a copy of one input row.

    Raises:
        AssumptionError, ShapeError, NonFiniteInputError, ConfigError: see :class:`Aggregator`.

    Note:
        Some public code uses ``n - f - 1`` neighbours or excludes "self" by zero distance (which
        drops duplicates); this follows the paper's ``n - f - 2``. Distances use a centred float64
        Gram matrix (see :mod:`robustagg.functional.distance`).

    Example:
        >>> import torch, robustagg as ra
        >>> x = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [9.0, 9.0], [1.0, 1.0]])
        >>> ra.Krum(f=1)(x)  # scores 3, 2, 6, 258, 3
        tensor([1., 0.])
    """

    display_name = "Krum"
    gram_checks_finite = True
    paper = "Blanchard et al., NeurIPS 2017"
    translation_equivariant = True
    selects_rows = True
    breakdown_point = "(n-3)/(2n)"

    def __init__(self, *, f: int = 0, strict: bool = True) -> None:
        super().__init__(f=f, strict=strict)

    @property
    def requirement(self) -> Requirement:
        return linear("Krum", 2, 3, self.paper, kappa=lambda n, f: 6 * (1 + f / (n - 2 * f)),
                      kappa_formula="6(1 + f/(n-2f))", breakdown="(n-3)/(2n)")

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """Krum scores of the rows of ``x`` ``(n, d)`` as a float64 ``(n,)`` tensor (no checks)."""
        return F.krum_scores(F.pairwise_sq_distances(x), self.f)

    def _aggregate(self, x: torch.Tensor) -> torch.Tensor:
        return F.krum(x, self.f)

    def _weights(self, x: torch.Tensor) -> torch.Tensor:
        return selection_weights(x.shape[0], torch.argmin(self.scores(x)).reshape(1), x.device)


@register("multi_krum")
class MultiKrum(Aggregator):
    r"""Multi-Krum: the mean of the ``m`` rows with the lowest Krum scores.

    Definition: Krum scores as in :class:`Krum`; output ``(1/m) sum`` of the ``m`` lowest-score rows
    (lowest index first on ties). Default ``m = n - f``.

    Requirement: ``n >= 2f + 3`` and ``1 <= m <= n - f`` (Blanchard et al., NeurIPS 2017).

    Args:
        f: declared Byzantine bound.
        m: number of rows averaged (``None``: ``n - f``).
        strict: raise (default) or warn when the requirement fails.

    Shape: ``(n, d) -> (d,)``.

    Raises:
        AssumptionError, ShapeError, NonFiniteInputError: see :class:`Aggregator`.
        ConfigError: ``m`` is not an integer >= 1.

    Note:
        Some public code *sums* the m selected rows; this takes their mean, so m = 1 is Krum.

    Example:
        >>> import torch, robustagg as ra
        >>> x = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [9.0, 9.0], [1.0, 1.0]])
        >>> ra.MultiKrum(f=1, m=2)(x)  # rows 1 and 0 (score 3 ties with row 4; lowest index)
        tensor([0.5000, 0.0000])
    """

    display_name = "Multi-Krum"
    gram_checks_finite = True
    paper = "Blanchard et al., NeurIPS 2017"
    selects_rows = True
    breakdown_point = "(n-3)/(2n)"

    def __init__(self, *, f: int = 0, m: int | None = None, strict: bool = True) -> None:
        super().__init__(f=f, strict=strict)
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ConfigError(f"Multi-Krum: m must be None or an integer >= 1; got {m!r}.")
        self.m = m

    @property
    def requirement(self) -> Requirement:
        m = self.m
        ineq = "n >= 2f + 3" if m is None else f"n >= 2f + 3 and m={m} <= n - f"
        return Requirement("Multi-Krum", ineq, lambda n, f: n >= 2 * f + 3 and (m is None or m <= n - f),
                           self.paper, breakdown="(n-3)/(2n)")

    def _aggregate(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        m = max(1, n - self.f) if self.m is None else min(self.m, n)
        return F.multi_krum(x, self.f, m)

    def _weights(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        m = max(1, n - self.f) if self.m is None else min(self.m, n)
        scores = F.krum_scores(F.pairwise_sq_distances(x), self.f)
        return selection_weights(n, torch.sort(scores, stable=True).indices[:m], x.device)

    def _params(self) -> dict:
        return {"f": self.f, "m": self.m}


@register("bulyan")
class Bulyan(Aggregator):
    r"""Bulyan: iterated Krum selection, then a coordinate-wise trimmed average around the median.

    Definition: select ``theta = n - 2f`` rows by iterated Krum (each round scores the remaining
    set R with ``|R| - f - 2`` neighbours, removes the winner; lowest original index on ties). Then
    per coordinate average the ``beta = theta - 2f`` selected values closest to their median (even
    count: average of the two middles).

    Requirement: ``n >= 4f + 3`` (El Mhamdi, Guerraoui, Rouault, ICML 2018).

    Args:
        f: declared Byzantine bound.
        strict: raise (default) or warn when the requirement fails; past the bound the rule runs
            with ``f' = floor((n - 1) / 4)`` so that theta and beta stay >= 1.

    Shape: ``(n, d) -> (d,)``.

    Raises:
        AssumptionError, ShapeError, NonFiniteInputError, ConfigError: see :class:`Aggregator`.

    Note:
        Some public code keeps the beta values closest to the median computed with ``torch.median``
        (lower middle); here the median averages the two middles. One distance matrix serves every
        selection round. Not permutation invariant: the last rounds score with ``|R| - f - 2 <= 1``
        neighbours (with 0 every remaining row scores 0 and the lowest index wins; with 1 the two
        mutual nearest rows tie), so the selection, and the output, depend on the row order for
        most inputs with ``f >= 1``. Among values at equal distance from the median, the one
        selected first is kept first.

    Example:
        >>> import torch, robustagg as ra
        >>> x = torch.tensor([[0.0], [1.0], [2.0], [3.0], [4.0], [5.0], [50.0]])
        >>> ra.Bulyan(f=1)(x)
        tensor([2.])
    """

    display_name = "Bulyan"
    gram_checks_finite = True
    paper = "El Mhamdi et al., ICML 2018"
    permutation_invariant = False  # index tie-breaks in the last selection rounds (see Note)
    breakdown_point = "(n-3)/(4n)"

    def __init__(self, *, f: int = 0, strict: bool = True) -> None:
        super().__init__(f=f, strict=strict)

    @property
    def requirement(self) -> Requirement:
        return linear("Bulyan", 4, 3, self.paper, breakdown="(n-3)/(4n)")

    def _aggregate(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        return F.bulyan(x, self._effective_f(n))

    def _effective_f(self, n: int) -> int:
        return min(self.f, max((n - 1) // 4, 0))  # strict=False past the bound: shrink f so theta, beta >= 1

    def _weights(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        f = self._effective_f(n)
        sel = F.bulyan_select(F.pairwise_sq_distances(x), f, n - 2 * f).to(x.device)
        sub = x[sel]
        w = torch.zeros(n, dtype=torch.float64, device=x.device)
        w[sel] = meamed_weights(sub, 2 * f, F.coordinate_median(sub))
        return w
