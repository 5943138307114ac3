"""Covariance-based rules: SMEA, CAF, DnC (kernels in :mod:`robustagg.functional.spectral`)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import ConfigError
from ..functional import spectral as S
from ..functional.distance import mean_of_rows
from ..functional.gram import robust_gram
from ..functional.weights import selection_weights
from ..registry import register
from ..requirements import Requirement, linear
from .base import Aggregator, positive_float, positive_int

__all__ = ["SMEA", "CAF", "DnC"]


@register("smea")
class SMEA(Aggregator):
    r"""Smallest Maximum Eigenvalue Averaging (SMEA).

    Definition: among all subsets S of ``n - f`` rows, take the one whose empirical covariance
    ``Sigma_S = (1/|S|) sum_{i in S} (x_i - mu_S)(x_i - mu_S)^T`` has the smallest largest eigenvalue
    (the lexicographically first on ties), and output its mean ``mu_S`` (Allouah, Guerraoui, Gupta,
    Pinot, Stephan, "On the privacy-robustness-utility trilemma in distributed learning", ICML 2023).

    Requirement: ``n >= 2f + 1``. Cost: up to ``C(n, f)`` eigenvalue problems of size ``n - f`` on
    the float64 ``(n, n)`` Gram matrix (exact, no power iteration, no ``(d, d)`` matrix; subsets a
    lower bound rules out are skipped). No kappa bound is stated here.

    Ties: the first subset among exactly equal top eigenvalues, in float32 and float64 alike.
    Subsets whose float64 values are within rounding of the best are compared in exact rational
    arithmetic on the rows' values (:func:`robustagg.functional.spectral.smea_select`), so exact
    ties never depend on rounding and differences below rounding are still ordered right; subsets
    holding the same rows up to bitwise copies tie without it. The exact comparison costs about
    ``(K n)^2 d`` float64 operations (``K``: the rows' bit span over 16, 3 or 4 for float32
    Gaussian rows of 10^3 to 10^6 entries) plus small integer polynomials; it runs only on such near ties.

    Args:
        f: declared Byzantine bound.
        max_subsets: refuse inputs with more than this many subsets ``C(n, f)``. Default 200000.
        strict: raise (default) or warn when the requirement fails.

    Shape: ``(n, d) -> (d,)``.

    Raises:
        AssumptionError, ShapeError, NonFiniteInputError: see :class:`Aggregator`.
        ConfigError: ``C(n, f) > max_subsets`` (raise ``max_subsets`` or use CAF, its polynomial
            relative), or ``max_subsets`` not an integer >= 1.

    Example:
        >>> import torch, robustagg as ra
        >>> x = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [9.0, 9.0]])
        >>> ra.SMEA(f=1)(x)  # {0, 1, 2}: covariance eigenvalues 1/3 and 1/9, the smallest top
        tensor([0.3333, 0.3333])
        >>> ra.SMEA(f=1)(torch.tensor([[1.0], [1.0], [3.0], [-1.0]]))  # (1, 1, 3), (1, 1, -1) tie at 8/9: the first
        tensor([1.6667])
    """

    display_name = "SMEA"
    gram_checks_finite = True
    paper = "Allouah et al., ICML 2023"
    selects_rows = True
    breakdown_point = "1/2"

    def __init__(self, *, f: int = 0, max_subsets: int = 200_000, strict: bool = True) -> None:
        super().__init__(f=f, strict=strict)
        self.max_subsets = positive_int(max_subsets, "max_subsets", "SMEA")

    @property
    def requirement(self) -> Requirement:
        return linear("SMEA", 2, 1, self.paper, breakdown="1/2")

    def _select(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        f = min(self.f, n - 1)
        count = math.comb(n, f)
        if count > self.max_subsets:
            raise ConfigError(f"SMEA: C(n={n}, f={f}) = {count} subsets exceeds max_subsets={self.max_subsets}; "
                              "raise max_subsets or use a polynomial rule (caf, dnc).")
        return S.smea_select(robust_gram(x), f, x).to(x.device)

    def _aggregate(self, x: torch.Tensor) -> torch.Tensor:
        return mean_of_rows(x, self._select(x))

    def _weights(self, x: torch.Tensor) -> torch.Tensor:
        return selection_weights(x.shape[0], self._select(x), x.device)

    def _params(self) -> dict[str, Any]:
        return {"f": self.f, "max_subsets": self.max_subsets}


@register("caf")
class CAF(Aggregator):
    r"""Covariance-bound Agnostic Filter (CAF).

    Definition (Allouah, Guerraoui, Stephan, ICML 2025): weights ``c = 1``; at each iterate the
    weighted mean ``mu_c`` and the top eigenpair ``(lam, v)`` of the weighted covariance
    ``Sigma_c = sum_i c_i (x_i - mu_c)(x_i - mu_c)^T / sum c``; each row is down-weighted by
    ``c_i <- c_i (1 - tau_i / tau_max)`` with ``tau_i = <x_i - mu_c, v>^2`` and ``tau_max`` the largest
    ``tau`` among rows of positive weight. Iterate while ``sum c > n - 2f``; output the iterate
    ``mu_c`` with the smallest ``lam`` (the first on ties). No bound on the honest covariance is
    needed ("agnostic").

    Stopping rule: the loop ends when ``sum c <= n - 2f``, when ``lam = 0`` (all remaining weight on
    one point) or after ``n`` iterates (each zeroes at least one row). The top eigenpair is exact
    (``eigh`` of the ``(n, n)`` weighted Gram matrix, float64), the limit of the power iteration;
    see :mod:`robustagg.functional.spectral`.

    Requirement: ``n >= 2f + 1``. No kappa bound is stated here.

    Args:
        f: declared Byzantine bound.
        strict: raise (default) or warn when the requirement fails.

    Shape: ``(n, d) -> (d,)``; the output is a convex combination of the rows.

    Raises:
        AssumptionError, ShapeError, NonFiniteInputError, ConfigError: see :class:`Aggregator`.

    Example:
        >>> import torch, robustagg as ra
        >>> x = torch.tensor([[0.0], [2.0], [4.0], [100.0]], dtype=torch.float64)
        >>> ra.CAF(f=1)(x).round(decimals=4)  # step 1 zeroes row 3; the 2nd iterate has the smallest variance
        tensor([2.0272], dtype=torch.float64)
    """

    display_name = "CAF"
    gram_checks_finite = True
    paper = "Allouah, Guerraoui, Stephan, ICML 2025"
    breakdown_point = "1/2"

    def __init__(self, *, f: int = 0, strict: bool = True) -> None:
        super().__init__(f=f, strict=strict)

    @property
    def requirement(self) -> Requirement:
        return linear("CAF", 2, 1, self.paper, breakdown="1/2")

    def _aggregate(self, x: torch.Tensor) -> torch.Tensor:
        return S.caf(x, self.f)

    def _weights(self, x: torch.Tensor) -> torch.Tensor:
        return S.caf_weights(robust_gram(x), self.f).to(x.device)


@register("dnc")
class DnC(Aggregator):
    r"""Divide-and-Conquer (DnC), a randomised rule with a seeded generator.

    Definition (Shejwalkar & Houmansadr, "Manipulating the Byzantine: optimizing model poisoning
    attacks and defenses for federated learning", NDSS 2021, Algorithm 2): repeat ``iterations``
    times: draw ``b = sub_dim`` distinct coordinates uniformly at random, centre the rows on their
    mean over those coordinates, project them on the top right singular vector of the centred
    ``(n, b)`` submatrix, score each row by its squared projection and keep the ``n - floor(c f)``
    rows of lowest score. Output the mean of the rows kept in every round (when no row is, the rows
    kept in the most rounds: see ``docs/conventions.md``).

    Requirement: ``n >= 2f + 1`` (the paper's honest majority). No kappa bound is stated.

    Args:
        f: declared Byzantine bound.
        sub_dim: coordinates per round ``b`` (``min(b, d)`` are drawn). Default 10000.
        iterations: rounds (>= 1). Default 5.
        c: filtering fraction; ``floor(c f)`` rows (at most ``n - 1``) are dropped per round.
            Default 1.0.
        seed: seed of the coordinate generator (a CPU ``torch.Generator``; its state is the rule's
            state, :meth:`state_dict`). Default 0.
        strict: raise (default) or warn when the requirement fails.

    Shape: ``(n, d) -> (d,)``. Each round copies only the ``(n, b)`` sampled columns (float64).

    Raises:
        AssumptionError, ShapeError, NonFiniteInputError: see :class:`Aggregator`.
        ConfigError: ``sub_dim``/``iterations`` not integers >= 1, ``c`` not a positive number,
            ``seed`` not an int.

    Note:
        Every call advances the generator (fresh coordinates each step); :meth:`reset` re-seeds it.
        Scores within ``1e-9`` of a round's largest score count as tied, lowest index kept first
        (:func:`~robustagg.functional.spectral.rank_with_ties`).
        The default ``sub_dim``, ``iterations`` and ``c`` are this library's choice (the paper leaves
        them as parameters).

    Example:
        >>> import torch, robustagg as ra
        >>> x = torch.tensor([[0.0, 1.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [40.0, 40.0]])
        >>> ra.DnC(f=1)(x)  # the far row scores highest in every round
        tensor([0.5000, 0.5000])
    """

    display_name = "DnC"
    paper = "Shejwalkar & Houmansadr, NDSS 2021"
    selects_rows = True
    breakdown_point = "1/2"

    def __init__(self, *, f: int = 0, sub_dim: int = 10_000, iterations: int = 5, c: float = 1.0, seed: int = 0,
                 strict: bool = True) -> None:
        super().__init__(f=f, strict=strict)
        self.sub_dim = positive_int(sub_dim, "sub_dim", "DnC")
        self.iterations = positive_int(iterations, "iterations", "DnC")
        self.c = positive_float(c, "c", "DnC")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"DnC: seed must be an int; got {seed!r}.")
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def requirement(self) -> Requirement:
        return linear("DnC", 2, 1, self.paper, breakdown="1/2")

    def _select(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return S.dnc_select(x, self.f, self.sub_dim, self.iterations, self.c, generator).to(x.device)

    def _aggregate(self, x: torch.Tensor) -> torch.Tensor:
        return mean_of_rows(x, self._select(x, self.generator))

    def _weights(self, x: torch.Tensor) -> torch.Tensor:
        probe = torch.Generator().manual_seed(0)
        probe.set_state(self.generator.get_state())  # the rows the next call keeps, without a state change
        return selection_weights(x.shape[0], self._select(x, probe), x.device)

    def state_dict(self) -> dict[str, Any]:
        """``{"rule": "dnc", "generator": ByteTensor}``: the coordinate generator's state."""
        return {"rule": self.name, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.generator.set_state(state["generator"])

    def reset(self) -> None:
        """Re-seed the generator with ``seed`` (the next call draws the first call's coordinates)."""
        self.generator.manual_seed(self.seed)

    def _params(self) -> dict[str, Any]:
        return {"f": self.f, "sub_dim": self.sub_dim, "iterations": self.iterations, "c": self.c, "seed": self.seed}
