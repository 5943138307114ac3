"""Directed deviation attacks of Fang, Cao, Jia, Gong (USENIX Security 2020), full-knowledge variants.

The paper writes the attacks on *models*: with ``w_Re`` the before-attack global model and ``s_j``
the sign of the change of its j-th parameter under no attack, the compromised models deviate
against ``s``. On gradients (``w = w_prev - lr * g``) the change of parameter j has the sign of
``-g_Re[j]``, so deviating against it means moving the Byzantine gradient **against**
``sign(g_Re)``; every distance scales by the same ``lr``, so the paper's bounds carry over with
gradients in place of models.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

from robustagg import functional as F
from robustagg.errors import ConfigError

from ._stats import mean64, rand64
from .base import Attack, Knowledge, choice, positive_float
from .registry import register

__all__ = ["FangKrum", "FangTrimmedMean"]

_Rule = Optional[Callable[[torch.Tensor], torch.Tensor]]


def _opt_f(f: Optional[int], attack: str) -> Optional[int]:
    if f is not None and (isinstance(f, bool) or not isinstance(f, int) or f < 0):
        raise ConfigError(f"{attack}: f must be None (use num_byzantine) or an integer >= 0; got {f!r}.")
    return f


@register("fang_krum")
class FangKrum(Attack):
    r"""Fang et al.'s attack on Krum: the largest deviation against the update's sign that Krum still picks.

    Definition (gradient form of the paper's full-knowledge Krum attack): with ``g_Re`` the
    before-attack aggregate and ``s = sign(g_Re)``, every Byzantine row is
    ``b = g_Re - lam * s`` (the paper allows the other ``c - 1`` rows within an epsilon-ball of the
    first; here epsilon = 0, all rows equal). ``lam`` is the largest value found by halving, from
    the paper's upper bound

    ``lam_0 = 1/((m - 2c - 1) sqrt(d)) * min_{i in H} sum_{l in G_i} ||x_l - x_i||
    + 1/sqrt(d) * max_{i in H} ||x_i - g_Re||``

    (``m = h + c`` workers, ``c = num_byzantine``, ``d`` coordinates, ``G_i`` the ``m - c - 2``
    honest rows closest to ``x_i``, distances not squared), such that Krum with bound ``f`` on
    ``cat(honest, b, ..., b)`` gives a Byzantine row a **strictly** lower score than every honest row
    (so the selection does not depend on the row order). Halving stops once ``lam`` falls below
    ``threshold * lam_0``; if no tried ``lam`` succeeds the last (smallest) one tried is used.
    :attr:`last_upper_bound` (``lam_0``), :attr:`last_lambda` and :attr:`last_success` record the
    outcome.

    Knowledge: ``honest`` (the paper's full knowledge: every benign gradient, and that the rule is
    Krum with bound ``f``); the defender's rule object is not needed.

    Args:
        reference: ``"krum"`` (default, the paper's before-attack global update: Krum with bound
            ``f`` over the honest rows, neighbour count clamped at 0) or ``"mean"`` (the honest mean,
            the choice of much public code).
        threshold: relative stop of the halving (``lam < threshold * lam_0``), default ``1e-5``.
        f: Krum's declared bound assumed by the attacker; ``None`` (default) = ``num_byzantine``.

    Shape: ``honest (h, d) -> (c, d)``.

    Raises:
        ConfigError: a parameter out of range.
        ShapeError, NonFiniteInputError: see :class:`~attacks.Attack`.

    Note:
        Assumptions: the benign set is the honest rows only (the Byzantine workers' own benign
        gradients are not used); ``m - 2c - 1`` is clamped to at least 1 where Krum's requirement
        fails; a coordinate with ``g_Re[j] = 0`` is not deviated. The paper stops at an absolute
        ``1e-5`` in model units; the relative stop here is scale-free. Public code often uses the
        honest mean as ``g_Re`` (``reference="mean"``), an absolute threshold, and copies for the
        ``c - 1`` other rows.

    Example:
        >>> import torch, attacks, robustagg as ra
        >>> honest = torch.tensor([[1.0, 1.0], [1.2, 0.9], [0.9, 1.1], [1.1, 1.2], [0.8, 0.8]])
        >>> a = attacks.FangKrum()
        >>> byz = a(honest, 2)
        >>> a.last_success, bool((ra.Krum(f=2)(torch.cat([honest, byz])) == byz[0]).all())
        (True, True)

    References:
        Fang, Cao, Jia, Gong, "Local model poisoning attacks to Byzantine-robust federated
        learning", USENIX Security 2020.
    """

    knowledge = Knowledge.HONEST
    paper = "Fang, Cao, Jia, Gong, USENIX Security 2020"

    def __init__(self, *, reference: str = "krum", threshold: float = 1e-5, f: Optional[int] = None) -> None:
        self.reference = choice(reference, "reference", "FangKrum", ("krum", "mean"))
        self.threshold = positive_float(threshold, "threshold", "FangKrum")
        self.f = _opt_f(f, "FangKrum")
        self.last_upper_bound: Optional[float] = None
        self.last_lambda: Optional[float] = None
        self.last_success: Optional[bool] = None

    def _craft(self, honest: torch.Tensor, f: int, *, own: Optional[torch.Tensor], rule: _Rule,
               generator: Optional[torch.Generator]) -> torch.Tensor:
        h, d = honest.shape
        c, kf = f, (f if self.f is None else self.f)
        m = h + c
        dist_h = F.pairwise_sq_distances(honest)
        if self.reference == "krum":
            g_re = honest[int(torch.argmin(F.krum_scores(dist_h, kf)))].to(torch.float64)
        else:
            g_re = mean64(honest)
        s = torch.sign(g_re)
        big = torch.finfo(honest.dtype).max

        def rows(lam: float) -> torch.Tensor:
            return (g_re - lam * s).clamp(-big, big).to(honest.dtype).unsqueeze(0).expand(c, d)

        # The paper's upper bound (distances, not squared).
        k = min(max(m - c - 2, 0), h - 1)
        near = torch.sort(dist_h.sqrt() + torch.diag(torch.full((h,), math.inf, dtype=torch.float64,
                                                                 device=dist_h.device)), dim=1).values
        term1 = float(near[:, :k].sum(dim=1).min()) if k > 0 else 0.0
        dev = float(((honest.to(torch.float64) - g_re) ** 2).sum(dim=1).max().sqrt())
        lam0 = term1 / (max(m - 2 * c - 1, 1) * math.sqrt(d)) + dev / math.sqrt(d)
        lam, success = lam0, False
        if float(s.abs().sum()) > 0 and lam0 > 0:
            while True:
                x = torch.cat([honest, rows(lam)])
                scores = F.krum_scores(F.pairwise_sq_distances(x), kf)
                if float(scores[h:].min()) < float(scores[:h].min()):
                    success = True
                    break
                if lam / 2 < self.threshold * lam0:
                    break
                lam /= 2
        else:
            lam = 0.0
        self.last_upper_bound, self.last_lambda, self.last_success = lam0, lam, success
        return rows(lam)

    def _params(self) -> dict[str, Any]:
        return {"reference": self.reference, "threshold": self.threshold, "f": self.f}


@register("fang_trimmed_mean")
class FangTrimmedMean(Attack):
    r"""Fang et al.'s attack on the trimmed mean (and median): values just past the honest extremes.

    Definition (gradient form of the paper's full-knowledge trimmed-mean attack): with ``g_Re`` the
    before-attack aggregate, ``g_max[j]``/``g_min[j]`` the largest/smallest honest value of
    coordinate j and ``b > 1``, each of the ``c`` Byzantine values of coordinate j is drawn
    independently and uniformly from

    - ``g_Re[j] > 0`` (the parameter would decrease; push it up, i.e. the gradient down):
      ``[g_min/b, g_min]`` if ``g_min > 0``, else ``[b g_min, g_min]``;
    - ``g_Re[j] < 0``: ``[g_max, b g_max]`` if ``g_max > 0``, else ``[g_max, g_max/b]``;
    - ``g_Re[j] = 0``: treated as ``> 0``.

    Every Byzantine value lies beyond the honest extreme on the side opposite to the update, so
    the trimmed mean (and median) of the step moves against it.

    Knowledge: ``honest`` (full knowledge: every benign gradient).

    Args:
        b: interval factor ``>= 1``, default ``2.0`` (the paper's choice).
        reference: ``"trimmed_mean"`` (default, the paper's before-attack global update: trimmed
            mean of the honest rows dropping ``min(f, (h - 1) // 2)`` per side) or ``"mean"``.
        f: trimming count assumed for the reference; ``None`` (default) = ``num_byzantine``.

    Shape: ``honest (h, d) -> (c, d)``; samples drawn in float64 from ``generator``.

    Raises:
        ConfigError: a parameter out of range.
        ShapeError, NonFiniteInputError: see :class:`~attacks.Attack`.

    Note:
        The paper's partial-knowledge variant estimates the extremes from the compromised workers'
        own gradients (mean +- 3 or 4 standard deviations); it is not implemented here. The
        authors' public gradient code takes the sign of the sum of all gradients as the direction
        (``reference="mean"``) and divides or multiplies the extreme by a uniform factor in
        ``[1, b]``, which is not uniform on the interval.

    Example:
        >>> import torch, attacks
        >>> honest = torch.tensor([[1.0, -2.0], [3.0, -1.0]])
        >>> byz = attacks.FangTrimmedMean()(honest, 3, generator=torch.Generator().manual_seed(0))
        >>> bool(((byz[:, 0] >= 0.5) & (byz[:, 0] <= 1.0)).all()), bool((byz[:, 1] >= -1.0).all())
        (True, True)

    References:
        Fang, Cao, Jia, Gong, USENIX Security 2020.
    """

    knowledge = Knowledge.HONEST
    paper = "Fang, Cao, Jia, Gong, USENIX Security 2020"

    def __init__(self, *, b: float = 2.0, reference: str = "trimmed_mean", f: Optional[int] = None) -> None:
        self.b = positive_float(b, "b", "FangTrimmedMean")
        if self.b < 1:
            raise ConfigError(f"FangTrimmedMean: b must be >= 1; got {b!r}.")
        self.reference = choice(reference, "reference", "FangTrimmedMean", ("trimmed_mean", "mean"))
        self.f = _opt_f(f, "FangTrimmedMean")

    def _craft(self, honest: torch.Tensor, f: int, *, own: Optional[torch.Tensor], rule: _Rule,
               generator: Optional[torch.Generator]) -> torch.Tensor:
        x = honest.to(torch.float64)
        h, d = x.shape
        if self.reference == "trimmed_mean":
            ref = F.trimmed_mean(x, min(f if self.f is None else self.f, (h - 1) // 2))
        else:
            ref = x.mean(dim=0)
        gmax, gmin = x.max(dim=0).values, x.min(dim=0).values
        b, big = self.b, torch.finfo(torch.float64).max
        down = ref >= 0  # push the gradient below g_min
        lo = torch.where(down, torch.where(gmin > 0, gmin / b, gmin * b), gmax).clamp(-big, big)
        hi = torch.where(down, gmin, torch.where(gmax > 0, gmax * b, gmax / b)).clamp(-big, big)
        u = rand64((f, d), generator, honest.device)
        return lo * (1 - u) + hi * u  # lo and hi share a sign: no overflow

    def _params(self) -> dict[str, Any]:
        return {"b": self.b, "reference": self.reference, "f": self.f}
