"""Rules that keep a majority cluster of rows: SignGuard, ClippedClustering, FLAME.

All three run a clustering algorithm from scikit-learn on ``n`` points (imported on first use)
and are seeded where they draw random numbers: the generator's state is the rule's state
(:meth:`state_dict`), so every rank of a run, and a resumed run, draws the same numbers.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import ConfigError
from ..functional import clustering as C
from ..registry import register
from ..requirements import Requirement, linear
from .base import Aggregator, positive_float, positive_int

__all__ = ["SignGuard", "ClippedClustering", "FLAME"]


def _generator(generator: torch.Generator | None, seed: object, rule: str) -> torch.Generator:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"{rule}: seed must be a non-negative integer; got {seed!r}.")
    if generator is not None and (not isinstance(generator, torch.Generator) or generator.device.type != "cpu"):
        raise ConfigError(f"{rule}: generator must be a CPU torch.Generator (or None to seed one with seed); "
                          f"got {generator!r}.")
    return generator if generator is not None else torch.Generator().manual_seed(seed)


def _probe(generator: torch.Generator) -> torch.Generator:
    """A copy of ``generator``: draws the same numbers without advancing it."""
    probe = torch.Generator()
    probe.set_state(generator.get_state())
    return probe


class _Seeded(Aggregator):
    """A rule whose only state is a CPU generator."""

    generator: torch.Generator
    seed: int

    def state_dict(self) -> dict[str, Any]:
        """``{"rule": name, "generator": ByteTensor}``: the generator's state."""
        return {"rule": self.name, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.generator.set_state(state["generator"])

    def reset(self) -> None:
        """Reseed the generator with ``seed``."""
        self.generator.manual_seed(self.seed)


@register("signguard")
class SignGuard(_Seeded):
    r"""SignGuard: norm filter, sign-statistics clustering, clipping to the median norm.

    Definition (Xu, Huang, Song, Lan, ICDCS 2022, Alg. 1, the plain variant on sign statistics),
    as the authors' code (``signguard_multiclass``) specifies it: with ``M`` the median row norm,
    keep ``S1 = {i : lower M < ||x_i|| < upper M}``; over a sample of columns compute each row's
    fractions of positive, zero and negative entries, divide each of the three by its largest value
    over the rows, and cluster these ``(n, 3)`` features with
    ``MeanShift(bin_seeding=True, cluster_all=False)``; ``S2`` = the largest cluster (rows far from
    every cluster centre belong to none); output ``sum_{i in S1 ∩ S2} min(1, C/||x_i||) x_i / |S1 ∩ S2|``
    with ``C`` the median norm, the lower middle for even ``n`` (zero when the set is empty).

    Requirement: ``n >= 2f + 1`` (the honest rows must form the largest cluster). No
    (f, kappa) bound is published. Breakdown point 1/2.

    Args:
        lower: lower end of the open norm band, relative to ``M`` (0 < lower < 1). Default 0.1.
        upper: upper end of the band (> 1). Default 3.0 (both the paper's).
        fraction: share of the columns sampled for the sign statistics, in (0, 1]. Default 0.1.
        quantile: MeanShift bandwidth = ``sklearn.cluster.estimate_bandwidth(quantile=...)``, in
            (0, 1]. Default 0.5 (the authors').
        seed: seeds the generator when ``generator`` is None. Default 0.
        generator: a CPU ``torch.Generator`` for the column sample (its state is the rule's state).
        f: declared Byzantine bound (only checked against the requirement).
        strict: raise (default) or warn when the requirement fails.

    Shape: ``(n, d) -> (d,)``.

    Raises:
        AssumptionError, ShapeError, NonFiniteInputError: see :class:`Aggregator`.
        ConfigError: a hyperparameter out of range.

    Note:
        Followed from the authors' code, which the paper leaves open: the band is open at both
        ends; ``M`` is ``numpy.median`` (even ``n``: the mean of the two middle norms) but the
        clipping norm ``C`` is ``torch.median`` (the lower middle); each feature column is divided
        by its maximum plus ``1e-8``; equally large clusters: the lowest MeanShift label (most
        points within the bandwidth of its centre). Ours: the column sample is every ``s``-th
        column from a random start, ``s = round(1/fraction)``, the start drawn from the generator
        at each call (the authors take ``int(0.1 d)`` consecutive columns from a random start; a
        systematic sample reads the columns as a strided view, with no index tensor and every
        column equally likely); the bandwidth is estimated on every row (the authors pass
        ``n_samples=50``: the same rows up to their order when ``n <= 50``, a subsample that
        depends on the row order above); a bandwidth of 0 (``n <= 3``, or identical features),
        which scikit-learn refuses, gives one cluster; NaN rows are refused (the authors set NaN
        entries to 0); ``M = 0`` gives zero (the authors' band is empty and their mean NaN). Not
        translation equivariant (signs and norms are not).

    Example:
        >>> import torch, robustagg as ra
        >>> x = torch.tensor([[1.0, 1.0], [1.0, 2.0], [2.0, 1.0], [-90.0, -90.0]], dtype=torch.float64)
        >>> ra.SignGuard(f=1, fraction=1.0)(x)  # the last row fails the norm band and the sign cluster
        tensor([1.3333, 1.3333], dtype=torch.float64)
    """

    display_name = "SignGuard"
    paper = "Xu et al., ICDCS 2022"
    translation_equivariant = False
    breakdown_point = "1/2"

    def __init__(self, *, lower: float = 0.1, upper: float = 3.0, fraction: float = 0.1, quantile: float = 0.5,
                 seed: int = 0, generator: torch.Generator | None = None, f: int = 0, strict: bool = True) -> None:
        super().__init__(f=f, strict=strict)
        self.lower = positive_float(lower, "lower", "SignGuard")
        self.upper = positive_float(upper, "upper", "SignGuard")
        if not self.lower < 1.0 < self.upper:
            raise ConfigError(f"SignGuard: need lower < 1 < upper (the band is open and the median row must pass); "
                              f"got lower={lower!r}, upper={upper!r}.")
        for name, v in (("fraction", fraction), ("quantile", quantile)):
            if positive_float(v, name, "SignGuard") > 1.0:
                raise ConfigError(f"SignGuard: {name} must be in (0, 1]; got {v!r}.")
        self.fraction, self.quantile = float(fraction), float(quantile)
        self.seed = seed
        self.generator = _generator(generator, seed, "SignGuard")

    @property
    def requirement(self) -> Requirement:
        return linear("SignGuard", 2, 1, self.paper, breakdown="1/2")

    def _columns(self, d: int, generator: torch.Generator) -> tuple[int, int]:
        stride = max(1, round(1.0 / self.fraction))
        offset = int(torch.randint(min(stride, d), (1,), generator=generator))
        return offset, stride

    def _aggregate(self, x: torch.Tensor) -> torch.Tensor:
        offset, stride = self._columns(x.shape[1], self.generator)
        return C.signguard(x, offset, stride, self.lower, self.upper, self.quantile)

    def _weights(self, x: torch.Tensor) -> torch.Tensor:
        offset, stride = self._columns(x.shape[1], _probe(self.generator))
        return C.signguard_coefficients(x, offset, stride, self.lower, self.upper, self.quantile)

    def _params(self) -> dict[str, Any]:
        return {"lower": self.lower, "upper": self.upper, "fraction": self.fraction, "quantile": self.quantile,
                "seed": self.seed, "f": self.f}


@register("clipped_clustering")
class ClippedClustering(Aggregator):
    r"""ClippedClustering: clip to the median of all norms seen, keep the larger cosine cluster, average.

    Definition (Li, Ngai, Voigt, "An experimental study of Byzantine-robust aggregation schemes in
    federated learning", IEEE Trans. Big Data 2023): ``tau`` = median of the norms of every row
    submitted so far (this call's included); each row is clipped, ``x_i min(1, tau/||x_i||)``;
    agglomerative clustering (average linkage, two clusters) on the cosine distances
    ``1 - cos(x_i, x_j)``; the output is the mean of the clipped rows of the larger cluster.

    Requirement: ``n >= 2f + 1`` (the honest rows must be the larger cluster). No (f, kappa)
    bound is published. Breakdown point 1/2.

    Args:
        f: declared Byzantine bound (only checked against the requirement).
        strict: raise (default) or warn when the requirement fails.

    State: the float64 norms of every earlier row (:meth:`state_dict`), ``n`` numbers per call.

    Shape: ``(n, d) -> (d,)``.

    Raises:
        AssumptionError, ShapeError, NonFiniteInputError: see :class:`Aggregator`.

    Note:
        Fewer than 3 rows are all kept. Ties between two equally large clusters: the one with the
        smaller sum of within-cluster distances, then the one holding the lowest row index. Zero
        rows have cosine 0 with every row. Not translation equivariant.

    Example:
        >>> import torch, robustagg as ra
        >>> x = torch.tensor([[1.0, 0.0], [2.0, 0.2], [1.0, 0.1], [-5.0, 5.0]], dtype=torch.float64)
        >>> ra.ClippedClustering(f=1)(x)  # tau = (1.005 + 2.010)/2 scales (2, 0.2) by 0.75
        tensor([1.1667, 0.0833], dtype=torch.float64)
    """

    display_name = "ClippedClustering"
    gram_checks_finite = True  # the Gram pass names NaN/inf rows before the history changes
    paper = "Li, Ngai, Voigt, IEEE Trans. Big Data 2023"
    translation_equivariant = False
    breakdown_point = "1/2"

    def __init__(self, *, f: int = 0, strict: bool = True) -> None:
        super().__init__(f=f, strict=strict)
        self.history = torch.zeros(0, dtype=torch.float64)

    @property
    def requirement(self) -> Requirement:
        return linear("ClippedClustering", 2, 1, self.paper, breakdown="1/2")

    def _aggregate(self, x: torch.Tensor) -> torch.Tensor:
        a, norms = C.clipped_clustering_coefficients(x, self.history)
        self.history = torch.cat([self.history, norms.cpu()])
        return C.combine(x, a)

    def _weights(self, x: torch.Tensor) -> torch.Tensor:
        return C.clipped_clustering_coefficients(x, self.history)[0]

    def state_dict(self) -> dict[str, Any]:
        """``{"rule": "clipped_clustering", "norms": (k,) float64 tensor}``: every norm seen."""
        return {"rule": self.name, "norms": self.history.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.history = torch.as_tensor(state.get("norms", []), dtype=torch.float64).reshape(-1).clone()

    def reset(self) -> None:
        """Forget the norm history."""
        self.history = torch.zeros(0, dtype=torch.float64)


@register("flame")
class FLAME(_Seeded):
    r"""FLAME: HDBSCAN on cosine distances, clipping to the median norm, Gaussian noise.

    Definition (Nguyen et al., "FLAME: Taming backdoors in federated learning", USENIX Security
    2022, Alg. 1): HDBSCAN on the cosine distances ``1 - cos(x_i, x_j)`` with
    ``min_cluster_size = n//2 + 1`` keeps the majority cluster ``S`` (outliers dropped);
    ``S_t`` = median of the ``n`` norms; output
    ``sum_{i in S} min(1, S_t/||x_i||) x_i / |S| + N(0, sigma^2 I)`` with ``sigma = lam S_t``.

    Requirement: ``n >= 2f + 1`` (the paper assumes fewer than n/2 malicious clients). No
    (f, kappa) bound is published. Breakdown point 1/2.

    Args:
        lam: noise level ``lambda >= 0`` relative to ``S_t``. Default 0.001 (the paper's value for
            image classification); 0 adds no noise.
        min_samples: HDBSCAN's ``min_samples`` (>= 1). Default 1.
        seed: seeds the noise generator when ``generator`` is None. Default 0.
        generator: a CPU ``torch.Generator`` for the noise (its state is the rule's state).
        f: declared Byzantine bound (only checked against the requirement).
        strict: raise (default) or warn when the requirement fails.

    Shape: ``(n, d) -> (d,)``.

    Raises:
        AssumptionError, ShapeError, NonFiniteInputError: see :class:`Aggregator`.
        ConfigError: a hyperparameter out of range.

    Note:
        The paper clusters local *models*; the rule sees updates (model minus global model), so
        cosines are between updates, and ``||x_i||`` is the paper's ``||W_i - G||``. No majority
        cluster: the update is zero (plus noise). Fewer than 3 rows are all kept. Not unanimous
        (noise), not translation equivariant.

    Example:
        >>> import torch, robustagg as ra
        >>> x = torch.tensor([[1.0, 0.0], [1.0, 0.1], [1.1, 0.0], [0.0, -9.0]], dtype=torch.float64)
        >>> ra.FLAME(f=1, lam=0.0)(x)  # last row: HDBSCAN noise; S_t = 1.0525 clips (1.1, 0)
        tensor([1.0175, 0.0333], dtype=torch.float64)
    """

    display_name = "FLAME"
    gram_checks_finite = True  # the Gram pass names NaN/inf rows before any noise is drawn
    paper = "Nguyen et al., USENIX Security 2022"
    translation_equivariant = False
    breakdown_point = "1/2"

    def __init__(self, *, lam: float = 0.001, min_samples: int = 1, seed: int = 0,
                 generator: torch.Generator | None = None, f: int = 0, strict: bool = True) -> None:
        super().__init__(f=f, strict=strict)
        if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not 0 <= lam < math.inf:
            raise ConfigError(f"FLAME: lam must be a finite number >= 0; got {lam!r}.")
        self.lam = float(lam)
        self.min_samples = positive_int(min_samples, "min_samples", "FLAME")
        self.seed = seed
        self.generator = _generator(generator, seed, "FLAME")

    @property
    def requirement(self) -> Requirement:
        return linear("FLAME", 2, 1, self.paper, breakdown="1/2")

    def _aggregate(self, x: torch.Tensor) -> torch.Tensor:
        return C.flame(x, self.lam, self.min_samples, self.generator)

    def _weights(self, x: torch.Tensor) -> torch.Tensor:
        return C.flame_coefficients(x, self.min_samples)[0]

    def _params(self) -> dict[str, Any]:
        return {"lam": self.lam, "min_samples": self.min_samples, "seed": self.seed, "f": self.f}
